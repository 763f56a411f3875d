//! The real peers from PyPI, run as child processes in front of the simulated engines:
//! `vllm-router` 0.1.17 (`--policy kv_aware`, fed by the engines' KV events in vLLM's map
//! format) and `sglang-router` 0.3.2 (`--policy cache_aware`, text prompts). They are installed
//! into a venv by `bench/scripts/bench-routing.sh`; a missing one is reported and skipped.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// A peer router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    VllmRouter,
    SglangRouter,
}

impl Peer {
    pub fn name(self) -> &'static str {
        match self {
            Peer::VllmRouter => "vllm-router",
            Peer::SglangRouter => "sglang-router",
        }
    }
}

/// One engine as a peer needs it.
#[derive(Clone, Debug)]
pub struct PeerEngine {
    pub url: String,
    pub events_endpoint: String,
}

/// A running peer; killed when dropped.
#[derive(Debug)]
pub struct Running {
    pub url: String,
    child: Child,
}

impl Running {
    /// Stops the process and waits for it.
    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

/// Why a peer did not start.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("{0} is not installed at {1} (run bench/scripts/bench-routing.sh to install it)")]
    NotInstalled(&'static str, PathBuf),
    #[error("{0} failed to start: {1}")]
    Spawn(&'static str, std::io::Error),
    #[error("{0} did not become ready within {1:?} (log: {2})")]
    NotReady(&'static str, Duration, PathBuf),
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// Starts `peer` on a free port in front of `engines` and waits until it answers.
///
/// # Errors
/// Not installed, not startable, or not ready in time.
pub async fn start(
    peer: Peer,
    venv: &Path,
    engines: &[PeerEngine],
    block_size: usize,
    model: &str,
    log_dir: &Path,
) -> Result<Running, PeerError> {
    let port = free_port();
    let metrics_port = free_port();
    let urls: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
    let mut cmd = match peer {
        Peer::VllmRouter => {
            let bin = venv.join("bin/vllm-router");
            if !bin.exists() {
                return Err(PeerError::NotInstalled(peer.name(), bin));
            }
            let mut c = Command::new(bin);
            c.args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--policy",
                "kv_aware",
            ]);
            c.arg("--worker-urls").args(&urls);
            for e in engines {
                c.args([
                    "--kv-event-source",
                    &format!("{}={}", e.url, e.events_endpoint),
                ]);
            }
            c.args([
                "--kv-event-block-size",
                &block_size.to_string(),
                "--kv-event-model",
                model,
            ]);
            c.args([
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                &metrics_port.to_string(),
            ]);
            c
        }
        Peer::SglangRouter => {
            let py = venv.join("bin/python");
            let ok = py.exists()
                && venv
                    .join("lib")
                    .read_dir()
                    .map(|mut d| {
                        d.any(|p| {
                            p.is_ok_and(|p| p.path().join("site-packages/sglang_router").exists())
                        })
                    })
                    .unwrap_or(false);
            if !ok {
                return Err(PeerError::NotInstalled(peer.name(), venv.to_path_buf()));
            }
            let mut c = Command::new(py);
            c.args([
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ]);
            c.arg("--worker-urls").args(&urls);
            c.args(["--policy", "cache_aware", "--log-level", "warn"]);
            c.args([
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                &metrics_port.to_string(),
            ]);
            c
        }
    };
    let _ = std::fs::create_dir_all(log_dir);
    let log_path = log_dir.join(format!("{}.log", peer.name()));
    let log = std::fs::File::create(&log_path).map_err(|e| PeerError::Spawn(peer.name(), e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| PeerError::Spawn(peer.name(), e))?;
    cmd.stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|e| PeerError::Spawn(peer.name(), e))?;
    let url = format!("http://127.0.0.1:{port}");
    let running = Running {
        url: url.clone(),
        child,
    };
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    // Ready: a completion goes through the router to an engine.
    while Instant::now() < deadline {
        let probe = client
            .post(format!("{url}/v1/completions"))
            .timeout(Duration::from_secs(5))
            .json(&serde_json::json!({"model": model, "prompt": "t1 t2 t3", "max_tokens": 1}))
            .send()
            .await;
        if matches!(probe, Ok(ref r) if r.status().is_success()) {
            return Ok(running);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    running.stop().await;
    Err(PeerError::NotReady(
        peer.name(),
        Duration::from_secs(90),
        log_path,
    ))
}
