//! The HTTP server's edge against slow or greedy clients: an accept loop with a connection cap,
//! hyper's header-read timeout, and graceful shutdown bounded in time.
//!
//! - At most `max_connections` connections are served; one more is answered
//!   `503 {"error": ...}` and closed at once, without reading it, so a flood costs the flood.
//! - A client has `header_read_timeout` to send each request's headers (idle keep-alive
//!   connections included); then hyper closes the connection.
//! - Body-read deadlines, 414/431/408/413 JSON answers are per request: see
//!   [`crate::edge`].
//! - On shutdown the listener closes, every connection is asked to finish its request, and after
//!   `shutdown_timeout` the rest are cut, so the caller can write the final snapshot and exit.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

/// What the accept loop enforces.
#[derive(Clone, Debug)]
pub struct ServerLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub shutdown_timeout: Duration,
}

/// Refused connections being answered at once; past this they are closed without a word.
const REFUSING: usize = 64;

/// How long a refused connection is kept to let the 503 reach the client before closing.
const REFUSE_LINGER: Duration = Duration::from_millis(200);

/// Serves `router` on `listener` until `shutdown` resolves, then drains connections for at
/// most `limits.shutdown_timeout`.
///
/// # Errors
/// None today: accept failures (descriptor exhaustion included) are logged and retried.
pub async fn serve_http(
    listener: TcpListener,
    router: Router,
    limits: ServerLimits,
    refused: Counter,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(REFUSING));
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
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            refused.inc();
            refuse(stream, &refusing);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = builder.serve_connection(
            TokioIo::new(stream),
            TowerToHyperService::new(router.clone()),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
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
