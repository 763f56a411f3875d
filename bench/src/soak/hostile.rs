//! The hostile peers of the soak, one at a time at random intervals: fake ZMQ publishers,
//! alias and dp-rank floods, half-sent HTTP requests, bad load reports.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute::event::KvEvent;
use kvroute::event::Tier;
use kvroute_sim::publisher::{Publisher, PublisherConfig};
use kvroute_sim::wire::{self, EventFormat, WireEvent};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::fleet::{blocks_of, prompt, register, register_endpoint, unregister};
use super::types::{SoakArgs, Tally, KINDS};

/// One hostile peer after another, at random intervals, until stopped.
#[allow(clippy::too_many_arguments)]
pub(super) async fn hostile(
    http: reqwest::Client,
    base: String,
    addr: String,
    args: SoakArgs,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
    start: Instant,
) {
    let mut rng = fastrand::Rng::with_seed(args.seed ^ 0xbad);
    let mut n = 0u32;
    while !stop.load(Ordering::Relaxed) {
        let wait = args.hostile_every * (0.5 + rng.f64());
        tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        let kind = KINDS[rng.usize(0..KINDS.len())];
        n += 1;
        let name = format!("hostile-{n}");
        let outcome = match kind {
            "zmq_header_2^62" => zmq_attack(&http, &base, &name, n, 1 << 62, 0).await,
            "zmq_oversized_frame" => {
                let len = 2 * args.max_zmq_message_bytes;
                zmq_attack(&http, &base, &name, n, len as u64, len).await
            }
            "alias_flood" => flood(&http, &base, &name, n, &mut rng, false).await,
            "dp_rank_flood" => flood(&http, &base, &name, n, &mut rng, true).await,
            "half_sent_headers" => half_sent(&addr, false).await,
            "slow_bodies" => half_sent(&addr, true).await,
            _ => bad_loads(&http, &base).await,
        };
        let note = match outcome {
            Ok(s) => s,
            Err(e) => format!("error: {e:#}"),
        };
        if let Ok(mut h) = tally.hostile.lock() {
            h.push((start.elapsed().as_secs_f64(), kind, note));
        }
    }
}

/// The ZMTP 3.0 greeting (NULL mechanism) and READY as a PUB.
fn zmtp_hello() -> (Vec<u8>, Vec<u8>) {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut ready = vec![0x04, body.len() as u8];
    ready.extend_from_slice(&body);
    (g, ready)
}

/// A fake PUB registered as an engine: each connection of the collector gets a long-frame
/// header claiming `claim` bytes followed by `send` bytes. Unregistered after 3 s.
async fn zmq_attack(
    http: &reqwest::Client,
    base: &str,
    name: &str,
    n: u32,
    claim: u64,
    send: usize,
) -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("tcp://{}", listener.local_addr()?);
    let server = tokio::spawn(async move {
        let mut conns = 0u32;
        while let Ok((mut s, _)) = listener.accept().await {
            conns += 1;
            tokio::spawn(async move {
                let (greeting, ready) = zmtp_hello();
                let mut peer = [0u8; 64];
                if s.write_all(&greeting).await.is_err() || s.read_exact(&mut peer).await.is_err() {
                    return;
                }
                let _ = s.write_all(&ready).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut frame = vec![0x02u8];
                frame.extend_from_slice(&claim.to_be_bytes());
                frame.resize(frame.len() + send, 0xab);
                let _ = s.write_all(&frame).await;
                // Drain until the collector hangs up, at most 5 s.
                let mut sink = [0u8; 4096];
                let _ = tokio::time::timeout(Duration::from_secs(5), async {
                    while s.read(&mut sink).await.is_ok_and(|n| n > 0) {}
                })
                .await;
            });
            let _ = conns;
        }
    });
    register_endpoint(http, base, name, &endpoint, None, 0x10000 + n).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    unregister(http, base, name).await;
    server.abort();
    Ok(format!("claim {claim} bytes, sent {send}"))
}

/// An engine that floods fresh LoRA names (or dp ranks), 400 events, then unregisters.
async fn flood(
    http: &reqwest::Client,
    base: &str,
    name: &str,
    n: u32,
    rng: &mut fastrand::Rng,
    dp: bool,
) -> anyhow::Result<String> {
    let p = Publisher::start(PublisherConfig::loopback(EventFormat::Vllm033))
        .await
        .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
    register(http, base, name, &p, 0x20000 + n).await?;
    // Let the collector subscribe before the flood: PUB drops what comes before.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let salt = rng.u64(..);
    for i in 0..400u64 {
        let blocks = blocks_of(&prompt(rng, 1));
        let lora = (!dp).then(|| format!("lora-{salt:x}-{i}"));
        let ev = KvEvent::BlockStored {
            parent: None,
            blocks,
            tier: Tier::Gpu,
            lora_name: lora,
            cache_salt: None,
        };
        if dp {
            let c = p.config();
            let wire: Vec<WireEvent> = [ev].iter().map(WireEvent::from).collect();
            p.publish(wire::encode_batch(
                c.format,
                c.extras,
                1.0,
                &wire,
                Some(1 + i as u32),
            ));
        } else {
            p.publish_events(&[ev]);
        }
        if i % 50 == 49 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    unregister(http, base, name).await;
    p.close().await;
    Ok("400 events".into())
}

/// 40 connections that send half a request (headers, or headers and a trickle of body) and
/// hold it for 6 s; the collector's timeouts should cut them.
async fn half_sent(addr: &str, body: bool) -> anyhow::Result<String> {
    let mut conns = Vec::new();
    for _ in 0..40 {
        let addr = addr.to_owned();
        conns.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(&addr).await.ok()?;
            let head: &[u8] = if body {
                b"POST /query HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"token_ids\":["
            } else {
                b"POST /query HTTP/1.1\r\nhost: x\r\ncontent-le"
            };
            s.write_all(head).await.ok()?;
            let mut buf = [0u8; 512];
            let cut = tokio::time::timeout(Duration::from_secs(6), async {
                loop {
                    if body && s.write_all(b"1,").await.is_err() {
                        return true;
                    }
                    match tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
                        Ok(Ok(0)) | Ok(Err(_)) => return true,
                        Ok(Ok(_)) => {}
                        Err(_) => {}
                    }
                }
            })
            .await
            .unwrap_or(false);
            Some(cut)
        }));
    }
    let mut cut = 0;
    for c in conns {
        if let Ok(Some(true)) = c.await {
            cut += 1;
        }
    }
    Ok(format!("{cut} of 40 cut by the collector"))
}

/// Load reports that must all be refused with a 4xx.
async fn bad_loads(http: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    let bodies: [(&str, String); 5] = [
        ("not json", "{\"gateway\":".into()),
        (
            "empty gateway",
            r#"{"gateway":"","epoch":0,"workers":[]}"#.into(),
        ),
        (
            "wrong epoch",
            r#"{"gateway":"g","epoch":999999999,"workers":[]}"#.into(),
        ),
        (
            "unknown worker",
            r#"{"gateway":"g","epoch":0,"workers":[{"worker":4000000}]}"#.into(),
        ),
        (
            "too many entries",
            serde_json::json!({"gateway": "g", "epoch": 0,
                "workers": (0..5000).map(|w| serde_json::json!({"worker": w})).collect::<Vec<_>>()})
            .to_string(),
        ),
    ];
    // The refusals past the epoch check need the current epoch: a feed page names it.
    let epoch = match http.get(format!("{base}/v1/feed")).send().await {
        Ok(r) => kvroute::feed::Page::decode(&r.bytes().await?).map_or(0, |p| p.epoch),
        Err(_) => 0,
    };
    let mut out = Vec::new();
    for (what, b) in bodies {
        let b = b.replace("\"epoch\":0", &format!("\"epoch\":{epoch}"));
        let r = http
            .post(format!("{base}/v1/load"))
            .header("content-type", "application/json")
            .body(b)
            .send()
            .await?;
        out.push(format!("{what}: {}", r.status().as_u16()));
    }
    Ok(out.join(", "))
}
