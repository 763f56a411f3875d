//! Token intake: token ids from headers, metadata strings and JSON bodies (owned by the filter work).
