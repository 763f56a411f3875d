//! A real `nats-server -js` and in-process collectors for the bus tests (`nats.rs`,
//! `dynamo.rs`): the server on a free loopback port with its store in a temp dir (installed by
//! `tools/install-nats-server.sh` when absent), killed on drop.

use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvroute_collector::bus::{BusConfig, Role};
use kvroute_collector::{AppState, Config};
use tokio::sync::oneshot;

use super::common::{self, DEADLINE};

/// The stream the tests' collectors share.
pub const STREAM: &str = "KVROUTE_EVENTS";

/// `nats-server`, from PATH or Debian's /usr/sbin, installed by the project's script if absent.
/// Once per test binary: its tests start servers in parallel and apt-get takes one at a time.
fn nats_server_bin() -> PathBuf {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(find_or_install).clone()
}

fn find_or_install() -> PathBuf {
    for p in ["/usr/sbin/nats-server", "/usr/bin/nats-server"] {
        if Path::new(p).exists() {
            return p.into();
        }
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/install-nats-server.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .expect("run tools/install-nats-server.sh");
    assert!(
        out.status.success(),
        "install-nats-server.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Logs with `RUST_LOG` (off by default), for a failing run.
fn init_log() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

pub fn free_port() -> u16 {
    init_log();
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// True when a NATS server answers on `port` with its `INFO` line.
async fn greets(port: u16) -> bool {
    use tokio::io::AsyncReadExt;
    let Ok(mut tcp) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    let mut head = [0u8; 5];
    matches!(
        tokio::time::timeout(Duration::from_secs(1), tcp.read_exact(&mut head)).await,
        Ok(Ok(_))
    ) && &head == b"INFO "
}

/// One `nats-server -js` on loopback, its store in a temp dir; killed on drop.
pub struct Nats {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Nats {
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub async fn start() -> Nats {
        // A port picked by binding and dropping can be taken again before the server binds it
        // (another test's listener, another server): a server that exits at start gets a new port.
        for _ in 0..5 {
            let mut n = Nats::later();
            if n.try_up().await {
                return n;
            }
        }
        panic!("nats-server did not start on five free ports");
    }

    /// A server that is not started yet, on a port reserved for it.
    pub fn later() -> Nats {
        Nats {
            port: free_port(),
            dir: tempfile::tempdir().expect("temp dir"),
            child: None,
        }
    }

    /// Starts (again) on the same port and store.
    pub async fn up(&mut self) {
        assert!(
            self.try_up().await,
            "nats-server exited at start (port {} taken?)",
            self.port
        );
    }

    /// Starts the server and waits for its protocol greeting (`INFO`) on the port: a bare TCP
    /// accept is not enough, the port may be someone else's. False when the server exited.
    async fn try_up(&mut self) -> bool {
        let conf = self.dir.path().join("nats.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: 127.0.0.1:{}\nmax_payload: 1048576\njetstream {{\n  store_dir: \"{}\"\n}}\n",
                self.port,
                self.dir.path().join("js").display()
            ),
        )
        .expect("write nats.conf");
        let child = Command::new(nats_server_bin())
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let until = tokio::time::Instant::now() + DEADLINE;
        loop {
            if let Some(c) = self.child.as_mut() {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    self.child = None;
                    return false;
                }
            }
            if greets(self.port).await {
                return true;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "nats-server did not listen"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the server (its store stays).
    pub fn down(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.down();
    }
}

pub fn bus(url: &str, role: Role, durable: &str) -> BusConfig {
    BusConfig {
        url: url.into(),
        role,
        stream: STREAM.into(),
        subject_prefix: "kvroute".into(),
        durable: durable.into(),
        registry_stream: "KVROUTE_REGISTRY".into(),
        // Under the 2-minute duplicate window: the stream must still be made.
        max_age: Duration::from_secs(90),
        max_bytes: 64 << 20,
        max_message_bytes: 1 << 20,
        outbox_batches: 65_536,
        dynamo: None,
    }
}

/// One collector served in-process on a loopback port, stopped by [`Collector::stop`].
pub struct Collector {
    pub state: AppState,
    pub addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Collector {
    pub async fn start(config: Config) -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = kvroute_collector::start(config).expect("start");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn({
            let state = state.clone();
            async move {
                kvroute_collector::serve(listener, state, async {
                    let _ = rx.await;
                })
                .await
                .expect("serve");
            }
        });
        Collector {
            state,
            addr,
            stop: Some(tx),
            task,
        }
    }

    /// Graceful stop: the bus tasks end, then the final snapshot is written.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
    }

    pub async fn health(&self) -> serde_json::Value {
        reqwest::get(format!("http://{}/health", self.addr))
            .await
            .expect("GET /health")
            .json()
            .await
            .expect("health JSON")
    }

    /// `kvroute_bus_messages_total{dir,outcome}` from `/metrics`.
    pub fn bus_count(&self, dir: &str, outcome: &str) -> u64 {
        let text = self.state.metrics.encode();
        let needle = format!("kvroute_bus_messages_total{{dir=\"{dir}\",outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&needle))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

pub fn config(nats: Option<BusConfig>) -> Config {
    Config {
        nats,
        scrape_interval: Duration::ZERO,
        ..common::config()
    }
}
