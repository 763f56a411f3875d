//! The KV-event publisher of one engine rank: a ZMQ PUB socket sending
//! `[topic, seq u64 BE, payload]` and a ROUTER replay socket answering `[.., "", start_seq]`
//! with every buffered batch from `start_seq` on, then the end marker (see [`crate::wire`]).
//! As in vLLM, the PUB and replay sockets bind; seq counts from 0; the replay buffer keeps the
//! last `buffer_steps` batches and silently starts at the oldest one it still has.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::wire::{self, EventFormat};

/// Where and how to publish.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    pub format: EventFormat,
    /// Topic frame (vLLM's default is empty).
    pub topic: String,
    /// PUB bind address, e.g. `tcp://127.0.0.1:5557` (port 0: any).
    pub endpoint: String,
    /// ROUTER bind address for replay, if any.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay (vLLM `buffer_steps`; default here 1,000, not vLLM's 10,000,
    /// because a simulated long-prompt batch is ~50 KB and a fleet shares one machine).
    pub buffer_steps: usize,
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// A running publisher. Dropping it stops its tasks.
#[derive(Debug)]
pub struct Publisher {
    tx: mpsc::UnboundedSender<Bytes>,
    /// The bound PUB address (`tcp://ip:port`).
    pub endpoint: String,
    /// The bound replay address.
    pub replay_endpoint: Option<String>,
    published: watch::Receiver<Option<u64>>,
    buffer: Buffer,
    tasks: Vec<JoinHandle<()>>,
}

/// A publisher failed to start.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("zmq bind {endpoint}: {source}")]
    Bind {
        endpoint: String,
        source: zeromq::ZmqError,
    },
}

impl Publisher {
    /// Binds the sockets and starts the send and replay tasks.
    ///
    /// # Errors
    /// A socket that cannot bind.
    pub async fn start(cfg: PublisherConfig) -> Result<Publisher, PublishError> {
        let mut pub_socket = zeromq::PubSocket::new();
        let bound = pub_socket
            .bind(&cfg.endpoint)
            .await
            .map_err(|source| PublishError::Bind {
                endpoint: cfg.endpoint.clone(),
                source,
            })?;
        let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
        let (published_tx, published) = watch::channel(None);
        let topic = Bytes::from(cfg.topic.clone().into_bytes());
        let mut tasks = Vec::new();
        {
            let buffer = buffer.clone();
            let topic = topic.clone();
            let cap = cfg.buffer_steps.max(1);
            tasks.push(tokio::spawn(async move {
                let mut seq: u64 = 0;
                while let Some(payload) = rx.recv().await {
                    {
                        let mut b = buffer.lock().expect("replay buffer lock");
                        if b.len() == cap {
                            b.pop_front();
                        }
                        b.push_back((seq, payload.clone()));
                    }
                    let frames = vec![
                        topic.clone(),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ];
                    let msg = ZmqMessage::try_from(frames).expect("three frames");
                    if let Err(e) = pub_socket.send(msg).await {
                        tracing::warn!(error = %e, seq, "kv event send failed");
                    }
                    published_tx.send_replace(Some(seq));
                    seq += 1;
                }
            }));
        }
        let mut replay_bound = None;
        if let Some(ep) = &cfg.replay_endpoint {
            let mut router = zeromq::RouterSocket::new();
            let b = router.bind(ep).await.map_err(|source| PublishError::Bind {
                endpoint: ep.clone(),
                source,
            })?;
            replay_bound = Some(b.to_string());
            let buffer = buffer.clone();
            let format = cfg.format;
            tasks.push(tokio::spawn(async move {
                loop {
                    let msg = match router.recv().await {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::debug!(error = %e, "replay recv");
                            continue;
                        }
                    };
                    let frames = msg.into_vec();
                    // [identity, "", start_seq]; any length of start_seq parses (vLLM uses
                    // int.from_bytes), the last 8 bytes count.
                    let (Some(identity), Some(start)) = (frames.first().cloned(), frames.last())
                    else {
                        continue;
                    };
                    if frames.len() < 2 {
                        continue;
                    }
                    let start = start.iter().fold(0u64, |acc, &b| acc << 8 | u64::from(b));
                    let batches: Vec<(u64, Bytes)> = {
                        let b = buffer.lock().expect("replay buffer lock");
                        b.iter().filter(|(s, _)| *s >= start).cloned().collect()
                    };
                    for (seq, payload) in batches {
                        let mut out = vec![identity.clone(), Bytes::new()];
                        out.extend(wire::replay_reply(format, &topic, seq, &payload));
                        if router
                            .send(ZmqMessage::try_from(out).expect("frames"))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                    let mut end = vec![identity, Bytes::new()];
                    end.extend(wire::replay_end(format));
                    let _ = router
                        .send(ZmqMessage::try_from(end).expect("frames"))
                        .await;
                }
            }));
        }
        Ok(Publisher {
            tx,
            endpoint: bound.to_string(),
            replay_endpoint: replay_bound,
            published,
            buffer,
            tasks,
        })
    }

    /// Queues one encoded batch; it gets the next seq.
    pub fn publish(&self, payload: Vec<u8>) {
        let _ = self.tx.send(Bytes::from(payload));
    }

    /// The seq of the last batch sent, watched.
    pub fn published(&self) -> watch::Receiver<Option<u64>> {
        self.published.clone()
    }

    /// Copies of the buffered batches (what replay can return).
    pub fn buffered(&self) -> Vec<(u64, Bytes)> {
        self.buffer
            .lock()
            .expect("replay buffer lock")
            .iter()
            .cloned()
            .collect()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
