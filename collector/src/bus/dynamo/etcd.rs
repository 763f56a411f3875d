//! Where a Dynamo worker's KV query endpoint listens, from Dynamo's etcd discovery
//! (`--dynamo-discovery-etcd`, the etcd its workers are given as `ETCD_ENDPOINTS`, Dynamo's
//! default discovery outside Kubernetes).
//!
//! # The record (ai-dynamo 1.6.1 against etcd 3.4; `testdata/dynamo/etcd_discovery_1.6.1.txt`)
//!
//! Each endpoint instance is one key, `v1/instances/<ns>/<component>/<endpoint>/<instance
//! id, hex>`, written as is ([`key`]; the file discovery's `%XX` names are only for file
//! names), under the worker's lease (gone when the worker stops or its lease runs out). Its
//! value is the same JSON record as the file discovery's ([`super::discovery::parse`]).
//!
//! # The lookup
//!
//! One `POST <url>/v3/kv/range` through etcd's JSON gateway ([`range_request`]: the key in
//! base64); the answer is `{"header": .., "kvs": [{"key", "value", ..}], "count"}`, the key
//! and value in base64, without `kvs` when there is no such key ([`parse_answer`]). The
//! server is input from outside: the answer is read in chunks up to [`MAX_ANSWER`] bytes,
//! refused past it before more is allocated, within [`Etcd::new`]'s time budget (half of
//! `--dynamo-recovery-timeout-ms`, so that a fallback still has time); no etcd there, an
//! error status, too large or too slow an answer, or one of another shape is
//! [`Lookup::Malformed`], falling back as a bad file record does.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde::Deserialize;

use super::discovery::{self, Lookup, MAX_RECORD};
use super::naming::QueryEndpoint;

/// Largest answer read: a [`MAX_RECORD`] value in base64 (4/3 of it) with the key and the
/// answer's other fields.
pub const MAX_ANSWER: usize = (MAX_RECORD as usize).div_ceil(3) * 4 + (8 << 10);

/// The key of `q`'s record.
pub fn key(q: &QueryEndpoint) -> String {
    format!(
        "v1/instances/{}/{}/{}/{:x}",
        q.namespace, q.component, q.endpoint, q.worker_id
    )
}

/// The body of the range request for `q`'s record.
pub fn range_request(q: &QueryEndpoint) -> Vec<u8> {
    serde_json::json!({ "key": base64_encode(key(q).as_bytes()) })
        .to_string()
        .into_bytes()
}

#[derive(Deserialize)]
struct RangeAnswer {
    #[serde(default)]
    kvs: Vec<Kv>,
}

#[derive(Deserialize)]
struct Kv {
    key: String,
    #[serde(default)]
    value: String,
}

/// One range answer's bytes, checked against the endpoint whose record was asked for.
pub fn parse_answer(bytes: &[u8], q: &QueryEndpoint) -> Lookup {
    let Ok(a) = serde_json::from_slice::<RangeAnswer>(bytes) else {
        return Lookup::Malformed;
    };
    let kv = match a.kvs.as_slice() {
        [] => return Lookup::Missing,
        [kv] => kv,
        _ => return Lookup::Malformed,
    };
    if base64_decode(&kv.key).as_deref() != Some(key(q).as_bytes()) {
        return Lookup::Malformed;
    }
    match base64_decode(&kv.value) {
        Some(v) if v.len() as u64 <= MAX_RECORD => discovery::parse(&v, q),
        _ => Lookup::Malformed,
    }
}

/// The lookups' HTTP side: one client (its connections kept) for one etcd.
#[derive(Debug)]
pub struct Etcd {
    client: reqwest::Client,
    /// `<url>/v3/kv/range`.
    range: String,
    timeout: Duration,
}

impl Etcd {
    /// A client of the etcd at `url` (`http://host:port`, as validated by the settings),
    /// each lookup within `timeout`.
    ///
    /// # Errors
    /// The HTTP client cannot be built.
    pub fn new(url: &str, timeout: Duration) -> std::io::Result<Etcd> {
        let client = reqwest::Client::builder()
            .connect_timeout(timeout)
            .pool_max_idle_per_host(1)
            // Discovery is the deployment's own: never through an HTTP_PROXY.
            .no_proxy()
            .build()
            .map_err(std::io::Error::other)?;
        Ok(Etcd {
            client,
            range: format!("{}/v3/kv/range", url.trim_end_matches('/')),
            timeout,
        })
    }

    /// Looks up the record of `q`.
    pub async fn lookup(&self, q: &QueryEndpoint) -> Lookup {
        let read = async {
            let mut resp = self
                .client
                .post(&self.range)
                .header("content-type", "application/json")
                .body(range_request(q))
                .send()
                .await
                .ok()?;
            if !resp.status().is_success()
                || resp.content_length().is_some_and(|n| n > MAX_ANSWER as u64)
            {
                return None;
            }
            let mut body = Vec::new();
            while let Some(chunk) = resp.chunk().await.ok()? {
                if body.len() + chunk.len() > MAX_ANSWER {
                    return None;
                }
                body.extend_from_slice(&chunk);
            }
            Some(body)
        };
        match tokio::time::timeout(self.timeout, read).await {
            Ok(Some(body)) => parse_answer(&body, q),
            _ => {
                tracing::debug!(url = %self.range, "dynamo: no usable answer from etcd");
                Lookup::Malformed
            }
        }
    }
}

/// Standard base64 with padding (etcd's JSON gateway's `bytes`).
pub fn base64_encode(bytes: &[u8]) -> String {
    BASE64.encode(bytes)
}

/// The bytes of standard padded base64; `None` when `text` is not that.
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    BASE64.decode(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn captured(name: &str, field: &str) -> String {
        let text = include_str!("../../../../testdata/dynamo/etcd_discovery_1.6.1.txt");
        let sec = text
            .split("\n### ")
            .find(|s| s.starts_with(&format!("{name}\n")))
            .unwrap();
        sec.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}: ")))
            .unwrap()
            .to_owned()
    }

    /// The captured worker's KV query endpoint (testdata/dynamo/README.md).
    fn endpoint() -> QueryEndpoint {
        QueryEndpoint {
            namespace: "dynamo".into(),
            component: "backend".into(),
            endpoint: "worker_kv_query_source_19fa65880cfde7".into(),
            worker_id: 7_587_899_385_921_248_262,
        }
    }

    #[test]
    fn keys_and_range_requests_are_the_ones_dynamo_writes_and_etcd_takes() {
        let q = endpoint();
        assert_eq!(key(&q), captured("record", "key"));
        // Among every key the worker wrote.
        let text = include_str!("../../../../testdata/dynamo/etcd_discovery_1.6.1.txt");
        assert!(text.lines().any(|l| l == format!("key: {}", key(&q))));
        let ours: serde_json::Value = serde_json::from_slice(&range_request(&q)).unwrap();
        let theirs: serde_json::Value =
            serde_json::from_str(&captured("record", "request")).unwrap();
        assert_eq!(ours, theirs);
    }

    #[test]
    fn the_captured_answer_names_the_workers_tcp_address_and_path() {
        let q = endpoint();
        assert_eq!(
            parse_answer(captured("record", "answer").as_bytes(), &q),
            Lookup::Tcp {
                addr: "127.0.0.1:40039".into(),
                path: "694da24a013d9c06/dynamo/backend/worker_kv_query_source_19fa65880cfde7"
                    .into()
            }
        );
        assert_eq!(
            parse_answer(captured("missing", "answer").as_bytes(), &q),
            Lookup::Missing
        );
    }

    #[test]
    fn other_answers_are_malformed() {
        let q = endpoint();
        let answer: serde_json::Value =
            serde_json::from_str(&captured("record", "answer")).unwrap();
        let with = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = answer.clone();
            f(&mut v);
            parse_answer(v.to_string().as_bytes(), &q)
        };
        let value = captured("record", "value");
        let b64 = |s: &str| serde_json::Value::from(base64_encode(s.as_bytes()));
        // Another transport: the NATS request plane.
        let nats = value.replace(
            "{\"tcp\":\"127.0.0.1:40039/694da24a013d9c06/dynamo/backend/worker_kv_query_source_19fa65880cfde7\"}",
            "{\"nats_tcp\":\"dynamo_backend.x\"}",
        );
        assert_ne!(nats, value);
        assert_eq!(with(&|v| v["kvs"][0]["value"] = b64(&nats)), Lookup::Other);
        let other_key = format!("{}0", key(&q));
        let twice = answer["kvs"][0].clone();
        for bad in [
            with(&|v| v["kvs"][0]["value"] = "not base64!".into()),
            with(&|v| v["kvs"][0]["value"] = b64(&value[..50])),
            with(&|v| v["kvs"][0]["value"] = b64(&value.replace("7587899385921248262", "1"))),
            with(&|v| v["kvs"][0]["key"] = b64(&other_key)),
            with(&|v| {
                v["kvs"][0].as_object_mut().unwrap().remove("key");
            }),
            with(&|v| v["kvs"].as_array_mut().unwrap().push(twice.clone())),
            with(&|v| v["kvs"] = 5.into()),
            // Padded past the record's limit (JSON allows the whitespace).
            with(&|v| {
                let mut big = value.clone();
                big.push_str(&" ".repeat(MAX_RECORD as usize + 1 - big.len()));
                v["kvs"][0]["value"] = b64(&big);
            }),
            parse_answer(b"", &q),
            parse_answer(b"{\"kvs\":", &q),
        ] {
            assert_eq!(bad, Lookup::Malformed);
        }
        // At the limit it still parses; its answer still fits MAX_ANSWER.
        let mut big = value.clone();
        big.push_str(&" ".repeat(MAX_RECORD as usize - big.len()));
        let at_limit = with(&|v| v["kvs"][0]["value"] = b64(&big));
        assert!(matches!(at_limit, Lookup::Tcp { .. }));
        let mut v = answer.clone();
        v["kvs"][0]["value"] = b64(&big);
        assert!(v.to_string().len() <= MAX_ANSWER);
    }

    #[test]
    fn keys_and_values_are_etcds_base64() {
        let value = captured("record", "value");
        let answer: serde_json::Value =
            serde_json::from_str(&captured("record", "answer")).unwrap();
        assert_eq!(
            base64_encode(value.as_bytes()),
            answer["kvs"][0]["value"].as_str().unwrap()
        );
        // Unpadded, over-padded, concatenated, outside the alphabet, cut.
        for bad in ["Zg", "Zg=", "Z===", "Zg==Zg==", "Zm9v!", "Zm9", "Zm9v-_"] {
            assert_eq!(base64_decode(bad), None, "{bad}");
        }
    }

    /// How [`server`] frames its answer's body.
    #[derive(Clone, Copy)]
    enum Framing {
        ContentLength,
        /// `transfer-encoding: chunked` in 4 KiB chunks: no length known before the body.
        Chunked,
        /// This content-length, then the body as given, then the connection held open.
        Declared(usize),
    }

    /// A one-shot HTTP server answering `status` and `body`; returns its URL and the request.
    async fn server(
        status: &'static str,
        body: Vec<u8>,
        framing: Framing,
    ) -> (String, tokio::sync::oneshot::Receiver<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", l.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut req = Vec::new();
            let mut buf = [0u8; 4096];
            // Headers, then the body its content-length names.
            loop {
                let n = s.read(&mut buf).await.unwrap();
                req.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&req).to_string();
                if let Some((head, rest)) = text.split_once("\r\n\r\n") {
                    let len = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length: ")
                                .map(str::to_owned)
                        })
                        .map_or(0, |n| n.trim().parse::<usize>().unwrap());
                    if rest.len() >= len || n == 0 {
                        let _ = tx.send(text);
                        break;
                    }
                }
            }
            let length = match framing {
                Framing::ContentLength => format!("content-length: {}", body.len()),
                Framing::Declared(n) => format!("content-length: {n}"),
                Framing::Chunked => "transfer-encoding: chunked".to_owned(),
            };
            let head = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{length}\r\nconnection: close\r\n\r\n"
            );
            let _ = s.write_all(head.as_bytes()).await;
            match framing {
                Framing::ContentLength => {
                    let _ = s.write_all(&body).await;
                }
                Framing::Declared(_) => {
                    let _ = s.write_all(&body).await;
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                Framing::Chunked => {
                    for c in body.chunks(4096) {
                        let _ = s.write_all(format!("{:x}\r\n", c.len()).as_bytes()).await;
                        let _ = s.write_all(c).await;
                        let _ = s.write_all(b"\r\n").await;
                    }
                    let _ = s.write_all(b"0\r\n\r\n").await;
                }
            }
        });
        (url, rx)
    }

    #[tokio::test]
    async fn lookups_post_the_range_request_and_are_bounded() {
        use Framing::{Chunked, ContentLength};
        let q = endpoint();
        let t = Duration::from_secs(5);
        let q = &q;
        let lookup =
            |url: String, t: Duration| async move { Etcd::new(&url, t).unwrap().lookup(q).await };
        let answer = captured("record", "answer").into_bytes();
        let (url, req) = server("200 OK", answer.clone(), ContentLength).await;
        assert!(matches!(lookup(url, t).await, Lookup::Tcp { .. }));
        let req = req.await.unwrap();
        assert!(req.starts_with("POST /v3/kv/range HTTP/1.1\r\n"), "{req}");
        assert!(req.ends_with(&captured("record", "request").replace(": ", ":")));
        let missing = captured("missing", "answer").into_bytes();
        let (url, _) = server("200 OK", missing, ContentLength).await;
        assert_eq!(lookup(url, t).await, Lookup::Missing);
        // An error status.
        let (url, _) = server("404 Not Found", answer.clone(), ContentLength).await;
        assert_eq!(lookup(url, t).await, Lookup::Malformed);
        // Up to the limit an answer is read whole, whichever way it is framed; one byte more
        // is refused: by its content-length before the body, or, chunked, as it arrives.
        for framing in [ContentLength, Chunked] {
            let mut at_limit = answer.clone();
            at_limit.resize(MAX_ANSWER, b' ');
            let (url, _) = server("200 OK", at_limit.clone(), framing).await;
            assert!(matches!(lookup(url, t).await, Lookup::Tcp { .. }));
            at_limit.push(b' ');
            let (url, _) = server("200 OK", at_limit, framing).await;
            assert_eq!(lookup(url, t).await, Lookup::Malformed);
        }
        // Too large an answer announced: refused at once, not read until the budget ends.
        let (url, _) = server("200 OK", Vec::new(), Framing::Declared(MAX_ANSWER + 1)).await;
        let started = std::time::Instant::now();
        assert_eq!(lookup(url, t).await, Lookup::Malformed);
        assert!(started.elapsed() < t / 2, "{:?}", started.elapsed());
        // No etcd.
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        assert_eq!(lookup(dead, t).await, Lookup::Malformed);
        // An etcd that accepts and never answers: the lookup's own budget ends it.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", silent.local_addr().unwrap());
        let short = Duration::from_millis(200);
        let bounded = tokio::time::timeout(Duration::from_secs(2), lookup(url, short)).await;
        assert_eq!(bounded, Ok(Lookup::Malformed));
    }
}
