//! An engine-like KV event publisher for tests and benchmarks: a ZMQ PUB socket sending the
//! engines' 3-frame messages `[topic, seq u64 BE, msgpack batch]`, and a replay ROUTER socket
//! answering DEALER requests `["", start_seq]` with the buffered batches and the end marker, in
//! the old (vLLM < 0.26) or new reply shape. Batches are encoded like vLLM 0.33 (map events,
//! map16 header), vLLM 0.23 (array events) or SGLang 0.5.15 (array events, signed hashes).
//!
//! Not for production: the encoder writes only what these formats need.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvroute::event::{KvEvent, Tier};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// How events are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// vLLM ≥ 0.24: map events, map16 header for `BlockStored`.
    VllmMap,
    /// vLLM ≤ 0.23: positional array events (12 fields).
    VllmArray,
    /// SGLang ≤ 0.5.18: positional array events (7 fields), hashes as signed ints.
    SglangArray,
}

/// Replay reply shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayShape {
    /// vLLM < 0.26: `["", seq, payload]`, end `["", ff×8, ""]`.
    Old,
    /// vLLM ≥ 0.26, SGLang 0.5.23: `["", topic, seq, payload]`, end `["", "", ff×8, ""]`.
    New,
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Batches the replay buffer keeps (vLLM's `buffer_steps` default).
const BUFFER_STEPS: usize = 10_000;

/// A publisher bound on 127.0.0.1.
pub struct Publisher {
    pub endpoint: String,
    pub replay_endpoint: String,
    pub format: Format,
    pub dp_rank: Option<u32>,
    topic: Bytes,
    next_seq: u64,
    socket: PubSocket,
    buffer: Buffer,
    router: JoinHandle<()>,
    shape: ReplayShape,
}

impl Publisher {
    /// Binds fresh ports.
    ///
    /// # Panics
    /// When the sockets cannot bind on loopback.
    pub async fn bind(format: Format, shape: ReplayShape) -> Publisher {
        Self::bind_on("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", format, shape).await
    }

    /// Binds the given addresses (`tcp://127.0.0.1:PORT`), as an engine coming back does.
    ///
    /// # Panics
    /// When the sockets cannot bind.
    pub async fn bind_on(
        pub_at: &str,
        replay_at: &str,
        format: Format,
        shape: ReplayShape,
    ) -> Publisher {
        // A port just released can take a moment to bind again (the old socket's teardown,
        // a test's placeholder listener): retry for a bounded while.
        let mut socket = PubSocket::new();
        let mut router = RouterSocket::new();
        let mut endpoint = None;
        let mut replay_endpoint = None;
        for _ in 0..100 {
            if endpoint.is_none() {
                endpoint = socket.bind(pub_at).await.ok().map(|e| e.to_string());
            }
            if replay_endpoint.is_none() {
                replay_endpoint = router.bind(replay_at).await.ok().map(|e| e.to_string());
            }
            if endpoint.is_some() && replay_endpoint.is_some() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let endpoint = endpoint.expect("bind PUB");
        let replay_endpoint = replay_endpoint.expect("bind ROUTER");
        let buffer: Buffer = Arc::default();
        let topic = Bytes::from_static(b"kv@test@model");
        let task = tokio::spawn(serve_replay(router, buffer.clone(), topic.clone(), shape));
        Publisher {
            endpoint,
            replay_endpoint,
            format,
            dp_rank: Some(0),
            topic,
            next_seq: 0,
            socket,
            buffer,
            router: task,
            shape,
        }
    }

    /// Stops and starts again on the same addresses, with an empty buffer and seq back at 0,
    /// as an engine restart does.
    pub async fn restart(self) -> Publisher {
        let (endpoint, replay_endpoint, format, shape, dp) = (
            self.endpoint.clone(),
            self.replay_endpoint.clone(),
            self.format,
            self.shape,
            self.dp_rank,
        );
        self.close().await;
        let mut p = Self::bind_on(&endpoint, &replay_endpoint, format, shape).await;
        p.dp_rank = dp;
        p
    }

    /// Closes both sockets.
    pub async fn close(self) {
        self.router.abort();
        let _ = self.router.await;
        let _ = self.socket.close().await;
    }

    /// Continues the sequence at `seq` (an engine that was only cut off, not restarted).
    pub fn resume_seq(&mut self, seq: u64) {
        self.next_seq = seq;
    }

    /// The sequence number the next batch gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Encodes, buffers and sends one batch; returns its sequence number.
    pub async fn publish(&mut self, events: &[KvEvent]) -> u64 {
        let payload = encode_batch(self.format, 1.5, events, self.dp_rank);
        self.publish_payload(Bytes::from(payload), true).await
    }

    /// Buffers a batch for replay without sending it: a message the subscriber lost.
    pub async fn publish_lost(&mut self, events: &[KvEvent]) -> u64 {
        let payload = encode_batch(self.format, 1.5, events, self.dp_rank);
        self.publish_payload(Bytes::from(payload), false).await
    }

    /// Sends an already encoded payload.
    pub async fn publish_payload(&mut self, payload: Bytes, send: bool) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        {
            let mut buf = self.buffer.lock().unwrap_or_else(|e| e.into_inner());
            if buf.len() >= BUFFER_STEPS {
                buf.pop_front();
            }
            buf.push_back((seq, payload.clone()));
        }
        if send {
            let msg = ZmqMessage::try_from(vec![
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ])
            .expect("3 frames");
            let _ = self.socket.send(msg).await;
        }
        seq
    }
}

async fn serve_replay(mut router: RouterSocket, buffer: Buffer, topic: Bytes, shape: ReplayShape) {
    while let Ok(msg) = router.recv().await {
        let frames = msg.into_vec();
        // [identity, "", start_seq]
        if frames.len() != 3 {
            continue;
        }
        let id = frames[0].clone();
        let start = frames[2].iter().fold(0u64, |acc, &b| acc << 8 | b as u64);
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let empty = Bytes::new();
        let frame = |parts: Vec<Bytes>| ZmqMessage::try_from(parts).expect("frames");
        for (seq, payload) in batches {
            let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
            let parts = match shape {
                ReplayShape::Old => vec![id.clone(), empty.clone(), seq, payload],
                ReplayShape::New => vec![id.clone(), empty.clone(), topic.clone(), seq, payload],
            };
            if router.send(frame(parts)).await.is_err() {
                break;
            }
        }
        let end = Bytes::from_static(&[0xff; 8]);
        let parts = match shape {
            ReplayShape::Old => vec![id, empty.clone(), end, empty],
            ReplayShape::New => vec![id, empty.clone(), empty.clone(), end, empty],
        };
        let _ = router.send(frame(parts)).await;
    }
}

/// Encodes one `EventBatch` payload `[ts, events, dp_rank]`.
pub fn encode_batch(format: Format, ts: f64, events: &[KvEvent], dp_rank: Option<u32>) -> Vec<u8> {
    let mut w = Vec::with_capacity(64 + events.len() * 128);
    array(&mut w, 3);
    w.push(0xcb);
    w.extend_from_slice(&ts.to_bits().to_be_bytes());
    array(&mut w, events.len());
    for ev in events {
        encode_event(&mut w, format, ev);
    }
    match dp_rank {
        Some(d) => uint(&mut w, d as u64),
        None => w.push(0xc0),
    }
    w
}

fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "GPU",
        Tier::Cpu => "CPU",
        Tier::Disk => "DISK",
    }
}

fn encode_event(w: &mut Vec<u8>, format: Format, ev: &KvEvent) {
    let hash = |w: &mut Vec<u8>, h: u64| match format {
        Format::SglangArray => int(w, h as i64),
        _ => uint(w, h),
    };
    match ev {
        KvEvent::BlockStored {
            parent,
            blocks,
            tier,
            lora_name,
            cache_salt,
        } => {
            let bs = blocks.first().map_or(0, |b| b.tokens.len());
            let tokens: Vec<u32> = blocks
                .iter()
                .flat_map(|b| b.tokens.iter().copied())
                .collect();
            let put_hashes = |w: &mut Vec<u8>| {
                array(w, blocks.len());
                for b in blocks {
                    hash(w, b.hash.0);
                }
            };
            let put_parent = |w: &mut Vec<u8>| match parent {
                Some(p) => hash(w, p.0),
                None => w.push(0xc0),
            };
            let put_tokens = |w: &mut Vec<u8>| {
                array(w, tokens.len());
                for &t in &tokens {
                    uint(w, t as u64);
                }
            };
            let put_opt_str = |w: &mut Vec<u8>, s: Option<&str>| match s {
                Some(s) => string(w, s),
                None => w.push(0xc0),
            };
            // vLLM carries the salt in the first block's extra_keys.
            let put_extra = |w: &mut Vec<u8>| match cache_salt {
                Some(s) => {
                    array(w, blocks.len());
                    array(w, 1);
                    string(w, s);
                    for _ in 1..blocks.len() {
                        w.push(0xc0);
                    }
                }
                None => w.push(0xc0),
            };
            match format {
                Format::VllmMap => {
                    let n = 8 + cache_salt.is_some() as usize;
                    w.push(0xde);
                    w.extend_from_slice(&(n as u16).to_be_bytes());
                    string(w, "type");
                    string(w, "BlockStored");
                    string(w, "block_hashes");
                    put_hashes(w);
                    string(w, "parent_block_hash");
                    put_parent(w);
                    string(w, "token_ids");
                    put_tokens(w);
                    string(w, "block_size");
                    uint(w, bs as u64);
                    string(w, "lora_id");
                    w.push(0xc0);
                    string(w, "medium");
                    string(w, medium(*tier));
                    string(w, "lora_name");
                    put_opt_str(w, lora_name.as_deref());
                    if cache_salt.is_some() {
                        string(w, "extra_keys");
                        put_extra(w);
                    }
                }
                Format::VllmArray => {
                    array(w, 12);
                    string(w, "BlockStored");
                    put_hashes(w);
                    put_parent(w);
                    put_tokens(w);
                    uint(w, bs as u64);
                    w.push(0xc0);
                    string(w, medium(*tier));
                    put_opt_str(w, lora_name.as_deref());
                    put_extra(w);
                    w.extend_from_slice(&[0xc0, 0xc0, 0xc0]);
                }
                Format::SglangArray => {
                    array(w, 7);
                    string(w, "BlockStored");
                    put_hashes(w);
                    put_parent(w);
                    put_tokens(w);
                    uint(w, bs as u64);
                    w.push(0xc0);
                    string(w, medium(*tier));
                }
            }
        }
        KvEvent::BlockRemoved { hashes, tier } => {
            let put_hashes = |w: &mut Vec<u8>| {
                array(w, hashes.len());
                for h in hashes {
                    hash(w, h.0);
                }
            };
            match format {
                Format::VllmMap => {
                    w.push(0x83);
                    string(w, "type");
                    string(w, "BlockRemoved");
                    string(w, "block_hashes");
                    put_hashes(w);
                    string(w, "medium");
                    string(w, medium(*tier));
                }
                Format::VllmArray | Format::SglangArray => {
                    array(w, 3);
                    string(w, "BlockRemoved");
                    put_hashes(w);
                    string(w, medium(*tier));
                }
            }
        }
        KvEvent::AllBlocksCleared => match format {
            Format::VllmMap => {
                w.push(0x81);
                string(w, "type");
                string(w, "AllBlocksCleared");
            }
            _ => {
                array(w, 1);
                string(w, "AllBlocksCleared");
            }
        },
    }
}

fn array(w: &mut Vec<u8>, n: usize) {
    if n < 16 {
        w.push(0x90 | n as u8);
    } else if n <= u16::MAX as usize {
        w.push(0xdc);
        w.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        w.push(0xdd);
        w.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

fn string(w: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        w.push(0xa0 | n as u8);
    } else if n < 256 {
        w.push(0xd9);
        w.push(n as u8);
    } else {
        w.push(0xda);
        w.extend_from_slice(&(n as u16).to_be_bytes());
    }
    w.extend_from_slice(s.as_bytes());
}

/// Smallest unsigned form, as msgspec writes Python ints.
fn uint(w: &mut Vec<u8>, v: u64) {
    if v < 128 {
        w.push(v as u8);
    } else if v <= u8::MAX as u64 {
        w.push(0xcc);
        w.push(v as u8);
    } else if v <= u16::MAX as u64 {
        w.push(0xcd);
        w.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= u32::MAX as u64 {
        w.push(0xce);
        w.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        w.push(0xcf);
        w.extend_from_slice(&v.to_be_bytes());
    }
}

fn int(w: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        uint(w, v as u64);
    } else if v >= -32 {
        w.push(v as i8 as u8);
    } else {
        w.push(0xd3);
        w.extend_from_slice(&v.to_be_bytes());
    }
}

/// Builds a `BlockStored` of consecutive blocks of `tokens` (`block_size` each), with engine
/// hashes `first_hash, first_hash + 1, ...`.
pub fn stored(parent: Option<u64>, first_hash: u64, tokens: &[u32], block_size: usize) -> KvEvent {
    KvEvent::BlockStored {
        parent: parent.map(kvroute::event::EngineHash),
        blocks: tokens
            .chunks(block_size)
            .enumerate()
            .map(|(i, t)| kvroute::event::StoredBlock {
                hash: kvroute::event::EngineHash(first_hash + i as u64),
                tokens: t.to_vec(),
            })
            .collect(),
        tier: Tier::Gpu,
        lora_name: None,
        cache_salt: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::decode;

    #[test]
    fn encoded_batches_decode_back_in_every_format() {
        let mut ev = stored(None, 1 << 63, &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        if let KvEvent::BlockStored {
            cache_salt,
            lora_name,
            ..
        } = &mut ev
        {
            *cache_salt = Some("salt".into());
            *lora_name = Some("lora".into());
        }
        let events = vec![
            ev,
            KvEvent::BlockRemoved {
                hashes: vec![kvroute::event::EngineHash(1 << 63)],
                tier: Tier::Cpu,
            },
            KvEvent::AllBlocksCleared,
        ];
        for format in [Format::VllmMap, Format::VllmArray] {
            let b = decode(&encode_batch(format, 2.0, &events, Some(3))).unwrap();
            assert_eq!(b.events, events, "{format:?}");
            assert_eq!(b.dp_rank, Some(3));
        }
        // SGLang ≤ 0.5.18 carries neither a LoRA name nor extra_keys.
        let plain = vec![stored(Some(5), 1 << 63, &[1, 2, 3, 4], 4)];
        assert_eq!(
            decode(&encode_batch(Format::SglangArray, 2.0, &plain, None))
                .unwrap()
                .events,
            plain
        );
    }
}
