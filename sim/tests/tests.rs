//! Integration tests of kvroute-sim, one binary.

// Encoded batches against the real engines' vectors in testdata/vectors.
mod vectors;
// The HTTP API of a simulated engine.
mod http;
// The stepped engine model through the same API: headers, metrics, KV events, preemption.
mod stepped;
// Trace replay against engines, by URL and through an in-process router.
mod replay;
// The publisher: lost batches, resumed and restarted numbering, both replay shapes.
mod publisher;
// Text with the real Qwen3 tokenizer: chat completions, prompts, /tokenize.
mod text;
