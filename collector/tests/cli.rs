//! The `kvroute-collector` binary: `--help` for every flag, and a graceful shutdown on SIGTERM
//! that writes the `--state-dir` snapshot.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kvroute-collector");

#[test]
fn help_describes_every_flag() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--listen",
        "--admin-token",
        "--read-token",
        "--state-dir",
        "--default-serving-port",
        "--worker",
        "--config",
        "--max-blocks-per-worker",
        "--max-body-bytes",
        "--max-query-tokens",
        "--feed-log-entries",
        "--max-feed-bytes",
        "--keep-disconnected-secs",
        "--replay-timeout-secs",
        "--snapshot-interval-secs",
        "--max-concurrent-requests",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
}

#[test]
fn a_bad_worker_spec_is_refused_at_start() {
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--worker", "instance_id=a"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("required"));
}

fn get(addr: &str, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

#[test]
fn sigterm_shuts_down_gracefully_and_saves_state() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = Command::new(BIN)
        .args([
            "--listen",
            &addr,
            "--state-dir",
            dir.path().to_str().unwrap(),
        ])
        .args([
            "--worker",
            "instance_id=10.0.0.1:8000,endpoint=tcp://127.0.0.1:9,model=m,block_size=16",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        if get(&addr, "/health").is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
            break;
        }
        assert!(Instant::now() < until, "collector did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    let workers = get(&addr, "/workers").unwrap();
    assert!(workers.contains("10.0.0.1:8000"), "{workers}");
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < until, "collector did not exit on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    let saved = std::fs::read_to_string(dir.path().join("state.json")).unwrap();
    assert!(saved.contains("10.0.0.1:8000"));
}
