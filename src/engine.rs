//! What an engine says of its own load, in the one unit every part uses from the collector's
//! scrape to the filter's saturation rule: whole requests and KV usage per mille. The engines'
//! gauges are floats; they are converted once, where they are read, so the feed, the gateway's
//! shared data and the decision compare the same integers.

/// What an engine reports about itself, in the one unit every part uses from the scrape to
/// the decision: whole requests and KV usage per mille. The engines' gauges are floats; they
/// are converted once, where they are read ([`EngineLoad::from_gauges`]), so the feed, the
/// gateway's shared data and the saturation rule all compare the same integers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct EngineLoad {
    /// Requests waiting in the engine's queue.
    pub waiting: u32,
    /// Requests in the engine's running batch.
    pub running: u32,
    /// Share of the engine's KV cache in use, per mille (0..=1000).
    pub kv_permille: u16,
}

impl EngineLoad {
    /// From an engine's metric gauges: request counts rounded (and capped at `u32::MAX`), KV
    /// usage as a fraction clamped to 0..=1. NaN reads as 0.
    pub fn from_gauges(waiting: f64, running: f64, kv_usage: f64) -> EngineLoad {
        let count = |v: f64| {
            if v.is_nan() {
                0
            } else {
                v.round().clamp(0.0, f64::from(u32::MAX)) as u32
            }
        };
        let kv = if kv_usage.is_nan() {
            0.0
        } else {
            kv_usage.clamp(0.0, 1.0)
        };
        EngineLoad {
            waiting: count(waiting),
            running: count(running),
            kv_permille: (kv * 1000.0).round() as u16,
        }
    }

    /// KV usage as a fraction, for display.
    pub fn kv_usage(&self) -> f64 {
        f64::from(self.kv_permille.min(1000)) / 1000.0
    }

    /// Whether the engine has nothing running and nothing waiting.
    pub fn idle(&self) -> bool {
        self.running == 0 && self.waiting == 0
    }

    /// The busier of two reports, field by field (dp ranks of one instance: the busiest speaks).
    pub fn busiest(self, o: EngineLoad) -> EngineLoad {
        EngineLoad {
            waiting: self.waiting.max(o.waiting),
            running: self.running.max(o.running),
            kv_permille: self.kv_permille.max(o.kv_permille),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_convert_once_with_clamps() {
        assert_eq!(
            EngineLoad::from_gauges(2.4, 2.6, 0.9876),
            EngineLoad {
                waiting: 2,
                running: 3,
                kv_permille: 988
            }
        );
        let wild = EngineLoad::from_gauges(f64::NAN, 1e300, 7.0);
        assert_eq!(
            (wild.waiting, wild.running, wild.kv_permille),
            (0, u32::MAX, 1000)
        );
        assert_eq!(
            EngineLoad::from_gauges(-3.0, 0.0, -0.5),
            EngineLoad::default()
        );
        assert_eq!(EngineLoad::from_gauges(0.0, 0.0, 0.25).kv_usage(), 0.25);
    }
}
