//! kvroute-text against the real Qwen3 tokenizer in testdata/ and the references recorded
//! from the model package's own implementation.

mod reference;
