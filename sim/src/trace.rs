//! Mooncake-format traces (`testdata/README.md`): one JSON object a line with
//! `timestamp` (ms), `input_length`, `output_length` and `hash_ids` (one per 512-token block).

use std::path::Path;

use serde::Deserialize;

use crate::tokenizer;

/// One request of a trace.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct TraceRecord {
    /// Arrival, milliseconds from the trace's start.
    pub timestamp: u64,
    /// Prompt tokens (authoritative; the last block may be partial).
    pub input_length: usize,
    /// Output tokens.
    pub output_length: usize,
    /// Block ids; equal ids are equal 512-token blocks.
    pub hash_ids: Vec<u64>,
}

impl TraceRecord {
    /// The prompt's token ids (see [`tokenizer::trace_prompt`]); `index` is the record's
    /// position in the trace, which seeds the filler of prompts longer than their blocks.
    pub fn prompt(&self, index: usize) -> Vec<u32> {
        tokenizer::trace_prompt(&self.hash_ids, self.input_length, index as u64)
    }

    /// The prompt as text for a real tokenizer: [`kvroute_text::synth::trace_text`] of the
    /// `hash_ids`, 512 Qwen3 tokens a block, so requests sharing leading `hash_ids` share
    /// exactly that text (and those tokens). Whole blocks: `input_length` is not applied, a
    /// cut would end mid-block where no request shares anything anyway.
    pub fn text(&self) -> String {
        kvroute_text::synth::trace_text(&self.hash_ids)
    }
}

/// A trace failed to load.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("line {line}: {source}")]
    Parse {
        line: usize,
        source: serde_json::Error,
    },
}

/// Parses a trace; blank lines are skipped.
///
/// # Errors
/// The first line that is not a trace record.
pub fn parse(text: &str) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(line).map_err(|source| TraceError::Parse {
                line: i + 1,
                source,
            })?,
        );
    }
    Ok(out)
}

/// Reads and parses a trace file.
///
/// # Errors
/// I/O or parse errors.
pub fn load(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mooncake_lines() {
        let t = parse("{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1, 2]}\n\n").unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].prompt(0).len(), 600);
        assert!(parse("{\"timestamp\": 5}").is_err());
    }

    #[test]
    fn texts_share_exactly_the_shared_blocks() {
        let rec = |ids: &[u64]| TraceRecord {
            timestamp: 0,
            input_length: 512 * ids.len(),
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        let (a, b) = (rec(&[1, 2, 3]).text(), rec(&[1, 2, 4]).text());
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        let two_blocks = rec(&[1, 2]).text().len();
        // Block 3 and block 4 may start with the same word; never with the same block.
        assert!(
            common >= two_blocks && common < a.len(),
            "{common} vs {two_blocks}"
        );
        assert_eq!(rec(&[1, 2, 3]).text(), a);
    }
}
