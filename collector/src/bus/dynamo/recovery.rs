//! The KV query a Dynamo worker answers on its request plane (`--dynamo-recovery nats|tcp`):
//! what the reader asks when it missed some of a worker's events (see [`super`] for when and
//! what happens to the answer).
//!
//! # Which request plane
//!
//! With `--dynamo-discovery-dir`, the worker's record there is read first
//! ([`super::discovery`]); with `--dynamo-discovery-etcd`, the same record is asked of etcd
//! ([`super::etcd`]). A TCP address sends the request over Dynamo's TCP request plane
//! ([`super::tcp`]), another transport over NATS. A worker without a usable record is asked
//! over NATS with `--dynamo-recovery nats` and counted `unreachable` with `tcp` (nothing
//! would answer). Without either, every worker is asked over NATS. Only the request
//! differs: the answer comes back the same way on both planes.
//!
//! # The exchange (ai-dynamo 1.6.1, NATS request plane; captured byte for byte in
//! `testdata/dynamo/worker_kv_query_1.6.1.txt`, the TCP plane's in
//! `tcp_request_plane_1.6.1.txt`)
//!
//! 1. A NATS request to `<ns>_<component>.worker_kv_query_source_<publisher id, hex>-<worker
//!    id, hex>` ([`super::naming::query_subject`]). Its payload is one *two-part frame*: three
//!    big-endian u64 (header length, body length, checksum, 0 here and not checked on
//!    receipt), then the header, then the body. The header is JSON: `{"id", "request_type":
//!    "single_in", "response_type": "many_out", "payload_codec": "msgpack", "connection_info":
//!    {"transport": "tcp_server", "info": "<JSON text: {address, subject, context,
//!    stream_type: "response"}>"}}`; the body is the msgpack `WorkerKvQueryRequest
//!    {worker_id, dp_rank, start_event_id, end_event_id (inclusive; both nil: the whole
//!    cache), supports_tree_dump_failed, kind: "recovery"}`. The worker acknowledges with an
//!    empty reply; no responder means the worker has no NATS request plane. On the TCP plane
//!    the same frame is the payload of a request message to the worker's address
//!    ([`super::tcp`]), acknowledged on that connection.
//! 2. The worker connects to `address` over TCP and writes two-part frames: a header-only
//!    handshake `{"subject", "stream_type"}` naming the request, a header-only prologue
//!    `{"error": null}`, body-only msgpack frames `{"data": WorkerKvQueryResponse,
//!    "complete_final": false}` and `{"complete_final": true}` ([`wire::decode_query_frame`]),
//!    then the header-only `"sentinel"`, and waits for this side to close.
//!
//! One listener serves every query; a connection is matched to its query by the handshake's
//! subject, a fresh id per query. Every length is checked against `--dynamo-recovery-max-bytes`
//! before anything is allocated, and the whole exchange, the discovery lookup included, runs
//! under `--dynamo-recovery-timeout-ms`.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tracing::{debug, warn};

use super::discovery::{self, Lookup};
use super::etcd::Etcd;
use super::naming::QueryEndpoint;
use super::tcp;
use super::wire::{self, Answer};
use crate::bus::settings::RecoveryConfig;

/// Largest frame header taken (the handshake and the prologue are well under 1 KiB).
const MAX_HEADER: usize = 16 << 10;

/// Connections still owing their handshake at once; more are closed unread.
const MAX_HANDSHAKES: usize = 64;

/// One query: to whom, for what.
#[derive(Clone, Debug)]
pub struct Query {
    /// The worker's KV query endpoint.
    pub endpoint: QueryEndpoint,
    pub worker_id: u64,
    pub dp_rank: u32,
    /// The event ids wanted, both ends included; `None`: the whole cache (a tree dump).
    pub range: Option<(u64, u64)>,
}

/// Why a query brought nothing usable; each is counted under its [`Failure::outcome`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The request was not taken: no NATS responder (no NATS request plane), no connection,
    /// a TCP request plane that serves no such endpoint, or (`--dynamo-recovery tcp`) no
    /// usable discovery record.
    Unreachable,
    /// Out of `--dynamo-recovery-timeout-ms`.
    Timeout,
    /// The worker answered that it cannot (`TooNew`, `InvalidRange`, `TreeDumpFailed`,
    /// `Error`, or an error in the prologue).
    Refused,
    /// An answer of another shape, cut short or over `--dynamo-recovery-max-bytes`.
    BadAnswer,
}

impl Failure {
    /// The `outcome` label of its count.
    pub fn outcome(self) -> &'static str {
        match self {
            Failure::Unreachable => "unreachable",
            Failure::Timeout => "timeout",
            Failure::Refused => "refused",
            Failure::BadAnswer => "bad_answer",
        }
    }
}

/// The queries' shared side: the NATS client, the answers' listener, the queries waiting for
/// their connection.
#[derive(Debug)]
pub struct Recovery {
    client: async_nats::Client,
    config: RecoveryConfig,
    /// `--dynamo-discovery-etcd`'s client.
    etcd: Option<Etcd>,
    /// The address the workers are told to connect to.
    advertised: SocketAddr,
    listener: Mutex<Option<TcpListener>>,
    pending: Mutex<HashMap<String, oneshot::Sender<TcpStream>>>,
    next: AtomicU64,
    /// Makes this process's query ids unlike another collector's on the same NATS server.
    salt: u64,
}

#[derive(Deserialize)]
struct Handshake {
    subject: String,
}

#[derive(Deserialize)]
struct Prologue {
    error: Option<serde_json::Value>,
}

impl Recovery {
    /// Binds the answers' listener: `listen`, or the local address toward the NATS server at
    /// `nats_url` (the interface the workers, which reach that server too, most likely reach).
    ///
    /// # Errors
    /// The address cannot be bound.
    pub async fn bind(
        client: async_nats::Client,
        config: RecoveryConfig,
        nats_url: &str,
    ) -> std::io::Result<Recovery> {
        let toward = local_ip_toward(nats_url).await;
        let bind = config.listen.unwrap_or(SocketAddr::new(toward, 0));
        let listener = TcpListener::bind(bind).await?;
        let mut advertised = listener.local_addr()?;
        if advertised.ip().is_unspecified() {
            advertised.set_ip(toward);
        }
        let salt = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.finish()
        };
        // Half the query's budget: a lookup that fails still leaves time for the fallback.
        let etcd = config
            .discovery_etcd
            .as_deref()
            .map(|url| Etcd::new(url, config.timeout / 2))
            .transpose()?;
        Ok(Recovery {
            client,
            etcd,
            config,
            advertised,
            listener: Mutex::new(Some(listener)),
            pending: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            salt,
        })
    }

    /// Where the workers connect to.
    pub fn advertised(&self) -> SocketAddr {
        self.advertised
    }

    /// Accepts the workers' connections and hands each to the query its handshake names; runs
    /// for as long as the reader does (once).
    pub async fn serve(self: Arc<Self>) {
        let Some(listener) = lock(&self.listener).take() else {
            return;
        };
        let mut handshakes = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) if handshakes.len() < MAX_HANDSHAKES => {
                        handshakes.spawn(self.clone().handshake(stream));
                    }
                    Ok(_) => debug!("dynamo: too many KV query connections; one closed"),
                    Err(e) => {
                        // Out of descriptors, mostly: let some close.
                        warn!(error = %e, "dynamo: KV query listener");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(_) = handshakes.join_next(), if !handshakes.is_empty() => {}
            }
        }
    }

    async fn handshake(self: Arc<Self>, mut stream: TcpStream) {
        let mut budget = MAX_HEADER + 24;
        let frame =
            tokio::time::timeout(self.config.timeout, read_frame(&mut stream, &mut budget)).await;
        let Ok(Ok((header, body))) = frame else {
            return;
        };
        let Ok(h) = serde_json::from_slice::<Handshake>(&header) else {
            return;
        };
        if !body.is_empty() {
            return;
        }
        let waiting = lock(&self.pending).remove(&h.subject);
        if let Some(tx) = waiting {
            let _ = tx.send(stream);
        }
    }

    /// Asks; the whole exchange under `--dynamo-recovery-timeout-ms`. Also what discovery
    /// said of the worker, when it was looked up ([`Lookup::outcome`]).
    pub async fn query(&self, q: Query) -> (Result<Answer, Failure>, Option<&'static str>) {
        let mut looked_up = None;
        let result = tokio::time::timeout(self.config.timeout, self.exchange(q, &mut looked_up))
            .await
            .unwrap_or(Err(Failure::Timeout));
        (result, looked_up)
    }

    /// The plane to ask `e` on (the module doc, "Which request plane").
    async fn route(
        &self,
        e: &QueryEndpoint,
        looked_up: &mut Option<&'static str>,
    ) -> Result<Route, Failure> {
        let found = match (&self.etcd, &self.config.discovery_dir) {
            (Some(etcd), _) => etcd.lookup(e).await,
            (None, Some(dir)) => discovery::lookup(dir, e).await,
            (None, None) => return Ok(Route::Nats(e.subject())),
        };
        *looked_up = Some(found.outcome());
        match found {
            Lookup::Tcp { addr, path } => Ok(Route::Tcp { addr, path }),
            Lookup::Other => Ok(Route::Nats(e.subject())),
            Lookup::Missing | Lookup::Malformed if self.config.nats_fallback => {
                Ok(Route::Nats(e.subject()))
            }
            Lookup::Missing | Lookup::Malformed => Err(Failure::Unreachable),
        }
    }

    async fn exchange(
        &self,
        q: Query,
        looked_up: &mut Option<&'static str>,
    ) -> Result<Answer, Failure> {
        let route = self.route(&q.endpoint, looked_up).await?;
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // UUID-shaped, as Dynamo's own ids are.
        let id = format!(
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            self.salt >> 32,
            (self.salt >> 16) & 0xffff,
            self.salt & 0xffff,
            (n >> 48) & 0xffff,
            n & 0xffff_ffff_ffff
        );
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id.clone(), tx);
        let _forget = Forget(&self.pending, &id);
        let info = serde_json::json!({
            "address": self.advertised.to_string(),
            "subject": id,
            "context": id,
            "stream_type": "response",
        });
        let header = serde_json::json!({
            "id": id,
            "request_type": "single_in",
            "response_type": "many_out",
            "payload_codec": "msgpack",
            "connection_info": {"transport": "tcp_server", "info": info.to_string()},
        });
        let frame = two_part(header.to_string().as_bytes(), &request_body(&q));
        let mut budget = self.config.max_bytes;
        match route {
            Route::Nats(subject) => {
                if let Err(e) = self.client.request(subject.clone(), frame.into()).await {
                    debug!(subject = %subject, error = %e, "dynamo: KV query not delivered");
                    return Err(Failure::Unreachable);
                }
            }
            Route::Tcp { addr, path } => {
                let message = tcp::request(&path, &id, &frame).ok_or(Failure::Unreachable)?;
                tcp::send(&addr, &message, &mut budget)
                    .await
                    .map_err(|e| match e {
                        tcp::NotTaken::Unreachable => Failure::Unreachable,
                        tcp::NotTaken::TooLarge => Failure::BadAnswer,
                    })?;
            }
        }
        let mut stream = rx.await.map_err(|_| Failure::Unreachable)?;
        let (mut answer, mut complete) = (None::<Answer>, false);
        loop {
            let (header, body) = read_frame(&mut stream, &mut budget)
                .await
                .map_err(|_| Failure::BadAnswer)?;
            if !body.is_empty() {
                let f = wire::decode_query_frame(&body).map_err(|_| Failure::BadAnswer)?;
                complete |= f.complete_final;
                if let Some(a) = f.answer {
                    answer = Some(merge(answer, a)?);
                }
            } else if header == b"\"sentinel\"" {
                break;
            } else if serde_json::from_slice::<Prologue>(&header)
                .map_err(|_| Failure::BadAnswer)?
                .error
                .is_some_and(|e| !e.is_null())
            {
                return Err(Failure::Refused);
            }
        }
        // Closing is what the worker waits for after the sentinel.
        drop(stream);
        match answer {
            Some(Answer::Refused(_)) => Err(Failure::Refused),
            Some(a) if complete => Ok(a),
            _ => Err(Failure::BadAnswer),
        }
    }
}

/// Where a query's request goes.
enum Route {
    /// The worker's NATS request-plane subject.
    Nats(String),
    /// The worker's TCP request plane: its address and the endpoint's path there.
    Tcp { addr: String, path: String },
}

/// Removes a query's entry however it ends.
struct Forget<'a>(
    &'a Mutex<HashMap<String, oneshot::Sender<TcpStream>>>,
    &'a str,
);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        lock(self.0).remove(self.1);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Answers split over several frames are put back together; a refusal anywhere wins.
fn merge(had: Option<Answer>, next: Answer) -> Result<Answer, Failure> {
    Ok(match (had, next) {
        (None, a) | (Some(Answer::Refused(_)), a @ Answer::Refused(_)) => a,
        (Some(r @ Answer::Refused(_)), _) | (Some(_), r @ Answer::Refused(_)) => r,
        (Some(Answer::Events { mut events, .. }), Answer::Events { events: more, last }) => {
            events.extend(more);
            Answer::Events { events, last }
        }
        (Some(Answer::TreeDump { mut events, .. }), Answer::TreeDump { events: more, last }) => {
            events.extend(more);
            Answer::TreeDump { events, last }
        }
        _ => return Err(Failure::BadAnswer),
    })
}

/// One two-part frame.
pub(crate) fn two_part(header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + header.len() + body.len());
    out.extend_from_slice(&(header.len() as u64).to_be_bytes());
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(&0u64.to_be_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(body);
    out
}

/// Reads one two-part frame, its lengths checked against what `budget` has left (and the
/// header against [`MAX_HEADER`]) before anything is allocated.
async fn read_frame(
    stream: &mut TcpStream,
    budget: &mut usize,
) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let too_big = || std::io::Error::new(std::io::ErrorKind::InvalidData, "frame over budget");
    let mut lens = [0u8; 24];
    stream.read_exact(&mut lens).await?;
    let len = |i: usize| u64::from_be_bytes(lens[i..i + 8].try_into().unwrap_or([0xff; 8]));
    let (hl, bl) = (len(0), len(8));
    let need = 24u64.saturating_add(hl).saturating_add(bl);
    if hl > MAX_HEADER as u64 || need > *budget as u64 {
        return Err(too_big());
    }
    *budget -= need as usize;
    let mut header = vec![0; hl as usize];
    stream.read_exact(&mut header).await?;
    let mut body = vec![0; bl as usize];
    stream.read_exact(&mut body).await?;
    Ok((header, body))
}

/// The msgpack `WorkerKvQueryRequest`, with field names as Dynamo's `rmp_serde` reads them.
pub(crate) fn request_body(q: &Query) -> Vec<u8> {
    let mut m = vec![0x86];
    let key = |m: &mut Vec<u8>, k: &str| {
        m.push(0xa0 | k.len() as u8);
        m.extend_from_slice(k.as_bytes());
    };
    let u64_ = |m: &mut Vec<u8>, v: u64| {
        m.push(0xcf);
        m.extend_from_slice(&v.to_be_bytes());
    };
    key(&mut m, "worker_id");
    u64_(&mut m, q.worker_id);
    key(&mut m, "dp_rank");
    m.push(0xce);
    m.extend_from_slice(&q.dp_rank.to_be_bytes());
    for (k, v) in [
        ("start_event_id", q.range.map(|r| r.0)),
        ("end_event_id", q.range.map(|r| r.1)),
    ] {
        key(&mut m, k);
        match v {
            Some(v) => u64_(&mut m, v),
            None => m.push(0xc0),
        }
    }
    key(&mut m, "supports_tree_dump_failed");
    m.push(0xc3);
    key(&mut m, "kind");
    key(&mut m, "recovery");
    m
}

/// The local IP this host uses to reach the first server of `nats_url` (a UDP socket's route
/// lookup: nothing is sent); loopback when it cannot be told.
async fn local_ip_toward(nats_url: &str) -> IpAddr {
    let first = nats_url.split(',').next().unwrap_or_default().trim();
    let rest = first.split_once("://").map_or(first, |(_, r)| r);
    let hostport = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let hostport = hostport.split('/').next().unwrap_or_default();
    let target = if hostport
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        hostport.to_owned()
    } else {
        format!("{hostport}:4222")
    };
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let Some(addr) = tokio::net::lookup_host(target)
        .await
        .ok()
        .and_then(|mut a| a.next())
    else {
        return loopback;
    };
    let any: SocketAddr = if addr.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let Ok(sock) = tokio::net::UdpSocket::bind(any).await else {
        return loopback;
    };
    if sock.connect(addr).await.is_err() {
        return loopback;
    }
    sock.local_addr().map_or(loopback, |a| a.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_body_is_what_dynamo_reads() {
        // The body of the captured query for events 2..3: the same fields, in the same order
        // (Python's msgpack wrote the smallest int forms; rmp-serde reads either).
        let q = Query {
            endpoint: QueryEndpoint {
                namespace: "dynamo".into(),
                component: "backend".into(),
                endpoint: "worker_kv_query_source_3fecf4985069a".into(),
                worker_id: 7_030_154_717_409_816_316,
            },
            worker_id: 7_030_154_717_409_816_316,
            dp_rank: 0,
            range: Some((2, 3)),
        };
        let body = request_body(&q);
        let text = include_str!("../../../../testdata/dynamo/worker_kv_query_1.6.1.txt");
        let want: serde_json::Value = serde_json::from_str(
            text.lines()
                .find_map(|l| l.strip_prefix("request_body: "))
                .unwrap(),
        )
        .unwrap();
        let mut r = crate::msgpack::Reader::new(&body);
        let mut got = serde_json::Map::new();
        for _ in 0..r.map_len().unwrap() {
            let k = r.str().unwrap().to_owned();
            let v = match r.peek().unwrap() {
                0xc3 => {
                    r.u8().unwrap();
                    serde_json::Value::Bool(true)
                }
                b if b >> 5 == 0b101 => r.str().unwrap().into(),
                _ => serde_json::json!(r.int().unwrap().map(|v| v as u64)),
            };
            got.insert(k, v);
        }
        assert_eq!(serde_json::Value::Object(got), want);
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn answers_over_frames_merge_and_refusals_win() {
        let ev = |id| wire::RouterEvent {
            worker_id: 1,
            dp_rank: 0,
            event_id: id,
            tier: kvroute::event::Tier::Gpu,
            data: wire::EventData::Cleared,
        };
        let a = merge(
            None,
            Answer::Events {
                events: vec![ev(2)],
                last: 3,
            },
        )
        .unwrap();
        let a = merge(
            Some(a),
            Answer::Events {
                events: vec![ev(3)],
                last: 3,
            },
        )
        .unwrap();
        assert_eq!(
            a,
            Answer::Events {
                events: vec![ev(2), ev(3)],
                last: 3
            }
        );
        assert_eq!(
            merge(Some(a.clone()), Answer::Refused("Error")),
            Ok(Answer::Refused("Error"))
        );
        let dump = Answer::TreeDump {
            events: vec![],
            last: 3,
        };
        assert_eq!(merge(Some(a), dump), Err(Failure::BadAnswer));
    }

    #[tokio::test]
    async fn frames_over_the_budget_are_refused_before_allocating() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(&two_part(b"{}", b"")).await.unwrap();
            // Claims 1 TiB of body.
            let mut f = two_part(b"", b"");
            f[8..16].copy_from_slice(&(1u64 << 40).to_be_bytes());
            s.write_all(&f).await.unwrap();
            s
        });
        let (mut s, _) = listener.accept().await.unwrap();
        let mut budget = 1000;
        assert_eq!(
            read_frame(&mut s, &mut budget).await.unwrap(),
            (b"{}".to_vec(), vec![])
        );
        assert_eq!(budget, 1000 - 26);
        assert!(read_frame(&mut s, &mut budget).await.is_err());
        drop(writer.await);
    }

    #[tokio::test]
    async fn the_local_address_toward_a_loopback_server_is_loopback() {
        assert_eq!(
            local_ip_toward("nats://127.0.0.1:4222").await,
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert_eq!(
            local_ip_toward("nats://user:pw@127.0.0.1:1,nats://10.0.0.1:2").await,
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert!(local_ip_toward("nats://[::1]").await.is_loopback());
    }
}
