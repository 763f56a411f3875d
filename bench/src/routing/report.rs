//! The bench's outputs: the results table (markdown), `results.json` and the PNG plots.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use kvroute_sim::replay::{quantile, RequestResult, Summary};

/// Engine-side counters of one policy's run, per engine (from the engines themselves, so they
/// hold whatever a peer router does to response headers).
#[derive(Clone, Debug, Default, Serialize)]
pub struct EngineLoad {
    pub requests: Vec<u64>,
    pub prompt_tokens: Vec<u64>,
    pub cached_tokens: Vec<u64>,
}

impl EngineLoad {
    /// Engine-side prefix hit rate: cached / prompt tokens.
    pub fn hit_rate(&self) -> f64 {
        let p: u64 = self.prompt_tokens.iter().sum();
        let c: u64 = self.cached_tokens.iter().sum();
        if p == 0 {
            0.0
        } else {
            c as f64 / p as f64
        }
    }

    /// Busiest engine's requests / mean.
    pub fn request_spread(&self) -> f64 {
        max_over_mean(&self.requests)
    }

    /// Busiest engine's computed (uncached) prefill tokens / mean.
    pub fn prefill_spread(&self) -> f64 {
        let v: Vec<u64> = self
            .prompt_tokens
            .iter()
            .zip(&self.cached_tokens)
            .map(|(p, c)| p - c)
            .collect();
        max_over_mean(&v)
    }

    /// Computed prefill tokens over the whole run.
    pub fn computed_tokens(&self) -> u64 {
        self.prompt_tokens.iter().sum::<u64>() - self.cached_tokens.iter().sum::<u64>()
    }
}

fn max_over_mean(v: &[u64]) -> f64 {
    let sum: u64 = v.iter().sum();
    if v.is_empty() || sum == 0 {
        return 0.0;
    }
    *v.iter().max().unwrap_or(&0) as f64 / (sum as f64 / v.len() as f64)
}

/// One policy's outcome.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyResult {
    pub policy: String,
    /// `None` when it ran; otherwise why it was skipped.
    pub skipped: Option<String>,
    pub summary: Option<Summary>,
    pub engines: EngineLoad,
    /// Computed prefill tokens / (engines × prefill rate × duration): the fleet's prefill
    /// utilization (≥ 1 means saturated).
    pub prefill_utilization: f64,
    /// Wall-clock seconds the run took.
    pub wall_s: f64,
    /// Requests whose index query failed (in-process KV-aware policies).
    pub query_errors: u64,
    /// The filter's Envoy counters (`kvroute.*`), summed over the gateways (shipped path).
    pub gateway_stats: std::collections::BTreeMap<String, u64>,
    /// TTFT p50 and p90 had no request waited for another's prefill: each request's own
    /// uncached prompt at the engines' prefill rate plus the fixed first-token overhead, at
    /// the cache hits this policy got. No router can go below it without more hits.
    pub no_wait_ttft_s: [f64; 2],
    /// TTFT p50 and p90 of every run (`--repeat`), in run order; this result is the run with
    /// the median p90.
    pub runs_ttft_s: Vec<[f64; 2]>,
    /// The prefix hit rate of every run that happened, in run order. Hit rates are compared
    /// by their mean over runs ([`PolicyResult::hit_rate`]): with ~60 hits in 2,000 requests, a
    /// few hits more or less move one run's rate by 0.3 points.
    pub runs_hit_rate: Vec<f64>,
    #[serde(skip)]
    pub results: Vec<RequestResult>,
}

/// [`PolicyResult::no_wait_ttft_s`] of `results` on engines prefilling `tokens_per_s` with a
/// first-token `overhead_s`.
pub fn no_wait_ttft(results: &[RequestResult], tokens_per_s: f64, overhead_s: f64) -> [f64; 2] {
    let mut t: Vec<f64> = results
        .iter()
        .filter(|r| r.ok())
        .map(|r| {
            let uncached = r.prompt_tokens.saturating_sub(r.cached_tokens.unwrap_or(0));
            uncached as f64 / tokens_per_s.max(1.0) + overhead_s
        })
        .collect();
    t.sort_by(f64::total_cmp);
    [quantile(&t, 0.5), quantile(&t, 0.9)]
}

impl PolicyResult {
    /// A policy that did not run, and why.
    pub fn skipped(policy: &str, why: String) -> PolicyResult {
        PolicyResult {
            policy: policy.to_string(),
            skipped: Some(why),
            summary: None,
            engines: EngineLoad::default(),
            prefill_utilization: 0.0,
            wall_s: 0.0,
            query_errors: 0,
            gateway_stats: Default::default(),
            no_wait_ttft_s: [f64::NAN; 2],
            runs_ttft_s: Vec::new(),
            runs_hit_rate: Vec::new(),
            results: Vec::new(),
        }
    }

    /// The prefix hit rate: the mean over [`PolicyResult::runs_hit_rate`] when it holds runs,
    /// else this run's.
    pub fn hit_rate(&self) -> f64 {
        match self.runs_hit_rate.len() {
            0 => self.engines.hit_rate(),
            n => self.runs_hit_rate.iter().sum::<f64>() / n as f64,
        }
    }

    /// The model TTFT p50 and p90 of this run (NaN when it did not run).
    pub fn ttft_s(&self) -> [f64; 2] {
        self.summary
            .as_ref()
            .map_or([f64::NAN; 2], |s| [s.model_ttft_p50_s, s.model_ttft_p90_s])
    }
}

/// One result for several runs of a policy: the run with the median TTFT p90 (the lower
/// middle one for an even count; runs that did not run sort last), with every run's p50 and
/// p90 in [`PolicyResult::runs_ttft_s`]. `None` for no runs.
pub fn median_run(mut runs: Vec<PolicyResult>) -> Option<PolicyResult> {
    let all: Vec<[f64; 2]> = runs.iter().map(PolicyResult::ttft_s).collect();
    let hits: Vec<f64> = runs
        .iter()
        .filter(|r| r.summary.is_some())
        .map(|r| r.engines.hit_rate())
        .collect();
    let ran = all.iter().filter(|t| !t[1].is_nan()).count();
    runs.sort_by(|a, b| a.ttft_s()[1].total_cmp(&b.ttft_s()[1]));
    let mut median = runs.into_iter().nth(ran.saturating_sub(1) / 2)?;
    median.runs_ttft_s = all;
    median.runs_hit_rate = hits;
    Some(median)
}

/// One target of the benchmark, checked on a run.
#[derive(Clone, Debug, Serialize)]
pub struct TargetCheck {
    pub scenario: &'static str,
    pub target: String,
    pub measured: f64,
    pub bound: f64,
    /// `None` when a policy it needs did not run.
    pub met: Option<bool>,
}

fn find<'a>(
    all: &'a [(String, Vec<PolicyResult>)],
    scenario: &str,
    policy: &str,
) -> Option<&'a PolicyResult> {
    all.iter()
        .filter(|(s, _)| s == scenario)
        .flat_map(|(_, r)| r)
        .find(|r| r.policy == policy && r.summary.is_some())
}

/// The targets for the shipped kvroute (`measured ≤ bound`, except the hit rate:
/// `measured ≥ bound`).
///
/// `fleet_floor`: [`super::floor::fleet_lru_ttft`]'s p50 and p90 of the trace scenario, printed
/// as a reference beside the bound against vllm-router's p90.
pub fn targets(
    all: &[(String, Vec<PolicyResult>)],
    fleet_floor: Option<[f64; 2]>,
) -> Vec<TargetCheck> {
    let p50 = |r: &PolicyResult| r.ttft_s()[0];
    let p90 = |r: &PolicyResult| r.ttft_s()[1];
    let mut out = Vec::new();
    let mut check = |scenario,
                     target: &str,
                     kv: Option<&PolicyResult>,
                     other: Option<&PolicyResult>,
                     f: &dyn Fn(&PolicyResult) -> f64,
                     factor: f64,
                     at_least: bool| {
        let (measured, bound) = match (kv, other) {
            (Some(k), Some(o)) => (f(k), f(o) * factor),
            _ => (f64::NAN, f64::NAN),
        };
        let met = if measured.is_nan() || bound.is_nan() {
            None
        } else if at_least {
            Some(measured >= bound)
        } else {
            Some(measured <= bound)
        };
        out.push(TargetCheck {
            scenario,
            target: target.to_string(),
            measured,
            bound,
            met,
        });
    };
    let kv = find(all, "trace", "kvroute");
    let vr = find(all, "trace", "vllm-router");
    let or = find(all, "trace", "oracle");
    check(
        "trace",
        "TTFT p50 ≤ 0.9× vllm-router's",
        kv,
        vr,
        &p50,
        0.9,
        false,
    );
    check(
        "trace",
        "TTFT p90 ≤ 0.9× vllm-router's",
        kv,
        vr,
        &p90,
        0.9,
        false,
    );
    check(
        "trace",
        "TTFT p50 ≤ 1.05× the oracle's",
        kv,
        or,
        &p50,
        1.05,
        false,
    );
    check(
        "trace",
        "TTFT p90 ≤ 1.05× the oracle's",
        kv,
        or,
        &p90,
        1.05,
        false,
    );
    check(
        "trace",
        "hit rate ≥ the oracle's (mean over runs)",
        kv,
        or,
        &PolicyResult::hit_rate,
        1.0,
        true,
    );
    let two = find(all, "replicas", "kvroute-2gw");
    check(
        "replicas",
        "two gateways: TTFT p90 ≤ 1.05× one gateway's",
        two,
        kv,
        &p90,
        1.05,
        false,
    );
    check(
        "burst",
        "TTFT p90 ≤ 0.5× longest-prefix's",
        find(all, "burst", "kvroute"),
        find(all, "burst", "longest-prefix"),
        &p90,
        0.5,
        false,
    );
    // Issue 14. "Within 2 %" is relative: exact text keeps ≥ 98 % of the token-id path's hit
    // rate (stricter than 2 points at any hit rate below 100 %); above it is no miss.
    let hit = PolicyResult::hit_rate;
    let ids = find(all, "text", "kvroute-ids");
    for exact in ["kvroute-text-chat", "kvroute-text-prompt"] {
        check(
            "text",
            &format!("{exact}: hit rate ≥ 0.98× kvroute-ids'"),
            find(all, "text", exact),
            ids,
            &hit,
            0.98,
            true,
        );
    }
    let approx = find(all, "text", "kvroute-text-approx");
    let sglang = find(all, "text", "sglang-router");
    check(
        "text",
        "kvroute-text-approx: hit rate ≥ sglang-router's",
        approx,
        sglang,
        &hit,
        1.0,
        true,
    );
    let (m, b) = match (approx, sglang) {
        (Some(x), Some(s)) => (p90(x), p90(s)),
        _ => (f64::NAN, f64::NAN),
    };
    out.push(TargetCheck {
        scenario: "text",
        target: "kvroute-text-approx: TTFT p90 < sglang-router's".into(),
        measured: m,
        bound: b,
        met: (!m.is_nan() && !b.is_nan()).then_some(m < b),
    });
    // The floors beside the p90 bound (after it): a bound below them cannot be met by routing.
    let bound = vr.map_or(f64::NAN, |v| p90(v) * 0.9);
    let reference = |target: &str, measured: f64| TargetCheck {
        scenario: "trace",
        target: target.into(),
        measured,
        bound,
        met: None,
    };
    out.splice(
        2..2,
        [
            reference(
                "(reference) kvroute's TTFT p90 had no request waited, vs the 0.9× bound",
                kv.map_or(f64::NAN, |k| k.no_wait_ttft_s[1]),
            ),
            reference(
                "(reference) TTFT p90 had no request waited, the fleet's caches one LRU (router-independent), vs the 0.9× bound",
                fleet_floor.map_or(f64::NAN, |f| f[1]),
            ),
        ],
    );
    let load = kv.map(|k| k.engines.request_spread());
    out.push(TargetCheck {
        scenario: "trace",
        target: "max/mean requests per engine ≤ 1.1".into(),
        measured: load.unwrap_or(f64::NAN),
        bound: 1.1,
        met: load.map(|l| l <= 1.1),
    });
    out
}

/// The targets as a markdown table.
pub fn targets_table(t: &[TargetCheck]) -> String {
    let mut s = String::from(
        "| scenario | target (shipped kvroute) | measured | bound | met |\n|---|---|---|---|---|\n",
    );
    for c in t {
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} | {:.3} | {} |",
            c.scenario,
            c.target,
            c.measured,
            c.bound,
            match c.met {
                Some(true) => "met",
                Some(false) => "**not met**",
                None if c.target.starts_with("(reference)") => "–",
                None => "not run",
            }
        );
    }
    s
}

fn pct(rate: f64) -> String {
    format!("{:.1} %", rate * 100.0)
}

fn ms(s: f64) -> String {
    if s.is_nan() {
        "–".into()
    } else if s < 10.0 {
        format!("{:.0} ms", s * 1000.0)
    } else {
        format!("{s:.1} s")
    }
}

/// A column some scenarios add to the results table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Column {
    /// Each engine's requests, engine by engine (`a / b / c / d`).
    EngineRequests,
    /// Requests the client sent a second time after a failure, and how many of those then
    /// succeeded on an engine other than the one named (the one that failed).
    Retried(&'static str),
    /// One of the filter's request outcomes (`kvroute.requests.<name>`), summed over the
    /// gateways; empty for policies without a gateway.
    Outcome(&'static str),
}

impl Column {
    fn header(self) -> String {
        match self {
            Column::EngineRequests => "requests per engine".into(),
            Column::Retried(e) => format!("retried (then ok off {e})"),
            Column::Outcome(o) => format!("filter: {o}"),
        }
    }

    fn cell(self, r: &PolicyResult) -> String {
        match self {
            Column::EngineRequests => r
                .engines
                .requests
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(" / "),
            Column::Retried(engine) => {
                let retried = r.results.iter().filter(|x| x.retried);
                let (n, elsewhere) = retried.fold((0, 0), |(n, e), x| {
                    let off = x.ok() && x.engine.as_deref() != Some(engine);
                    (n + 1, e + usize::from(off))
                });
                format!("{n} ({elsewhere})")
            }
            Column::Outcome(o) => r
                .gateway_stats
                .get(&format!("kvroute.requests.{o}"))
                .map_or_else(String::new, u64::to_string),
        }
    }
}

/// The results table, markdown.
pub fn table(results: &[PolicyResult]) -> String {
    table_with(results, &[])
}

/// The results table with `extra` columns after the common ones, markdown.
pub fn table_with(results: &[PolicyResult], extra: &[Column]) -> String {
    let mut t = String::new();
    t.push_str("| policy | prefix hit rate | TTFT p50 | TTFT p90 | TTFT p99 | client TTFT p90 | throughput (req/s) | tokens/s | max/mean requests | max/mean prefill | prefill util. | failed |");
    for c in extra {
        let _ = write!(t, " {} |", c.header());
    }
    t.push_str("\n|---|---|---|---|---|---|---|---|---|---|---|---|");
    t.push_str(&"---|".repeat(extra.len()));
    t.push('\n');
    for r in results {
        match (&r.summary, &r.skipped) {
            (Some(s), None) => {
                let _ = write!(
                    t,
                    "| {} | {:.1} % | {} | {} | {} | {} | {:.2} | {:.0} | {:.2} | {:.2} | {:.0} % | {} |",
                    r.policy,
                    r.engines.hit_rate() * 100.0,
                    ms(s.model_ttft_p50_s),
                    ms(s.model_ttft_p90_s),
                    ms(s.model_ttft_p99_s),
                    ms(s.ttft_p90_s),
                    s.requests_per_s,
                    s.tokens_per_s,
                    r.engines.request_spread(),
                    r.engines.prefill_spread(),
                    r.prefill_utilization * 100.0,
                    s.failed
                );
                for c in extra {
                    let _ = write!(t, " {} |", c.cell(r));
                }
                t.push('\n');
            }
            (_, Some(why)) => {
                let _ = writeln!(
                    t,
                    "| {} | skipped: {} | | | | | | | | | | |{}",
                    r.policy,
                    why.replace('|', "/"),
                    " |".repeat(extra.len())
                );
            }
            _ => {}
        }
    }
    if results.iter().any(|r| r.runs_ttft_s.len() > 1) {
        t.push_str("\nEvery run (`--repeat`), TTFT p50 / p90; the table above holds each policy's run with the median p90. Hit rates are compared by their mean over runs:\n\n| policy | runs | hit rate of each run | mean |\n|---|---|---|---|\n");
        for r in results {
            let runs: Vec<String> = r
                .runs_ttft_s
                .iter()
                .map(|[p50, p90]| format!("{} / {}", ms(*p50), ms(*p90)))
                .collect();
            let hits: Vec<String> = r.runs_hit_rate.iter().map(|h| pct(*h)).collect();
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} |",
                r.policy,
                runs.join(", "),
                hits.join(", "),
                pct(r.hit_rate())
            );
        }
    }
    t
}

/// Registers a system TTF font for plot text; false if none is found (plots are skipped).
pub fn load_font() -> bool {
    for p in [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    ] {
        if let Ok(bytes) = std::fs::read(p) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
    }
    false
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// TTFT CDF per policy, log time axis.
pub fn plot_ttft_cdf(results: &[PolicyResult], path: &Path, title: &str) -> PlotResult {
    let root = BitMapBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE)?;
    let all: Vec<f64> = results
        .iter()
        .flat_map(|r| r.results.iter().filter_map(|x| x.model_ttft_s.or(x.ttft_s)))
        .collect();
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min).max(1e-3);
    let hi = all.iter().copied().fold(0.0, f64::max).max(lo * 10.0);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((lo * 0.8..hi * 1.2).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("time to first token (s, simulated, engine model)")
        .y_desc("fraction of requests")
        .label_style(("sans-serif", 15))
        .draw()?;
    for (i, r) in results.iter().filter(|r| r.skipped.is_none()).enumerate() {
        let mut v: Vec<f64> = r
            .results
            .iter()
            .filter_map(|x| x.model_ttft_s.or(x.ttft_s))
            .collect();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                v.iter()
                    .enumerate()
                    .map(|(k, &t)| (t.max(lo), (k + 1) as f64 / n)),
                color.stroke_width(2),
            ))?
            .label(r.policy.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()?;
    root.present()?;
    Ok(())
}

/// Prefix hit rate (cached / prompt tokens) per window of trace time, per policy.
pub fn plot_hit_rate(
    results: &[PolicyResult],
    path: &Path,
    window_s: f64,
    title: &str,
) -> PlotResult {
    let root = BitMapBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE)?;
    let end = results
        .iter()
        .flat_map(|r| r.results.iter().map(|x| x.sent_at_s))
        .fold(0.0, f64::max)
        .max(window_s);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..end, 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("trace time (s)")
        .y_desc("prefix hit rate (cached / prompt tokens)")
        .label_style(("sans-serif", 15))
        .draw()?;
    let buckets = (end / window_s).ceil() as usize;
    for (i, r) in results.iter().filter(|r| r.skipped.is_none()).enumerate() {
        let mut prompt = vec![0usize; buckets + 1];
        let mut cached = vec![0usize; buckets + 1];
        for x in r.results.iter().filter(|x| x.ok()) {
            let b = (x.sent_at_s / window_s) as usize;
            prompt[b] += x.prompt_tokens;
            cached[b] += x.cached_tokens.unwrap_or(0);
        }
        let pts: Vec<(f64, f64)> = (0..=buckets)
            .filter(|&b| prompt[b] > 0)
            .map(|b| {
                (
                    (b as f64 + 0.5) * window_s,
                    cached[b] as f64 / prompt[b] as f64,
                )
            })
            .collect();
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
            .label(r.policy.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_no_wait_floor_is_each_requests_own_uncached_prefill() {
        let r = |prompt: usize, cached: usize| RequestResult {
            prompt_tokens: prompt,
            cached_tokens: Some(cached),
            status: 200,
            ..RequestResult::default()
        };
        let rs: Vec<RequestResult> = (1..=10).map(|i| r(i * 1000, 0)).collect();
        let [p50, p90] = no_wait_ttft(&rs, 1000.0, 0.5);
        assert_eq!((p50, p90), (5.5, 9.5));
        let hit = [r(4000, 3000), r(4000, 3000)];
        assert_eq!(no_wait_ttft(&hit, 1000.0, 0.0), [1.0, 1.0]);
    }

    #[test]
    fn spreads_and_hit_rate_come_from_engine_counters() {
        let l = EngineLoad {
            requests: vec![3, 1, 2],
            prompt_tokens: vec![100, 100, 200],
            cached_tokens: vec![50, 0, 100],
        };
        assert!((l.hit_rate() - 0.375).abs() < 1e-9);
        assert!((l.request_spread() - 1.5).abs() < 1e-9);
        assert!((l.prefill_spread() - 100.0 / (250.0 / 3.0)).abs() < 1e-9);
        assert_eq!(l.computed_tokens(), 250);
    }

    fn ran(policy: &str, cached: u64, ttft_p90: f64) -> PolicyResult {
        PolicyResult {
            skipped: None,
            summary: Some(Summary {
                model_ttft_p90_s: ttft_p90,
                ..Summary::default()
            }),
            engines: EngineLoad {
                requests: vec![1],
                prompt_tokens: vec![1000],
                cached_tokens: vec![cached],
            },
            ..PolicyResult::skipped(policy, String::new())
        }
    }

    #[test]
    fn text_targets_are_relative_to_the_token_id_path_and_to_sglang() {
        let all = vec![(
            "text".to_string(),
            vec![
                ran("kvroute-ids", 500, 1.0),
                ran("kvroute-text-chat", 491, 1.0), // 0.982× the ids' rate: met
                ran("kvroute-text-prompt", 489, 1.0), // 0.978×: missed
                ran("kvroute-text-approx", 300, 2.0),
                ran("sglang-router", 300, 2.0), // equal p90 is not better
            ],
        )];
        let t = targets(&all, Some([0.1, 1.5]));
        let met = |prefix: &str| {
            t.iter()
                .filter(|c| c.scenario == "text" && c.target.starts_with(prefix))
                .map(|c| c.met)
                .collect::<Vec<_>>()
        };
        assert_eq!(met("kvroute-text-chat"), [Some(true)]);
        assert_eq!(met("kvroute-text-prompt"), [Some(false)]);
        assert_eq!(met("kvroute-text-approx"), [Some(true), Some(false)]);
        // The fleet's floor is printed as given, beside the p90 bound it concerns.
        let floor = t.iter().find(|c| c.target.contains("one LRU")).unwrap();
        assert_eq!((floor.measured, floor.met), (1.5, None));
        // Scenarios that did not run are "not run", not failures.
        assert!(t
            .iter()
            .filter(|c| c.scenario == "trace")
            .all(|c| c.met.is_none()));
    }

    #[test]
    fn extra_columns_show_engine_requests_retries_and_filter_outcomes() {
        let req = |engine: &str, ok: bool, retried: bool| RequestResult {
            engine: Some(engine.into()),
            status: if ok { 200 } else { 0 },
            retried,
            ..RequestResult::default()
        };
        let mut r = ran("kvroute", 0, 1.0);
        r.engines.requests = vec![5, 3, 0];
        r.results = vec![
            req("engine-1", true, true),
            req("engine-0", true, true), // back on the engine that failed
            req("engine-2", false, true),
            req("engine-2", true, false),
        ];
        r.gateway_stats
            .insert("kvroute.requests.routed_cold".into(), 7);
        let cols = [
            Column::EngineRequests,
            Column::Retried("engine-0"),
            Column::Outcome("routed_cold"),
            Column::Outcome("no_match"),
        ];
        let t = table_with(
            &[r, PolicyResult::skipped("vllm-router", "down".into())],
            &cols,
        );
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].ends_with(
            "| failed | requests per engine | retried (then ok off engine-0) | filter: routed_cold | filter: no_match |"
        ));
        let cells = |l: &str| l.matches('|').count();
        assert_eq!(cells(lines[1]), cells(lines[0]));
        // Three retried: one ok on another engine (engine-1); one back on the engine that
        // failed, one failed again. No `no_match` counter: an empty cell.
        assert!(
            lines[2].ends_with("| 5 / 3 / 0 | 3 (1) | 7 |  |"),
            "{}",
            lines[2]
        );
        assert_eq!(
            cells(lines[3]),
            cells(lines[0]),
            "skipped rows keep the columns"
        );
        // Without extra columns the table is the common one.
        assert_eq!(table(&[]), table_with(&[], &[]));
        assert!(!table(&[]).contains("retried"));
    }

    #[test]
    fn repeated_runs_report_the_median_run_and_every_run() {
        let runs = vec![
            ran("kvroute", 500, 2.0),
            ran("kvroute", 400, 1.0),
            ran("kvroute", 300, 3.0),
        ];
        let m = median_run(runs).unwrap();
        assert_eq!(
            m.engines.cached_tokens,
            [500],
            "the run with the median p90"
        );
        assert_eq!(
            m.runs_ttft_s.iter().map(|r| r[1]).collect::<Vec<_>>(),
            [2.0, 1.0, 3.0],
            "every run, in run order"
        );
        // The hit rate compared is the mean over runs (50, 40 and 30 % here), not the median
        // run's 50 %.
        assert!((m.hit_rate() - 0.4).abs() < 1e-9, "{}", m.hit_rate());
        assert!(table(&[m]).contains(
            "| kvroute | 0 ms / 2000 ms, 0 ms / 1000 ms, 0 ms / 3000 ms | 50.0 %, 40.0 %, 30.0 % | 40.0 % |"
        ));
        // Two runs: the lower middle; a run that did not happen sorts last, and has no hit
        // rate to count.
        let two = vec![
            PolicyResult::skipped("x", "down".into()),
            ran("x", 100, 2.0),
            ran("x", 200, 1.0),
        ];
        let m = median_run(two).unwrap();
        assert_eq!(m.engines.cached_tokens, [200]);
        assert!((m.hit_rate() - 0.15).abs() < 1e-9, "{}", m.hit_rate());
        assert!(median_run(Vec::new()).is_none());
        // One run: no list of runs in the table.
        assert!(!table(&[median_run(vec![ran("y", 1, 1.0)]).unwrap()]).contains("Every run"));
    }
}
