//! The soak's figures: RSS slope, refusal counters from `/metrics`, the JSON and markdown.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::types::{Sample, SoakArgs, Tally, KINDS};

#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub(super) minutes: f64,
    pub(super) engines: usize,
    pub(super) cores: usize,
    pub(super) collector_alive_at_end: bool,
    pub(super) samples: usize,
    pub(super) peak_rss_kib: u64,
    pub(super) end_rss_kib: u64,
    pub(super) slope_second_half_kib_per_min: f64,
    pub(super) health_failures: usize,
    pub(super) query_probe_failures: usize,
    pub(super) batches: u64,
    pub(super) stores: u64,
    pub(super) removals: u64,
    pub(super) clears: u64,
    pub(super) queries_ok: u64,
    pub(super) queries_failed: u64,
    pub(super) queries_matched: u64,
    pub(super) query_p50_ms: f64,
    pub(super) query_p99_ms: f64,
    pub(super) feed_pages: u64,
    pub(super) feed_failed: u64,
    pub(super) feed_resets: u64,
    pub(super) hostile_runs: Vec<(String, usize)>,
    /// (seconds since start, kind, what it saw) of every hostile peer.
    pub(super) hostile_log: Vec<(f64, &'static str, String)>,
    pub(super) refused: Vec<(String, f64)>,
    pub(super) rss: Vec<Sample>,
}

/// Slope of the least-squares line through (t, y), per unit of t.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let (num, den) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    if den == 0.0 {
        0.0
    } else {
        num / den
    }
}

/// Counters of what the collector refused, summed over instances, from `/metrics`.
fn refused(metrics: &str) -> Vec<(String, f64)> {
    const NAMES: [&str; 6] = [
        "kvroute_limited_total",
        "kvroute_zmq_protocol_errors_total",
        "kvroute_http_connections_refused_total",
        "kvroute_load_reports_refused_total",
        "kvroute_skipped_total",
        "kvroute_decode_errors_total",
    ];
    let mut out: Vec<(String, f64)> = Vec::new();
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let Some(name) = NAMES.iter().find(|n| line.starts_with(*n)) else {
            continue;
        };
        let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        // Keep the reason label; instances are summed.
        let reason = line
            .split("reason=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .map(|r| format!("{{reason=\"{r}\"}}"))
            .unwrap_or_default();
        let key = format!("{name}{reason}");
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, s)) => *s += v,
            None => out.push((key, v)),
        }
    }
    out
}

pub(super) fn summarize(
    args: &SoakArgs,
    tally: &Tally,
    rss: Vec<Sample>,
    metrics: &str,
    alive: bool,
) -> Report {
    let half = rss.len() / 2;
    let second: Vec<(f64, f64)> = rss[half..]
        .iter()
        .map(|s| (s.t / 60.0, s.rss_kib as f64))
        .collect();
    let mut lat = tally.query_us.lock().map(|l| l.clone()).unwrap_or_default();
    lat.sort_unstable();
    let pct = |q: f64| {
        lat.get(((lat.len().max(1) - 1) as f64 * q) as usize)
            .map_or(0.0, |&us| us as f64 / 1e3)
    };
    let hostile = tally.hostile.lock().map(|h| h.clone()).unwrap_or_default();
    let hostile_runs = KINDS
        .iter()
        .map(|k| (k.to_string(), hostile.iter().filter(|h| h.1 == *k).count()))
        .collect();
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    Report {
        minutes: rss.last().map_or(0.0, |s| s.t / 60.0),
        engines: args.engines,
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        collector_alive_at_end: alive,
        samples: rss.len(),
        peak_rss_kib: rss.iter().map(|s| s.rss_kib).max().unwrap_or(0),
        end_rss_kib: rss.last().map_or(0, |s| s.rss_kib),
        slope_second_half_kib_per_min: slope(&second),
        health_failures: rss.iter().filter(|s| s.health != 200).count(),
        query_probe_failures: rss.iter().filter(|s| s.query != 200).count(),
        batches: get(&tally.batches),
        stores: get(&tally.stores),
        removals: get(&tally.removals),
        clears: get(&tally.clears),
        queries_ok: get(&tally.queries_ok),
        queries_failed: get(&tally.queries_failed),
        queries_matched: get(&tally.queries_matched),
        query_p50_ms: pct(0.5),
        query_p99_ms: pct(0.99),
        feed_pages: get(&tally.feed_pages),
        feed_failed: get(&tally.feed_failed),
        feed_resets: get(&tally.feed_resets),
        hostile_runs,
        hostile_log: hostile,
        refused: refused(metrics),
        rss,
    }
}

pub(super) fn markdown(r: &Report) -> String {
    let mut s = format!(
        "# Collector soak\n\n`kvroute-bench soak --engines {}`: {:.1} minutes, {} cores shared with the load generators. Collector {} at the end.\n\n",
        r.engines,
        r.minutes,
        r.cores,
        if r.collector_alive_at_end { "up" } else { "NOT up" }
    );
    s.push_str(&format!(
        "| figure | value |\n|---|---|\n| peak RSS | {:.1} MiB |\n| RSS at the end | {:.1} MiB |\n| RSS slope, second half (least squares) | {:.1} KiB/min |\n| /health probes not 200 | {} of {} |\n| /query probes not 200 | {} of {} |\n| engine batches / blocks stored / removed / clears | {} / {} / {} / {} |\n| /query load: ok / failed / with a match | {} / {} / {} |\n| /query load latency p50 / p99 (client side, HTTP) | {:.2} ms / {:.2} ms |\n| /v1/feed pages / failed / resets | {} / {} / {} |\n",
        r.peak_rss_kib as f64 / 1024.0,
        r.end_rss_kib as f64 / 1024.0,
        r.slope_second_half_kib_per_min,
        r.health_failures,
        r.samples,
        r.query_probe_failures,
        r.samples,
        r.batches,
        r.stores,
        r.removals,
        r.clears,
        r.queries_ok,
        r.queries_failed,
        r.queries_matched,
        r.query_p50_ms,
        r.query_p99_ms,
        r.feed_pages,
        r.feed_failed,
        r.feed_resets,
    ));
    s.push_str("\n## Hostile peers run\n\n| kind | times |\n|---|---|\n");
    for (k, n) in &r.hostile_runs {
        s.push_str(&format!("| {k} | {n} |\n"));
    }
    s.push_str("\n## Refused, from /metrics at the end\n\n| counter | value |\n|---|---|\n");
    for (k, v) in &r.refused {
        s.push_str(&format!("| `{k}` | {v} |\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_is_its_gradient() {
        let pts: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 3.0 * i as f64 + 7.0)).collect();
        assert!((slope(&pts) - 3.0).abs() < 1e-9);
        assert_eq!(slope(&pts[..1]), 0.0);
    }

    #[test]
    fn refused_sums_instances_and_keeps_reasons() {
        let m = "# HELP x\nkvroute_limited_total{reason=\"alias_taken\"} 3\nkvroute_zmq_protocol_errors_total{instance=\"a\",dp=\"\"} 2\nkvroute_zmq_protocol_errors_total{instance=\"b\",dp=\"\"} 5\nkvroute_events_total{instance=\"a\"} 9\n";
        let r = refused(m);
        assert_eq!(
            r,
            vec![
                (
                    "kvroute_limited_total{reason=\"alias_taken\"}".to_string(),
                    3.0
                ),
                ("kvroute_zmq_protocol_errors_total".to_string(), 7.0),
            ]
        );
    }
}
