//! Helpers of the hostile-peer tests: the real `kvroute-collector` binary on a free loopback
//! port, and a raw HTTP/1.1 client that can misbehave.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The binary under test; `KVROUTE_COLLECTOR_BIN` overrides it (a target dir shared by several
/// checkouts may hold another checkout's build under the uplifted name).
pub fn bin() -> String {
    std::env::var("KVROUTE_COLLECTOR_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvroute-collector").to_owned())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running collector, killed when dropped.
pub struct Collector {
    pub child: Child,
    pub addr: String,
}

impl Collector {
    /// Starts the binary on a free port with `args` and waits for `/health`.
    pub fn start(args: &[&str]) -> Collector {
        let addr = format!("127.0.0.1:{}", free_port());
        let child = Command::new(bin())
            .args(["--listen", &addr])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let c = Collector { child, addr };
        let until = Instant::now() + Duration::from_secs(20);
        while c.get("/health").is_none_or(|r| r.status != 200) {
            assert!(Instant::now() < until, "collector did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Resident set size, from /proc/<pid>/status.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }

    pub fn get(&self, path: &str) -> Option<Reply> {
        request(
            &self.addr,
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
    }

    pub fn post(&self, path: &str, body: &str) -> Option<Reply> {
        request(
            &self.addr,
            format!(
                "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
    }

    /// Sends SIGTERM and waits for the exit; `None` when it did not exit within `within`.
    pub fn terminate(&mut self, within: Duration) -> Option<(std::process::ExitStatus, Duration)> {
        let started = Instant::now();
        assert!(Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap()
            .success());
        while started.elapsed() < within {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some((s, started.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A parsed HTTP answer.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Reply {
    /// The body as JSON (panics naming the reply when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }
}

/// Sends raw bytes and reads the answer until the server closes (5 s at most).
pub fn request(addr: &str, raw: &[u8]) -> Option<Reply> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(raw).ok()?;
    read_reply(&mut s)
}

pub fn read_reply(s: &mut TcpStream) -> Option<Reply> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(_) if !out.is_empty() => break,
            Err(_) => return None,
        }
    }
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some(Reply {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    })
}
