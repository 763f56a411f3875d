//! kvroute-text against the real Qwen3 tokenizer in testdata/ and the references recorded
//! from the model package's own implementation (testdata/README.md).

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_text::Tokenizer;

mod fast_path;
mod hostile;
mod reference;
mod synth;

fn qwen3_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizer/qwen3")
}

/// Loaded once per test binary: the 11 MB file takes a moment to parse.
fn qwen3() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::from_dir(qwen3_dir()).expect("load the Qwen3 tokenizer"))
}
