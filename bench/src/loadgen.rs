//! The HTTP/1.1 side of the collector benchmark: a minimal keep-alive client (requests are
//! pre-serialized, responses read by content-length or chunked) and the closed-loop load
//! generator of the `/query` phases. Hand-written so the client's own cost stays small and
//! visible next to the server's on a 2-core machine.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One load phase's figures.
#[derive(Debug, Clone)]
pub struct Phase {
    pub conns: usize,
    pub rps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub errors: u64,
}

/// Every phase of one /query load run.
pub type QueryStats = Vec<Phase>;

/// One blocking HTTP/1.1 request (setup and polling only).
pub fn http_blocking(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<(u16, Vec<u8>), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let req = request_bytes(method, path, body);
        s.write_all(&req).await.map_err(|e| e.to_string())?;
        let mut buf = Vec::new();
        read_response(&mut s, &mut buf).await
    })
}

pub fn request_bytes(method: &str, path: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// Reads one response (content-length or chunked); returns status and body.
pub async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<(u16, Vec<u8>), String> {
    buf.clear();
    let mut chunk = [0u8; 65536];
    let header_end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("connection closed".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..header_end]).to_ascii_lowercase();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if let Some(len) = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        while buf.len() < header_end + len {
            let n = s.read(&mut chunk).await.map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("connection closed".into());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let body = buf[header_end..header_end + len].to_vec();
        buf.drain(..header_end + len);
        return Ok((status, body));
    }
    // Chunked: read until the last chunk.
    while find(&buf[header_end..], b"0\r\n\r\n").is_none() {
        let n = s.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf[header_end..].to_vec();
    buf.clear();
    Ok((status, body))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Sequential, then `concurrency` concurrent closed-loop load phases on `/query`, each
/// `seconds` long.
pub fn load(
    addr: SocketAddr,
    prompt: &[u32],
    model: &str,
    concurrency: &[usize],
    seconds: f64,
) -> Result<QueryStats, String> {
    let body = serde_json::json!({"token_ids": prompt, "model_name": model}).to_string();
    let req = Arc::new(request_bytes("POST", "/query", body.as_bytes()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("load runtime: {e}"))?;
    let dur = Duration::from_secs_f64(seconds);
    let pct = |v: &[u32], p: f64| {
        v.get(((v.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0) as f64
    };
    let mut phases = Vec::new();
    for conns in std::iter::once(1).chain(concurrency.iter().copied()) {
        let (mut lat, n, errors) = rt.block_on(run_clients(addr, req.clone(), conns, dur))?;
        lat.sort_unstable();
        phases.push(Phase {
            conns,
            rps: n as f64 / dur.as_secs_f64(),
            p50_us: pct(&lat, 0.5),
            p99_us: pct(&lat, 0.99),
            errors,
        });
    }
    Ok(phases)
}

async fn run_clients(
    addr: SocketAddr,
    req: Arc<Vec<u8>>,
    conns: usize,
    dur: Duration,
) -> Result<(Vec<u32>, usize, u64), String> {
    let until = Instant::now() + dur;
    let tasks: Vec<_> = (0..conns)
        .map(|_| {
            let req = req.clone();
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut errors = 0u64;
                let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
                let _ = s.set_nodelay(true);
                let mut buf = Vec::with_capacity(1 << 16);
                // Bounded in time and count.
                while Instant::now() < until && lat.len() < 10_000_000 {
                    let t = Instant::now();
                    s.write_all(&req).await.map_err(|e| e.to_string())?;
                    let (status, _) = read_response(&mut s, &mut buf).await?;
                    if status != 200 {
                        errors += 1;
                    }
                    lat.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32);
                }
                Ok::<_, String>((lat, errors))
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (lat, e) = t.await.map_err(|e| e.to_string())??;
        all.extend(lat);
        errors += e;
    }
    let n = all.len();
    Ok((all, n, errors))
}
