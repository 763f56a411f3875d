//! NVIDIA Dynamo's standalone indexer (`python -m dynamo.indexer`, from
//! `ai-dynamo-runtime==1.6.1`) as the collector benchmark's point of comparison: started as a
//! child process, fed by the same publishers over its HTTP API.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_sim::publisher::Publisher;

use crate::loadgen::http_blocking;

/// A running `python -m dynamo.indexer`.
pub struct Dynamo {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Drop for Dynamo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(18090)
}

pub fn start_dynamo(python: &str) -> Result<Dynamo, String> {
    let port = free_port();
    let child = Command::new(python)
        .args([
            "-m",
            "dynamo.indexer",
            "--port",
            &port.to_string(),
            "--threads",
            "1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {python} -m dynamo.indexer: {e}"))?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let d = Dynamo { child, addr };
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        if let Ok((200, _)) = http_blocking(addr, "GET", "/health", b"") {
            return Ok(d);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err("Dynamo indexer did not answer /health within 30 s".into())
}

/// Registers publisher `p` as instance `i + 1` serving `model`.
pub fn dynamo_register(
    d: &Dynamo,
    i: usize,
    p: &Publisher,
    model: &str,
    block_size: usize,
) -> Result<(), String> {
    let body = serde_json::json!({
        "instance_id": i as u64 + 1,
        "endpoint": p.endpoint,
        "replay_endpoint": p.replay_endpoint,
        "model_name": model,
        "block_size": block_size,
        "dp_rank": 0,
    });
    match http_blocking(d.addr, "POST", "/register", body.to_string().as_bytes())? {
        (200..=299, _) => Ok(()),
        (s, b) => Err(format!("register: {s} {}", String::from_utf8_lossy(&b))),
    }
}

/// Dynamo's longest match of `tokens` for `instance`, in tokens.
pub fn dynamo_longest(d: &Dynamo, tokens: &[u32], instance: usize, model: &str) -> u64 {
    let body = serde_json::json!({"token_ids": tokens, "model_name": model});
    let Ok((200, b)) = http_blocking(d.addr, "POST", "/query", body.to_string().as_bytes()) else {
        return 0;
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&b) else {
        return 0;
    };
    let id = (instance + 1).to_string();
    let from_instances = v["instances"].as_object().and_then(|m| {
        m.iter()
            .filter(|(k, _)| **k == id || k.starts_with(&format!("{id}:")))
            .filter_map(|(_, x)| x["longest_matched"].as_u64())
            .max()
    });
    // Fallback: `scores` {worker: {dp_rank: tokens}}.
    from_instances
        .or_else(|| {
            v["scores"][&id]
                .as_object()
                .and_then(|m| m.values().filter_map(|x| x.as_u64()).max())
        })
        .unwrap_or(0)
}
