//! A small blocking HTTP/1.1 client: forwards a callout to a loopback server, as Envoy's
//! async client would send it to the cluster. One connection per call (`connection: close`).

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::headers::Headers;
use crate::types::{Callout, CalloutReply, Response};

/// Without a callout timeout, a forwarded call still gives up after this long.
const DEFAULT_FORWARD_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) fn forward(addr: SocketAddr, callout: &Callout) -> CalloutReply {
    let timeout = callout.timeout.unwrap_or(DEFAULT_FORWARD_TIMEOUT);
    match exchange(addr, callout, timeout) {
        Ok(r) => CalloutReply::Response(r),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            CalloutReply::Response(
                Response::new(504)
                    .header("content-type", "text/plain")
                    .body("upstream request timeout"),
            )
        }
        // What Envoy's router answers when the connection fails.
        Err(e) => CalloutReply::Response(
            Response::new(503)
                .header("content-type", "text/plain")
                .body(format!(
                    "upstream connect error or disconnect/reset before headers. reset reason: {e}"
                )),
        ),
    }
}

fn exchange(addr: SocketAddr, callout: &Callout, timeout: Duration) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let h = &callout.headers;
    let mut req = format!(
        "{} {} HTTP/1.1\r\nhost: {}\r\n",
        h.get(":method").unwrap_or("GET"),
        h.get(":path").unwrap_or("/"),
        h.get(":authority").unwrap_or("localhost")
    )
    .into_bytes();
    for (k, v) in h.iter_bytes() {
        if k.starts_with(b":") || k == b"host" || k == b"content-length" || k == b"connection" {
            continue;
        }
        req.extend_from_slice(k);
        req.extend_from_slice(b": ");
        req.extend_from_slice(v);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(
        format!(
            "content-length: {}\r\nconnection: close\r\n\r\n",
            callout.body.len()
        )
        .as_bytes(),
    );
    req.extend_from_slice(&callout.body);
    stream.write_all(&req)?;
    read_response(&mut BufReader::new(stream))
}

fn bad(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_string())
}

fn read_line(r: &mut impl BufRead) -> std::io::Result<String> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    Ok(line.trim_end_matches(['\r', '\n']).to_string())
}

pub(crate) fn read_response(r: &mut impl BufRead) -> std::io::Result<Response> {
    let status_line = read_line(r)?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let mut headers = Headers::new();
    loop {
        let line = read_line(r)?;
        if line.is_empty() {
            break;
        }
        let (k, v) = line.split_once(':').ok_or_else(|| bad("bad header line"))?;
        headers.add(k.trim(), v.trim());
    }
    let mut body = Vec::new();
    if headers
        .get("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        loop {
            let size_line = read_line(r)?;
            let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| bad("bad chunk size"))?;
            if size == 0 {
                while !read_line(r)?.is_empty() {}
                break;
            }
            let mut chunk = vec![0; size];
            r.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk);
            read_line(r)?;
        }
        headers.remove("transfer-encoding");
    } else if let Some(len) = headers
        .get("content-length")
        .and_then(|v| v.parse::<usize>().ok())
    {
        body.resize(len, 0);
        r.read_exact(&mut body)?;
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok(Response {
        status,
        headers,
        body,
        trailers: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_chunked_and_sized_responses() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let r = read_response(&mut &raw[..]).unwrap();
        assert_eq!(
            (r.status, r.body.as_slice(), r.headers.get("x-a")),
            (200, &b"abcde"[..], Some("b"))
        );
        let raw = b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\nnoEXTRA";
        let r = read_response(&mut &raw[..]).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (404, &b"no"[..]));
    }
}
