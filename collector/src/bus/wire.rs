//! The bus envelope: one message on the JetStream stream, written by the ingest role and read
//! by the index role (both in this file, so there is one copy of the format).
//!
//! The payload of a [`Kind::Batch`] is the engine's own msgpack batch, byte for byte, after
//! it decoded on the ingest side: the index role decodes it with the same
//! [`crate::decode::decode`] and applies it through the same [`crate::shared::Shared::apply_batch`],
//! so a replica cannot drift from a direct-ZMQ collector by a second encoding, and nothing is
//! re-encoded on the hot path (msgpack is already the compact form the engines chose).
//!
//! # Layout
//!
//! ```text
//! 0   4  magic "KVRB"
//! 4   1  version (1)
//! 5   1  kind: 0 batch, 1 reset (engine restarted: its blocks are gone), 2 expired (stream
//!        dropped longer than --keep-disconnected-secs), 3 connected, 4 disconnected
//! 6   8  the engine's sequence number, big-endian (the ZMQ seq frame)
//! 14  4  the registered dp rank of the worker, big-endian
//! 18  2  n: length of the instance id, big-endian (at most MAX_NAME_BYTES)
//! 20  n  instance id, UTF-8
//! ..     payload (kind 0: the engine's msgpack batch; otherwise empty)
//! ```
//!
//! Decoding checks every length against the bytes present before it takes anything; the
//! payload is a slice of the received buffer, not a copy.

use bytes::{BufMut, Bytes, BytesMut};

use crate::hub::MAX_NAME_BYTES;

/// First bytes of every envelope.
pub const MAGIC: &[u8; 4] = b"KVRB";
/// The layout version written.
pub const VERSION: u8 = 1;
/// Bytes before the instance id.
const HEADER_BYTES: usize = 20;

/// What one envelope says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// An engine batch the ingest role decoded and applied.
    Batch = 0,
    /// The engine restarted (its sequence went back): drop the worker's blocks.
    Reset = 1,
    /// The engine's stream was gone longer than `--keep-disconnected-secs`.
    Expired = 2,
    /// The engine's publisher connected.
    Connected = 3,
    /// The engine's publisher went away.
    Disconnected = 4,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            0 => Kind::Batch,
            1 => Kind::Reset,
            2 => Kind::Expired,
            3 => Kind::Connected,
            4 => Kind::Disconnected,
            _ => return None,
        })
    }

    /// Short name, for message ids and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Batch => "batch",
            Kind::Reset => "reset",
            Kind::Expired => "expired",
            Kind::Connected => "connected",
            Kind::Disconnected => "disconnected",
        }
    }
}

/// One decoded envelope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    pub kind: Kind,
    pub seq: u64,
    pub dp_rank: u32,
    pub instance_id: String,
    pub payload: Bytes,
}

/// Why an envelope was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("shorter than its header ({0} bytes)")]
    Short(usize),
    #[error("not a kvroute bus message (magic)")]
    Magic,
    #[error("layout version {0} is not known")]
    Version(u8),
    #[error("kind {0} is not known")]
    Kind(u8),
    #[error("instance id of {0} bytes (limit {MAX_NAME_BYTES}, or past the end)")]
    Instance(usize),
    #[error("instance id is not UTF-8")]
    Utf8,
    #[error("payload on a message of kind {0}")]
    Payload(u8),
}

/// Writes one envelope.
pub fn encode(kind: Kind, seq: u64, dp_rank: u32, instance_id: &str, payload: &[u8]) -> Bytes {
    let id = instance_id.as_bytes();
    let n = id.len().min(MAX_NAME_BYTES);
    let mut b = BytesMut::with_capacity(HEADER_BYTES + n + payload.len());
    b.put_slice(MAGIC);
    b.put_u8(VERSION);
    b.put_u8(kind as u8);
    b.put_u64(seq);
    b.put_u32(dp_rank);
    b.put_u16(n as u16);
    b.put_slice(&id[..n]);
    b.put_slice(payload);
    b.freeze()
}

/// Reads one envelope; the payload is a slice of `msg`.
///
/// # Errors
/// Any [`WireError`]: short, foreign, of an unknown version or kind, a bad instance id.
pub fn decode(msg: &Bytes) -> Result<Envelope, WireError> {
    if msg.len() < HEADER_BYTES {
        return Err(WireError::Short(msg.len()));
    }
    if &msg[..4] != MAGIC {
        return Err(WireError::Magic);
    }
    if msg[4] != VERSION {
        return Err(WireError::Version(msg[4]));
    }
    let kind = Kind::from_u8(msg[5]).ok_or(WireError::Kind(msg[5]))?;
    let seq = u64::from_be_bytes(msg[6..14].try_into().map_err(|_| WireError::Short(14))?);
    let dp_rank = u32::from_be_bytes(msg[14..18].try_into().map_err(|_| WireError::Short(18))?);
    let n = usize::from(u16::from_be_bytes([msg[18], msg[19]]));
    if n > MAX_NAME_BYTES || HEADER_BYTES + n > msg.len() {
        return Err(WireError::Instance(n));
    }
    let instance_id = std::str::from_utf8(&msg[HEADER_BYTES..HEADER_BYTES + n])
        .map_err(|_| WireError::Utf8)?
        .to_owned();
    let payload = msg.slice(HEADER_BYTES + n..);
    if kind != Kind::Batch && !payload.is_empty() {
        return Err(WireError::Payload(kind as u8));
    }
    Ok(Envelope {
        kind,
        seq,
        dp_rank,
        instance_id,
        payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_keeps_every_field() {
        let b = encode(Kind::Batch, 7, 2, "engine-a", b"\x93\xcb");
        let e = decode(&b).unwrap();
        assert_eq!(
            e,
            Envelope {
                kind: Kind::Batch,
                seq: 7,
                dp_rank: 2,
                instance_id: "engine-a".into(),
                payload: Bytes::from_static(b"\x93\xcb"),
            }
        );
        let r = decode(&encode(Kind::Reset, u64::MAX, 0, "", b"")).unwrap();
        assert_eq!((r.kind, r.seq), (Kind::Reset, u64::MAX));
    }

    #[test]
    fn bad_envelopes_are_named() {
        let good = encode(Kind::Batch, 1, 0, "a", b"x");
        assert_eq!(decode(&good.slice(..10)), Err(WireError::Short(10)));
        let mut m = good.to_vec();
        m[0] = b'X';
        assert_eq!(decode(&Bytes::from(m)), Err(WireError::Magic));
        let mut m = good.to_vec();
        m[4] = 9;
        assert_eq!(decode(&Bytes::from(m)), Err(WireError::Version(9)));
        let mut m = good.to_vec();
        m[5] = 77;
        assert_eq!(decode(&Bytes::from(m)), Err(WireError::Kind(77)));
        let mut m = good.to_vec();
        m[18] = 0xff;
        assert!(matches!(
            decode(&Bytes::from(m)),
            Err(WireError::Instance(_))
        ));
        let with_payload = encode(Kind::Connected, 1, 0, "a", b"x");
        assert_eq!(decode(&with_payload), Err(WireError::Payload(3)));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(&Bytes::from(bytes));
        }

        #[test]
        fn decode_of_encode_is_identity(seq: u64, dp: u32, id in "[a-z0-9:.-]{0,40}", payload in proptest::collection::vec(any::<u8>(), 0..64)) {
            let e = decode(&encode(Kind::Batch, seq, dp, &id, &payload)).unwrap();
            prop_assert_eq!(e.seq, seq);
            prop_assert_eq!(e.dp_rank, dp);
            prop_assert_eq!(e.instance_id, id);
            prop_assert_eq!(&e.payload[..], &payload[..]);
        }
    }
}
