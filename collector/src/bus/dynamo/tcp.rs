//! A request on Dynamo's TCP request plane (`DYN_REQUEST_PLANE=tcp`, Dynamo's default): how the
//! KV query reaches a worker whose discovery record names a TCP address ([`super::discovery`]).
//!
//! # The exchange (ai-dynamo 1.6.1; Dynamo's own client captured byte for byte in
//! `testdata/dynamo/tcp_request_plane_1.6.1.txt`)
//!
//! The asker connects to the record's `host:port` and writes one message: a big-endian u16
//! length and the endpoint path (the record's transport after `host:port/`), a u16 length and
//! the headers (a JSON object of strings: `request-id`, `x-endpoint-path`, and a send time
//! that is only traced), a u32 length and the payload. The payload is the two-part frame a
//! NATS request carries ([`super::recovery`]): the control header naming the asker's TCP
//! listener, then the msgpack `WorkerKvQueryRequest`. The worker acknowledges with a u32
//! length and its text: empty when it took the request, else why not (`Server unavailable:
//! unknown endpoint <path>`). The answer then comes exactly as on the NATS request plane: the
//! worker connects back to the listener the control header named.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::debug;

/// Largest acknowledgement taken (an error text; 1.6.1's are one line).
const MAX_ACK: usize = 16 << 10;

/// Why a request was not taken (the KV query counts them as `unreachable` and `bad_answer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotTaken {
    /// No connection, closed before the acknowledgement, or an error text (the worker serves
    /// no such endpoint).
    Unreachable,
    /// An acknowledgement over [`MAX_ACK`] or what the budget has left.
    TooLarge,
}

/// The request message to `path` carrying `payload`, `id` its request id; `None` when a part
/// is longer than its length field holds.
pub fn request(path: &str, id: &str, payload: &[u8]) -> Option<Vec<u8>> {
    let headers = serde_json::json!({"request-id": id, "x-endpoint-path": path}).to_string();
    let path_len = u16::try_from(path.len()).ok()?;
    let headers_len = u16::try_from(headers.len()).ok()?;
    let payload_len = u32::try_from(payload.len()).ok()?;
    let mut out = Vec::with_capacity(8 + path.len() + headers.len() + payload.len());
    out.extend_from_slice(&path_len.to_be_bytes());
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(&headers_len.to_be_bytes());
    out.extend_from_slice(headers.as_bytes());
    out.extend_from_slice(&payload_len.to_be_bytes());
    out.extend_from_slice(payload);
    Some(out)
}

/// Sends `message` to `addr` and waits for the worker to take it. The caller bounds the time;
/// the acknowledgement counts against `budget` (the answer's `--dynamo-recovery-max-bytes`).
///
/// # Errors
/// Nothing there took it ([`NotTaken`]).
pub async fn send(addr: &str, message: &[u8], budget: &mut usize) -> Result<(), NotTaken> {
    let mut stream = TcpStream::connect(addr).await.map_err(|e| {
        debug!(addr, error = %e, "dynamo: no TCP request plane there");
        NotTaken::Unreachable
    })?;
    stream
        .write_all(message)
        .await
        .map_err(|_| NotTaken::Unreachable)?;
    // Closing after the acknowledgement is fine: the answer comes on its own connection.
    read_ack(&mut stream, budget).await
}

/// Reads one acknowledgement, its length checked before anything is allocated.
pub async fn read_ack<R: AsyncRead + Unpin>(r: &mut R, budget: &mut usize) -> Result<(), NotTaken> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)
        .await
        .map_err(|_| NotTaken::Unreachable)?;
    let n = u32::from_be_bytes(len) as usize;
    if n == 0 {
        return Ok(());
    }
    if n > MAX_ACK || 4 + n > *budget {
        return Err(NotTaken::TooLarge);
    }
    *budget -= 4 + n;
    let mut text = vec![0; n];
    r.read_exact(&mut text)
        .await
        .map_err(|_| NotTaken::Unreachable)?;
    debug!(ack = %String::from_utf8_lossy(&text), "dynamo: the worker did not take the KV query");
    Err(NotTaken::Unreachable)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn section(name: &str, key: &str) -> Vec<u8> {
        let text = include_str!("../../../../testdata/dynamo/tcp_request_plane_1.6.1.txt");
        let sec = text
            .split("\n### ")
            .find(|s| s.starts_with(&format!("{name}\n")))
            .unwrap();
        let hex = sec
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}: ")))
            .unwrap();
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect()
    }

    /// A request message's three parts, as a worker reads them.
    fn parts(m: &[u8]) -> (String, BTreeMap<String, String>, Vec<u8>) {
        let pl = usize::from(u16::from_be_bytes([m[0], m[1]]));
        let path = String::from_utf8(m[2..2 + pl].to_vec()).unwrap();
        let at = 2 + pl;
        let hl = usize::from(u16::from_be_bytes([m[at], m[at + 1]]));
        let headers = serde_json::from_slice(&m[at + 2..at + 2 + hl]).unwrap();
        let at = at + 2 + hl;
        let bl = u32::from_be_bytes(m[at..at + 4].try_into().unwrap()) as usize;
        assert_eq!(m.len(), at + 4 + bl, "nothing after the payload");
        (path, headers, m[at + 4..].to_vec())
    }

    #[test]
    fn requests_are_framed_as_dynamos_own_client_frames_them() {
        // What ai-dynamo 1.6.1's client sent to the worker's KV query endpoint.
        let theirs = section("dynamo_client", "request");
        let (path, headers, payload) = parts(&theirs);
        assert_eq!(
            path,
            "c95533ff79c81c0a/dynamo/backend/worker_kv_query_source_5d9a76a3846f7"
        );
        assert_eq!(headers["x-endpoint-path"], path);
        let ours = request(&path, &headers["request-id"], &payload).unwrap();
        let (p2, h2, b2) = parts(&ours);
        assert_eq!((&p2, &b2), (&path, &payload));
        // The same headers but the send time, which the worker only traces.
        let mut want = headers.clone();
        want.remove("x-frontend-send-ts-ns");
        assert_eq!(h2, want);
        // The bytes around the headers are the same bytes.
        assert_eq!(ours[..2 + path.len()], theirs[..2 + path.len()]);
        let n = 4 + payload.len();
        assert_eq!(ours[ours.len() - n..], theirs[theirs.len() - n..]);
        // Lengths over their fields.
        assert!(request(&"p".repeat(70_000), "id", b"").is_none());
    }

    #[tokio::test]
    async fn acknowledgements_decode() {
        let mut budget = 1000;
        // Taken (the worker's reply to Dynamo's client, and to ours).
        let ack = section("dynamo_client", "reply");
        assert_eq!(ack, [0, 0, 0, 0]);
        assert_eq!(read_ack(&mut &ack[..], &mut budget).await, Ok(()));
        assert_eq!(
            read_ack(&mut &section("2_3", "ack")[..], &mut budget).await,
            Ok(())
        );
        // An endpoint path the worker does not serve.
        let refused = section("unknown_path", "ack");
        assert_eq!(
            read_ack(&mut &refused[..], &mut budget).await,
            Err(NotTaken::Unreachable)
        );
        assert_eq!(budget, 1000 - refused.len());
        // Cut short, over the limit or the budget.
        assert_eq!(
            read_ack(&mut &refused[..10], &mut budget).await,
            Err(NotTaken::Unreachable)
        );
        assert_eq!(
            read_ack(&mut &[0u8, 0][..], &mut budget).await,
            Err(NotTaken::Unreachable)
        );
        assert_eq!(
            read_ack(&mut &[0xffu8, 0xff, 0xff, 0xff][..], &mut budget).await,
            Err(NotTaken::TooLarge)
        );
        let mut small = 50;
        assert_eq!(
            read_ack(&mut &refused[..], &mut small).await,
            Err(NotTaken::TooLarge)
        );
    }
}
