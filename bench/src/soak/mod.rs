//! `kvroute-bench soak`: the real `kvroute-collector` binary under a steady fleet and hostile
//! peers for `--minutes`, its memory sampled every second.
//!
//! - **fleet**: `--engines` simulated vLLM engines (`kvroute_sim::publisher`, real ZMQ on
//!   loopback), registered over `/register`. Each stores prompts that share system-prompt
//!   prefixes, removes its oldest blocks past `--engine-blocks` (an engine's cache is bounded,
//!   so the index should be too) and now and then clears everything.
//! - **readers**: `/query` with prompts from the same prefixes, a `/v1/feed` follower, and
//!   `/health`, `/query` probes each second.
//! - **hostile peers**, one at a time at random intervals: a ZMQ PUB whose frame header
//!   claims 2^62 bytes, one sending a frame over `--max-zmq-message-bytes`, an alias flood
//!   (a fresh `lora_name` per event), a dp-rank flood, half-sent HTTP headers, slow bodies,
//!   bad `/v1/load` reports. Each flooding engine unregisters when done.
//!
//! At the end: peak RSS, the least-squares slope of RSS over the second half (KiB/min), what
//! `/metrics` says was refused, and whether the process stayed up and kept answering. JSON and
//! markdown go to `--out` (`bench-out/soak/`).

mod fleet;
mod hostile;
mod report;
mod types;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvroute_sim::publisher::{Publisher, PublisherConfig};
use kvroute_sim::wire::EventFormat;

use fleet::{engine, feed_follower, prompt, querier, register};
use hostile::hostile;
use report::{markdown, summarize};
pub use types::SoakArgs;
use types::{Sample, Tally, MODEL};

/// Runs the soak; writes the report files and prints the markdown.
pub fn run(args: SoakArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(soak(args))
}

fn collector_bin(args: &SoakArgs) -> PathBuf {
    args.collector.clone().unwrap_or_else(|| {
        let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
        PathBuf::from(dir).join("native/kvroute-collector")
    })
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn soak(args: SoakArgs) -> anyhow::Result<()> {
    let bin = collector_bin(&args);
    let addr = format!("127.0.0.1:{}", free_port()?);
    let base = format!("http://{addr}");
    // Short header and body timeouts so the half-sent requests are cut within the run; no
    // engine scrapes (the engines' HTTP addresses are made up).
    let mut child = tokio::process::Command::new(&bin)
        .args(["--listen", &addr, "--default-serving-port", "8000"])
        .args([
            "--max-zmq-message-bytes",
            &args.max_zmq_message_bytes.to_string(),
        ])
        .args([
            "--header-read-timeout-secs",
            "2",
            "--body-read-timeout-secs",
            "2",
        ])
        .args(["--scrape-interval-secs", "0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id().context("collector pid")?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let up = Instant::now() + Duration::from_secs(20);
    while !http
        .get(format!("{base}/health"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        anyhow::ensure!(Instant::now() < up, "the collector did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "soak: collector pid {pid} on {addr}, {} engines, {} min",
        args.engines, args.minutes
    );

    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for e in 0..args.engines {
        let p = Publisher::start(PublisherConfig::loopback(EventFormat::Vllm033))
            .await
            .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
        register(&http, &base, &format!("engine-{e}"), &p, e as u32).await?;
        tasks.push(tokio::spawn(engine(
            p,
            args.clone(),
            args.seed ^ ((e as u64 + 1) * 0x9e37_79b9),
            tally.clone(),
            stop.clone(),
        )));
    }
    tasks.push(tokio::spawn(querier(
        http.clone(),
        base.clone(),
        args.clone(),
        tally.clone(),
        stop.clone(),
    )));
    tasks.push(tokio::spawn(feed_follower(
        http.clone(),
        base.clone(),
        tally.clone(),
        stop.clone(),
    )));
    tasks.push(tokio::spawn(hostile(
        http.clone(),
        base.clone(),
        addr.clone(),
        args.clone(),
        tally.clone(),
        stop.clone(),
        start,
    )));

    let mut samples = Vec::new();
    let until = start + Duration::from_secs_f64(args.minutes * 60.0);
    let mut alive = true;
    let probe_prompt = prompt(&mut fastrand::Rng::with_seed(args.seed), 8);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while Instant::now() < until {
        tick.tick().await;
        if child.try_wait()?.is_some() {
            alive = false;
            eprintln!("soak: the collector exited");
            break;
        }
        let health = status(http.get(format!("{base}/health")).send().await);
        let query = status(
            http.post(format!("{base}/query"))
                .json(&serde_json::json!({"token_ids": probe_prompt, "model_name": MODEL}))
                .send()
                .await,
        );
        let rss_kib = rss_kib(pid).unwrap_or(0);
        let t = start.elapsed().as_secs_f64();
        if samples.len() % 60 == 0 {
            eprintln!("soak: {t:.0} s, RSS {rss_kib} KiB, health {health}, query {query}");
        }
        samples.push(Sample {
            t,
            rss_kib,
            health,
            query,
        });
    }
    stop.store(true, Ordering::Relaxed);
    let metrics = match http.get(format!("{base}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    alive &= child.try_wait()?.is_none();
    for t in tasks {
        t.abort();
    }
    let _ = child.kill().await;

    let report = summarize(&args, &tally, samples, &metrics, alive);
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let md = markdown(&report);
    std::fs::write(
        args.out.join("soak.json"),
        serde_json::to_vec_pretty(&report)?,
    )?;
    std::fs::write(args.out.join("soak.md"), &md)?;
    print!("{md}");
    anyhow::ensure!(
        report.collector_alive_at_end,
        "the collector did not stay up"
    );
    Ok(())
}

fn status(r: reqwest::Result<reqwest::Response>) -> u16 {
    r.map_or(0, |r| r.status().as_u16())
}

/// Resident set size from /proc/<pid>/status, KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}
