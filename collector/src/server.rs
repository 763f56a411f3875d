//! The HTTP server's edge against slow or greedy clients: an accept loop with a connection cap
//! that sheds slow connections, hyper's header-read timeout, and graceful shutdown bounded in
//! time.
//!
//! - **The cap** ([`connection_cap`]): at start the descriptor soft limit is raised to the hard
//!   one ([`raise_fd_limit`]); by default the cap is that limit less a share kept for engine
//!   sockets, files and scrapes, at most [`MAX_DERIVED_CONNECTIONS`].
//! - **Shedding** (issue 23): when every slot is taken, the oldest connection that waits on its
//!   client (for a request head, an idle keep-alive, a body being trickled, or a slow reader of
//!   its answer) is closed to make room, so slow clients cannot starve fast ones: a flood of
//!   them sheds itself. A connection whose request is being handled is never shed. With none
//!   to shed, one more is answered `503 {"error": ...}` and closed at once, without reading
//!   it, so a flood costs the flood.
//! - **The reserve**: `reserved_connections` slots hold only connections that have been
//!   answered 2xx on a gateway path (`/v1/feed`, `/query*`, `/v1/load`; with `--read-token`
//!   that proves the token). A connection moves there after such an answer while the reserve
//!   has room, and newcomers never shed it: a flood of slow clients cannot push the gateways'
//!   kept-alive connections out (they would otherwise be the oldest idle ones, so the first
//!   shed). Without `--read-token` any fast client can earn a place there; that is no worse
//!   than no reserve, since the reserve only ever holds clients that finished a request.
//! - A client has `header_read_timeout` to send each request's headers (idle keep-alive
//!   connections included); then hyper closes the connection.
//! - Body-read deadlines and rate, 414/431/408/413 JSON answers are per request: see
//!   [`crate::edge`].
//! - On shutdown the listener closes, every connection is asked to finish its request, and after
//!   `shutdown_timeout` the rest are cut, so the caller can write the final snapshot and exit.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;
use tracing::{debug, info, warn};

/// What the accept loop enforces.
#[derive(Clone, Debug)]
pub struct ServerLimits {
    /// Open connections at most, the reserve included.
    pub max_connections: usize,
    /// Of `max_connections`, the slots only proven gateway connections may hold (below
    /// `max_connections`; [`serve_http`] keeps at least one slot for newcomers).
    pub reserved_connections: usize,
    pub header_read_timeout: Duration,
    pub shutdown_timeout: Duration,
}

/// What the accept loop counts.
#[derive(Clone, Debug, Default)]
pub struct ServerCounters {
    /// Connections answered 503 at the cap (nothing to shed).
    pub refused: Counter,
    /// Connections closed to make room for a newcomer.
    pub shed: Counter,
}

/// Refused connections being answered at once; past this they are closed without a word.
const REFUSING: usize = 64;

/// How long a refused connection is kept to let the 503 reach the client before closing.
const REFUSE_LINGER: Duration = Duration::from_millis(200);

/// How long the accept loop waits for a shed connection to hand back its slot. The shed task
/// only has to wake and drop its connection; this bounds a stall of the accept loop if the
/// runtime is starved.
const SHED_WAIT: Duration = Duration::from_millis(100);

/// Most connections [`connection_cap`] derives from the descriptor limit. Each open
/// connection costs a task and hyper's buffers (18 KiB of RSS for one holding a request head
/// and a byte of body, measured in bench/RESULTS.md); 16,384 of them stay near 300 MiB
/// whatever the hard limit allows.
pub const MAX_DERIVED_CONNECTIONS: usize = 16_384;

/// Descriptors kept out of the connection cap for everything else the collector opens: per
/// engine a ZMQ SUB socket, a replay socket while replaying and a `/metrics` connection, plus
/// libzmq's own, the state file and tokenizers. Half the limit, at most this many (1,024
/// covers about 250 engines), so a soft limit of 1,024 gives the old cap of 512.
pub const FD_HEADROOM: u64 = 1024;

/// The process's descriptor limit after [`raise_fd_limit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdLimit {
    /// The soft limit now in force.
    pub soft: u64,
    /// The hard limit (the most the soft one can be raised to without privileges).
    pub hard: u64,
    /// The soft limit before, when it was raised.
    pub raised_from: Option<u64>,
}

/// Size from which glibc serves an allocation with its own mapping, fixed by
/// [`fix_malloc_thresholds`]: glibc's default starting value.
const MMAP_THRESHOLD: i32 = 128 * 1024;

/// Fixes glibc's mmap and trim thresholds, which it otherwise raises (up to 32 MiB) each time
/// a large block is freed. After that, blocks of that size come from the heap, and once freed
/// among live ones their pages stay with the process. The collector's large transients (the
/// state file read at start, a replay's batches, a feed snapshot, the catch-up of a stream)
/// then left RSS in steps tens of MB above a process that never held them: 75–99 MB against
/// 64–67 MB for the same index after a restart from `--state-dir`, 172–189 MB after one that
/// replayed 16 engines, against 57–60 and 55–60 MB with the thresholds fixed
/// (`bench/scripts/rss_restart.py`). Left alone when the operator tunes glibc's allocator
/// through the environment. Returns whether it set them.
pub fn fix_malloc_thresholds() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let tuned = std::env::var_os("GLIBC_TUNABLES")
            .is_some_and(|t| t.to_string_lossy().contains("glibc.malloc."))
            || std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
            || std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_some();
        if tuned {
            return false;
        }
        // SAFETY: mallopt only sets two allocator parameters, under glibc's own locks.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, MMAP_THRESHOLD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// Hands the allocator's free pages back to the system (`malloc_trim`), in every arena. With
/// the thresholds fixed, small blocks freed among live ones still stay with the process: a
/// collector that replayed 16 engines' full buffers at start held 174 MB for an index a
/// collector built live holds in 56 MB, and `malloc_trim` took it to 56 MB
/// (`bench/scripts/rss_restart.py --restart replay`). Returns whether memory was released.
pub fn release_free_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free memory, under glibc's own locks.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit: the default soft limit (often 1,024)
/// caps connections far below what the system allows, and raising it needs no privilege.
///
/// # Errors
/// `getrlimit` or `setrlimit` failing (then the limit is as it was).
pub fn raise_fd_limit() -> std::io::Result<FdLimit> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer to a local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let before = rl.rlim_cur;
    // An unlimited hard limit cannot be the soft one for descriptors (Linux caps it at
    // fs.nr_open, 1,048,576 by default).
    let target = if rl.rlim_max == libc::RLIM_INFINITY {
        1 << 20
    } else {
        rl.rlim_max
    };
    if rl.rlim_cur >= target {
        return Ok(FdLimit {
            soft: to_u64(before),
            hard: to_u64(rl.rlim_max),
            raised_from: None,
        });
    }
    rl.rlim_cur = target;
    // SAFETY: setrlimit reads one rlimit through a valid pointer to a local.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(FdLimit {
        soft: to_u64(rl.rlim_cur),
        hard: to_u64(rl.rlim_max),
        raised_from: Some(to_u64(before)),
    })
}

// rlim_t is u64 on Linux, not on every Unix.
#[allow(clippy::useless_conversion)]
fn to_u64(v: libc::rlim_t) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// The descriptor soft limit in force, without changing it.
///
/// # Errors
/// `getrlimit` failing.
pub fn fd_soft_limit() -> std::io::Result<u64> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: as in raise_fd_limit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(to_u64(rl.rlim_cur))
}

/// How the connection cap came about, for the start-up log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapSource {
    /// `--max-connections` as given.
    Explicit,
    /// `--max-connections` was more than the descriptor budget: cut to it.
    Clamped { asked: usize },
    /// No `--max-connections`: derived from the descriptor limit.
    Derived,
}

/// The connection cap for a descriptor soft limit of `soft_fds`: `explicit` when given and
/// within budget, else the budget, which is the limit less [`FD_HEADROOM`] (half the limit
/// when that is smaller), at most [`MAX_DERIVED_CONNECTIONS`] when derived, at least 1.
pub fn connection_cap(explicit: Option<usize>, soft_fds: u64) -> (usize, CapSource) {
    let headroom = FD_HEADROOM.min(soft_fds / 2);
    let budget = usize::try_from(soft_fds - headroom)
        .unwrap_or(usize::MAX)
        .max(1);
    match explicit {
        Some(n) if n <= budget => (n, CapSource::Explicit),
        Some(n) => (budget, CapSource::Clamped { asked: n }),
        None => (budget.min(MAX_DERIVED_CONNECTIONS), CapSource::Derived),
    }
}

/// The default reserve for a cap: an eighth of it (64 of 512; more than the connections of
/// `--max-gateways` Envoys with a few worker threads each at the derived caps).
pub fn default_reserved(max_connections: usize) -> usize {
    max_connections / 8
}

/// A connection is waiting on its client: for a head, a body, or to read its answer.
const WAITING: u8 = 0;
/// A request of the connection is being handled: never shed.
const SERVING: u8 = 1;
/// Shed: the connection is being closed and serves nothing more.
const SHED: u8 = 2;

/// One open connection as the shedder sees it. Reachable from a request's extensions, so the
/// body reader can say when the connection is only waiting for a body to trickle in.
///
/// The state moves by compare-and-swap, so a connection is shed only if it was waiting at
/// that instant, and once shed it never starts serving (no request is cut half handled).
#[derive(Debug)]
pub struct ConnSlot {
    id: u64,
    state: AtomicU8,
    /// In the reserve (a proven gateway connection): newcomers never shed it.
    reserved: AtomicBool,
    /// The slot it holds, general or reserved; released when the connection ends.
    permit: Mutex<Option<OwnedSemaphorePermit>>,
    shed: Notify,
}

impl ConnSlot {
    /// The connection starts (or resumes) handling a request; false when it has been shed.
    pub fn begin_serving(&self) -> bool {
        match self
            .state
            .compare_exchange(WAITING, SERVING, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(now) => now == SERVING,
        }
    }

    /// The connection waits on its client again (reading a body, or between requests).
    pub fn wait_on_client(&self) {
        let _ = self
            .state
            .compare_exchange(SERVING, WAITING, Ordering::AcqRel, Ordering::Acquire);
    }

    fn try_shed(&self) -> bool {
        self.state
            .compare_exchange(WAITING, SHED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn release(&self) {
        lock(&self.permit).take();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing under these locks can panic half-way; a poisoned one is still consistent.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The two pools of slots and the sheddable connections.
#[derive(Debug)]
struct Pools {
    general: Arc<Semaphore>,
    reserved: Arc<Semaphore>,
    /// General-pool connections by accept order, oldest first; at most the general pool's
    /// size (each leaves when it ends, is shed, or moves to the reserve).
    sheddable: Mutex<BTreeMap<u64, Arc<ConnSlot>>>,
}

impl Pools {
    fn new(limits: &ServerLimits) -> Pools {
        // At least one general slot, or no newcomer could ever be served.
        let reserved = limits
            .reserved_connections
            .min(limits.max_connections.saturating_sub(1));
        Pools {
            general: Arc::new(Semaphore::new(limits.max_connections.max(1) - reserved)),
            reserved: Arc::new(Semaphore::new(reserved)),
            sheddable: Mutex::new(BTreeMap::new()),
        }
    }

    fn admit(&self, id: u64, permit: OwnedSemaphorePermit) -> Arc<ConnSlot> {
        let slot = Arc::new(ConnSlot {
            id,
            state: AtomicU8::new(WAITING),
            reserved: AtomicBool::new(false),
            permit: Mutex::new(Some(permit)),
            shed: Notify::new(),
        });
        lock(&self.sheddable).insert(id, slot.clone());
        slot
    }

    /// Sheds the oldest general-pool connection that waits on its client; false if every one
    /// is serving.
    fn shed_oldest(&self) -> bool {
        let mut open = lock(&self.sheddable);
        let Some(id) = open
            .iter()
            .find(|(_, slot)| slot.try_shed())
            .map(|(id, _)| *id)
        else {
            return false;
        };
        if let Some(slot) = open.remove(&id) {
            // notify_one keeps the wake-up if the task is not polling yet.
            slot.shed.notify_one();
        }
        true
    }

    /// Moves a proven gateway connection into the reserve, if it has room. Called while the
    /// connection is serving, so the shedder cannot take it meanwhile.
    fn promote(&self, slot: &ConnSlot) {
        if slot.reserved.load(Ordering::Acquire) {
            return;
        }
        let Ok(permit) = self.reserved.clone().try_acquire_owned() else {
            return;
        };
        lock(&self.sheddable).remove(&slot.id);
        // The general slot it held goes back to newcomers.
        *lock(&slot.permit) = Some(permit);
        slot.reserved.store(true, Ordering::Release);
    }

    fn close(&self, slot: &ConnSlot) {
        lock(&self.sheddable).remove(&slot.id);
        slot.release();
    }
}

/// Paths whose 2xx answer earns a connection a place in the reserve: what gateways call.
fn is_gateway_path(path: &str) -> bool {
    path == "/v1/feed" || path == "/v1/load" || path.starts_with("/query")
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains connections for at
/// most `limits.shutdown_timeout`.
///
/// # Errors
/// None today: accept failures (descriptor exhaustion included) are logged and retried.
pub async fn serve_http(
    listener: TcpListener,
    router: Router,
    limits: ServerLimits,
    counters: ServerCounters,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let pools = Arc::new(Pools::new(&limits));
    let refusing = Arc::new(Semaphore::new(REFUSING));
    let mut next_id: u64 = 0;
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // EMFILE and friends: the socket stays in the backlog; pause rather than spin.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let permit = match pools.general.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            Err(_) if pools.shed_oldest() => {
                counters.shed.inc();
                // The shed connection's task hands its slot back as it wakes.
                tokio::time::timeout(SHED_WAIT, pools.general.clone().acquire_owned())
                    .await
                    .ok()
                    .and_then(Result::ok)
            }
            Err(_) => None,
        };
        let Some(permit) = permit else {
            counters.refused.inc();
            refuse(stream, &refusing);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let slot = pools.admit(next_id, permit);
        next_id += 1;
        let service = {
            let (router, slot, pools) = (router.clone(), slot.clone(), pools.clone());
            tower::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                let (router, slot, pools) = (router.clone(), slot.clone(), pools.clone());
                async move {
                    if !slot.begin_serving() {
                        // Shed between its head arriving and now: the connection is being
                        // closed, and this answer will most likely not be written.
                        return Ok(shed_answer());
                    }
                    let gateway = is_gateway_path(req.uri().path());
                    req.extensions_mut().insert(slot.clone());
                    let res = router.oneshot(req).await;
                    if gateway && res.as_ref().is_ok_and(|r| r.status().is_success()) {
                        pools.promote(&slot);
                    }
                    // The answer's body may still stream: a client slow to read it is waiting
                    // on itself, and sheddable.
                    slot.wait_on_client();
                    res
                }
            })
        };
        let conn =
            builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let conn = graceful.watch(conn);
        let pools = pools.clone();
        tokio::spawn(async move {
            tokio::select! {
                ended = conn => if let Err(e) = ended {
                    debug!(error = %e, "connection ended with an error");
                },
                // Dropping the connection closes the socket; the client sees the close.
                () = slot.shed.notified() => debug!("connection waiting on its client shed for a new one"),
            }
            pools.close(&slot);
        });
    }
    drop(listener);
    match tokio::time::timeout(limits.shutdown_timeout, graceful.shutdown()).await {
        Ok(()) => info!("connections drained"),
        Err(_) => warn!(
            deadline_secs = limits.shutdown_timeout.as_secs_f64(),
            "shutdown deadline passed; open connections cut"
        ),
    }
    Ok(())
}

fn shed_answer() -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(kvroute::api::ErrorBody {
            error: "connection shed for another; retry".to_owned(),
        }),
    )
        .into_response()
}

/// Answers 503 JSON without parsing the request, then closes.
fn refuse(mut stream: TcpStream, refusing: &Arc<Semaphore>) {
    const BODY: &str = r#"{"error":"too many connections; retry later"}"#;
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    // A fresh socket's send buffer takes this whole: no waiting on a hostile reader.
    let _ = stream.try_write(answer.as_bytes());
    // Closing with unread input sends RST, which can destroy the answer in flight: take what
    // already arrived, and, while few refusals are pending, what comes in the next moment.
    let mut sink = [0u8; 4096];
    while stream.try_read(&mut sink).is_ok_and(|n| n > 0) {}
    let Ok(permit) = refusing.clone().try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        let _ = tokio::time::timeout(REFUSE_LINGER, async {
            stream.shutdown().await?;
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, std::io::Error>(())
        })
        .await;
        drop(permit);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max: usize, reserved: usize) -> ServerLimits {
        ServerLimits {
            max_connections: max,
            reserved_connections: reserved,
            header_read_timeout: Duration::from_secs(1),
            shutdown_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn the_cap_is_the_descriptor_limit_less_headroom() {
        // The usual default soft limit keeps the old cap.
        assert_eq!(connection_cap(None, 1024), (512, CapSource::Derived));
        assert_eq!(connection_cap(None, 4096), (3072, CapSource::Derived));
        assert_eq!(
            connection_cap(None, 1 << 20),
            (MAX_DERIVED_CONNECTIONS, CapSource::Derived)
        );
        assert_eq!(connection_cap(Some(64), 1024), (64, CapSource::Explicit));
        assert_eq!(
            connection_cap(Some(5000), 1024),
            (512, CapSource::Clamped { asked: 5000 })
        );
        assert_eq!(connection_cap(None, 0).0, 1);
    }

    #[test]
    fn raising_the_limit_reaches_the_hard_limit() {
        let fd = raise_fd_limit().unwrap();
        assert!(fd.soft == fd.hard || fd.soft == 1 << 20, "{fd:?}");
        assert_eq!(fd_soft_limit().unwrap(), fd.soft);
    }

    #[tokio::test]
    async fn the_oldest_waiting_connection_is_shed_and_serving_ones_never() {
        let pools = Pools::new(&limits(3, 0));
        let slots: Vec<_> = (0..3)
            .map(|id| {
                let p = pools.general.clone().try_acquire_owned().unwrap();
                pools.admit(id, p)
            })
            .collect();
        assert!(slots[0].begin_serving());
        assert!(pools.shed_oldest());
        // Not 0 (serving): 1, the oldest waiting one.
        assert_eq!(slots[1].state.load(Ordering::Acquire), SHED);
        assert!(
            !slots[1].begin_serving(),
            "a shed connection serves nothing"
        );
        assert_eq!(slots[0].state.load(Ordering::Acquire), SERVING);
        assert!(slots[2].begin_serving());
        assert!(
            !pools.shed_oldest(),
            "every remaining connection is serving"
        );
        pools.close(&slots[1]);
        assert_eq!(pools.general.available_permits(), 1);
    }

    #[tokio::test]
    async fn a_promoted_connection_frees_its_general_slot_and_is_not_shed() {
        let pools = Pools::new(&limits(3, 1));
        assert_eq!(pools.general.available_permits(), 2);
        let p = pools.general.clone().try_acquire_owned().unwrap();
        let gateway = pools.admit(0, p);
        assert!(gateway.begin_serving());
        pools.promote(&gateway);
        gateway.wait_on_client();
        assert_eq!(pools.general.available_permits(), 2);
        assert_eq!(pools.reserved.available_permits(), 0);
        assert!(!pools.shed_oldest(), "the reserve is not sheddable");
        pools.close(&gateway);
        assert_eq!(pools.reserved.available_permits(), 1);
    }

    #[test]
    fn the_reserve_leaves_newcomers_a_slot() {
        let pools = Pools::new(&limits(4, 10));
        assert_eq!(pools.general.available_permits(), 1);
        assert_eq!(pools.reserved.available_permits(), 3);
    }

    #[test]
    fn gateway_paths() {
        for p in ["/v1/feed", "/v1/load", "/query", "/query_by_hash"] {
            assert!(is_gateway_path(p), "{p}");
        }
        for p in ["/health", "/register", "/metrics", "/v1/feedx", "/ui/"] {
            assert!(!is_gateway_path(p), "{p}");
        }
    }
}
