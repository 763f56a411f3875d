//! Why a request was (not) routed: the filter's per-request result and its counter names.

/// Why a request was (not) routed. Each has a counter `kvroute.requests.<name>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Routed on a cache hit.
    Routed,
    /// Routed to an instance holding none of its blocks: a cold request (no hit anywhere) or
    /// a hit elsewhere outweighed by load.
    RoutedCold,
    /// A cold request left to the gateway's balancing (`route.cold: defer`).
    Deferred,
    NoTokens,
    NoModel,
    NoMatch,
    StaleIndex,
    CollectorError,
    BadBody,
    TooLarge,
    BadHeader,
    /// A text request whose text cannot be read (bad UTF-8, content that is not text, too
    /// many messages).
    BadText,
}

impl Outcome {
    pub const ALL: [Outcome; 12] = [
        Outcome::Routed,
        Outcome::RoutedCold,
        Outcome::Deferred,
        Outcome::NoTokens,
        Outcome::NoModel,
        Outcome::NoMatch,
        Outcome::StaleIndex,
        Outcome::CollectorError,
        Outcome::BadBody,
        Outcome::TooLarge,
        Outcome::BadHeader,
        Outcome::BadText,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Routed => "routed",
            Outcome::RoutedCold => "routed_cold",
            Outcome::Deferred => "deferred",
            Outcome::NoTokens => "no_tokens",
            Outcome::NoModel => "no_model",
            Outcome::NoMatch => "no_match",
            Outcome::StaleIndex => "stale_index",
            Outcome::CollectorError => "collector_error",
            Outcome::BadBody => "bad_body",
            Outcome::TooLarge => "too_large",
            Outcome::BadHeader => "bad_header",
            Outcome::BadText => "bad_text",
        }
    }
}
