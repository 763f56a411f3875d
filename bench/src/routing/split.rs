//! The `uneven` scenario's client side: requests split between gateway replicas by fixed
//! weights (80/20, 95/5) instead of alternating, so one replica decides most requests while
//! the other's bookings reach it only through the fleet-wide load.

use std::sync::Arc;

use kvroute_sim::replay::{BoxFuture, Decision, Route, RouteRequest};

/// The split policies of the `uneven` scenario and their gateway weights, in percent.
pub const SPLITS: [(&str, [u32; 2]); 2] = [
    ("kvroute-2gw-80-20", [80, 20]),
    ("kvroute-2gw-95-5", [95, 5]),
];

/// The weights of a split policy, or `None` for any other policy.
pub fn weights(policy: &str) -> Option<&'static [u32]> {
    SPLITS
        .iter()
        .find(|(p, _)| *p == policy)
        .map(|(_, w)| &w[..])
}

/// One period of the smooth weighted round-robin over `weights` (as nginx spreads upstreams):
/// `sum(weights)` gateway indexes, gateway `g` exactly `weights[g]` times, interleaved rather
/// than in runs, so every stretch of the trace is split close to the weights.
pub fn pattern(weights: &[u32]) -> Vec<usize> {
    let total: i64 = weights.iter().map(|&w| i64::from(w)).sum();
    let mut current = vec![0i64; weights.len()];
    let mut out = Vec::with_capacity(total.max(0) as usize);
    for _ in 0..total {
        for (c, &w) in current.iter_mut().zip(weights) {
            *c += i64::from(w);
        }
        let Some(best) = (0..current.len()).max_by_key(|&g| (current[g], std::cmp::Reverse(g)))
        else {
            break;
        };
        current[best] -= total;
        out.push(best);
    }
    out
}

/// Sends trace request `i` to gateway `pattern[i % len]`: the assignment depends on the
/// request's index only, never on the order concurrent requests reach the router.
#[derive(Debug)]
pub struct Split {
    urls: Vec<String>,
    pattern: Arc<[usize]>,
}

impl Split {
    /// `urls[g]` gets `weights[g]` of every `sum(weights)` requests.
    pub fn new(urls: Vec<String>, weights: &[u32]) -> Split {
        let mut p = pattern(weights);
        if p.is_empty() {
            p.push(0);
        }
        Split {
            urls,
            pattern: p.into(),
        }
    }

    /// The gateway of trace request `index`.
    pub fn gateway(&self, index: usize) -> usize {
        self.pattern[index % self.pattern.len()]
    }
}

impl Route for Split {
    fn route<'a>(&'a self, req: RouteRequest<'a>) -> BoxFuture<'a, Decision> {
        let g = self.gateway(req.index);
        let d = Decision {
            url: self.urls.get(g).cloned().unwrap_or_default(),
            slot: g,
            ..Decision::default()
        };
        Box::pin(async move { d })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(s: &Split, n: usize) -> [usize; 2] {
        let mut c = [0; 2];
        for i in 0..n {
            c[s.gateway(i)] += 1;
        }
        c
    }

    #[test]
    fn the_split_gives_each_gateway_its_share_within_one_request() {
        let s = Split::new(vec!["a".into(), "b".into()], &[80, 20]);
        for n in [1, 7, 30, 99, 100, 200, 1234] {
            let [a, b] = counts(&s, n);
            let want = n as f64 * 0.2;
            assert!((b as f64 - want).abs() <= 1.0, "n={n}: {a}/{b}");
            assert_eq!(a + b, n);
        }
        assert_eq!(counts(&s, 2000), [1600, 400]);
        let s = Split::new(vec!["a".into(), "b".into()], &[95, 5]);
        assert_eq!(counts(&s, 2000), [1900, 100]);
        let [_, b] = counts(&s, 30);
        assert!((1..=2).contains(&b), "{b}");
    }

    #[test]
    fn the_minor_gateway_gets_requests_spread_through_the_trace() {
        let p = pattern(&[80, 20]);
        assert_eq!(p.len(), 100);
        let minor: Vec<usize> = (0..100).filter(|&i| p[i] == 1).collect();
        assert_eq!(minor.len(), 20);
        // Every fifth request, never two in a row.
        assert!(minor.windows(2).all(|w| w[1] - w[0] == 5), "{minor:?}");
    }

    #[tokio::test]
    async fn requests_go_to_their_gateways_url() {
        let s = Split::new(vec!["http://g0".into(), "http://g1".into()], &[3, 1]);
        let mut urls = Vec::new();
        for index in 0..4 {
            urls.push(s.route(RouteRequest { index, tokens: &[] }).await.url);
        }
        assert_eq!(urls.iter().filter(|u| *u == "http://g1").count(), 1);
        assert_eq!(weights("kvroute-2gw-95-5"), Some(&[95u32, 5][..]));
        assert_eq!(weights("kvroute-2gw"), None);
    }
}
