//! Integration tests of kvroute-sim, one binary.

// Encoded batches against the real engines' vectors in shared/vectors.
mod vectors;
