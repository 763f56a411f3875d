//! The `failure` scenario: engine 0 dies at 30 % of the replay and comes back at 60 % with an
//! empty cache and its KV-event seq restarted (a new epoch), on the same ports.
//!
//! The in-process engine cannot exit, so its HTTP port is a [`Front`]: a TCP forwarder the
//! routers, Envoy and the collector talk to. Killing it closes the listener (new connections
//! are refused) and drops every open connection (requests in flight fail mid-stream, as when a
//! process dies). Bringing it back empties the engine's cache without publishing anything and
//! numbers its next event batch 0 ([`Engine::restart_empty`]), then listens again.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvroute_sim::engine::Engine;
use kvroute_sim::trace::TraceRecord;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Share of the replay at which the engine dies.
pub const KILL_AT: f64 = 0.3;
/// Share of the replay at which it comes back.
pub const RESTART_AT: f64 = 0.6;

/// When the engine dies and returns, wall time from the replay's start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FailureSchedule {
    pub kill_at: Duration,
    pub restart_at: Duration,
}

impl FailureSchedule {
    /// [`KILL_AT`] and [`RESTART_AT`] of the span over which `records` are sent, replayed at
    /// `speed` with arrivals scaled by `rate_scale` (as `replay::run` schedules them).
    pub fn of(records: &[TraceRecord], speed: f64, rate_scale: f64) -> FailureSchedule {
        let span_ms = match (records.first(), records.last()) {
            (Some(f), Some(l)) => l.timestamp.saturating_sub(f.timestamp),
            _ => 0,
        };
        let wall_s = span_ms as f64 / 1000.0 / rate_scale.max(1e-9) / speed.max(1e-9);
        FailureSchedule {
            kill_at: Duration::from_secs_f64(wall_s * KILL_AT),
            restart_at: Duration::from_secs_f64(wall_s * RESTART_AT),
        }
    }

    /// The same in simulated (trace) seconds, for the report.
    pub fn sim_s(&self, speed: f64) -> [f64; 2] {
        [
            self.kill_at.as_secs_f64() * speed,
            self.restart_at.as_secs_f64() * speed,
        ]
    }
}

/// A TCP forwarder in front of one engine's HTTP port that can die and come back.
#[derive(Debug)]
pub struct Front {
    /// The address everyone is given, `127.0.0.1:port`.
    pub addr: SocketAddr,
    backend: SocketAddr,
    up: watch::Sender<bool>,
    accept: Mutex<Option<JoinHandle<()>>>,
}

impl Front {
    /// Listens on a free loopback port, forwarding to `backend`.
    ///
    /// # Errors
    /// No port to bind.
    pub async fn start(backend: SocketAddr) -> std::io::Result<Front> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let (up, _) = watch::channel(true);
        let front = Front {
            addr: listener.local_addr()?,
            backend,
            up,
            accept: Mutex::new(None),
        };
        front.serve(listener);
        Ok(front)
    }

    fn serve(&self, listener: TcpListener) {
        let (backend, up) = (self.backend, self.up.subscribe());
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let mut down = up.clone();
                tokio::spawn(async move {
                    let Ok(upstream) = TcpStream::connect(backend).await else {
                        return;
                    };
                    let (mut client, mut upstream) = (client, upstream);
                    // Both sockets are dropped when the front dies: the peers see the
                    // connection close in the middle of whatever they were sending.
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
                        _ = down.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        *self.accept.lock().expect("front") = Some(task);
    }

    /// Closes the port and every open connection.
    pub fn kill(&self) {
        if let Some(t) = self.accept.lock().expect("front").take() {
            t.abort();
        }
        self.up.send_replace(false);
    }

    /// Listens on the same port again.
    ///
    /// # Errors
    /// The port was taken meanwhile (retried for up to 2 s).
    pub async fn revive(&self) -> std::io::Result<()> {
        self.up.send_replace(true);
        let deadline = Instant::now() + Duration::from_secs(2);
        let listener = loop {
            match TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        self.serve(listener);
        Ok(())
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `schedule` against `engine` behind `front`, from now (the replay's start); returns
/// whether the engine's cache was emptied at the restart (false: it still held requests).
pub async fn run(engine: &Engine, front: &Front, schedule: FailureSchedule) -> bool {
    let start = tokio::time::Instant::now();
    tokio::time::sleep_until(start + schedule.kill_at).await;
    front.kill();
    tokio::time::sleep_until(start + schedule.restart_at).await;
    // The connections were cut a while ago; the engine frees their blocks as it notices.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut emptied = engine.restart_empty();
    while !emptied && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        emptied = engine.restart_empty();
    }
    if let Err(e) = front.revive().await {
        tracing::error!(error = %e, "engine front did not come back");
    }
    emptied
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn rec(t_ms: u64) -> TraceRecord {
        TraceRecord {
            timestamp: t_ms,
            input_length: 16,
            output_length: 1,
            hash_ids: vec![1],
        }
    }

    #[test]
    fn the_engine_dies_at_30_and_returns_at_60_percent_of_the_replay() {
        // 100 s of trace at 10× and rate 2: 5 s of wall time.
        let s = FailureSchedule::of(&[rec(1_000), rec(50_000), rec(101_000)], 10.0, 2.0);
        assert_eq!(s.kill_at, Duration::from_millis(1_500));
        assert_eq!(s.restart_at, Duration::from_millis(3_000));
        assert_eq!(s.sim_s(10.0), [15.0, 30.0]);
        let none = FailureSchedule::of(&[], 10.0, 1.0);
        assert_eq!(none.kill_at, Duration::ZERO);
    }

    /// An echo server, and a front before it.
    async fn echo_front() -> Front {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let backend = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        Front::start(backend).await.unwrap()
    }

    async fn echo(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
        s.write_all(b"hi").await?;
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).await?;
        Ok(buf.to_vec())
    }

    #[tokio::test]
    async fn a_killed_front_cuts_open_connections_refuses_new_ones_and_comes_back() {
        let front = echo_front().await;
        let mut open = TcpStream::connect(front.addr).await.unwrap();
        assert_eq!(echo(&mut open).await.unwrap(), b"hi");
        front.kill();
        // The open connection ends: its next read sees the close (or a reset).
        let mut buf = [0u8; 1];
        let _ = open.write_all(b"x").await;
        assert!(matches!(open.read(&mut buf).await, Ok(0) | Err(_)));
        assert!(TcpStream::connect(front.addr).await.is_err(), "refused");
        front.revive().await.unwrap();
        let mut again = TcpStream::connect(front.addr).await.unwrap();
        assert_eq!(echo(&mut again).await.unwrap(), b"hi");
    }
}
