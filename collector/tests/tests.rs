//! The collector's integration tests, one binary.

// Every shared vector decodes to its normalized events.
mod vectors;
