//! The `text` scenario: the trace's requests as text, on a fleet whose engines
//! tokenize with a real model tokenizer (Qwen3 by default), the collector holding the same one.
//!
//! Every request's text is [`TraceRecord::text`] (whole 512-token blocks per `hash_id`, so
//! shared `hash_ids` are shared text and shared tokens), made once before the first policy and
//! sent byte for byte the same by each. The policies differ in how the text travels and who
//! turns it into a routing decision:
//!
//! | policy | body | decided by |
//! |---|---|---|
//! | `round-robin` | chat `messages` | in-process round-robin (the baseline) |
//! | `kvroute-ids` | `prompt` = the chat's token ids, tokenized here as the engine does | Envoy + filter, local lookup (the token-id reference) |
//! | `kvroute-text-chat` | chat `messages` | Envoy + filter, exact: the collector tokenizes |
//! | `kvroute-text-prompt` | `prompt` string | the same, completions |
//! | `kvroute-text-approx` | chat `messages` | Envoy + filter with `text.exact` off: its character-block table |
//! | `sglang-router` | chat `messages` | sglang-router `cache_aware` (its own character tree) |

use std::sync::Arc;

use kvroute_sim::replay::{Api, Prompts};
use kvroute_sim::tokenizer::TextTokenizer;
use kvroute_sim::trace::TraceRecord;
use serde_json::{json, Map, Value};

/// The model the text scenario's engines serve; the collector's `--tokenizer` names it.
pub const TEXT_MODEL: &str = "qwen3";

/// How one policy of the text scenario sends its requests.
#[derive(Clone, Debug, PartialEq)]
pub struct TextPolicy {
    /// The request shape.
    pub api: Api,
    /// Whether it goes through the real Envoy and filter (else an in-process router or peer).
    pub gateway: bool,
    /// Filter keys merged into the gateway's configuration.
    pub filter_keys: Map<String, Value>,
}

/// The text scenario's way of running `name`, or `None` for a policy it does not have.
pub fn policy(name: &str) -> Option<TextPolicy> {
    let (api, gateway, keys) = match name {
        "round-robin" | "sglang-router" => (Api::ChatText, false, json!({})),
        "kvroute-ids" => (Api::CompletionsIds, true, json!({})),
        "kvroute-text-chat" => (Api::ChatText, true, json!({})),
        "kvroute-text-prompt" => (Api::CompletionsPrompt, true, json!({})),
        // The collector has the tokenizer: turning the exact path off is what leaves the
        // filter to its own table, as a model without a tokenizer would.
        "kvroute-text-approx" => (Api::ChatText, true, json!({"text": {"exact": false}})),
        _ => return None,
    };
    let Value::Object(filter_keys) = keys else {
        unreachable!("object literals")
    };
    Some(TextPolicy {
        api,
        gateway,
        filter_keys,
    })
}

/// The chat body's `messages` for a request text: one user turn.
pub fn messages(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Why the prompts could not be made.
#[derive(Debug, thiserror::Error)]
#[error("request {index}: tokenizing its chat: {source}")]
pub struct PromptError {
    pub index: usize,
    source: kvroute_text::TextError,
}

/// Every record's text and the token ids of its chat (rendered by the model's template with the
/// generation prompt, as the engine renders `/v1/chat/completions`), made before any replay so
/// no policy pays for tokenizing in its timed sends. Runs on `threads` threads.
///
/// # Errors
/// A chat the tokenizer refuses (over its limits).
pub fn prepare(
    records: &[TraceRecord],
    tokenizer: &TextTokenizer,
    threads: usize,
) -> Result<Prompts, PromptError> {
    let texts: Vec<Arc<str>> = records.iter().map(|r| Arc::from(r.text())).collect();
    let chunk = texts.len().div_ceil(threads.max(1)).max(1);
    let ids = std::thread::scope(|s| {
        let handles: Vec<_> = texts
            .chunks(chunk)
            .enumerate()
            .map(|(c, part)| {
                s.spawn(move || {
                    part.iter()
                        .enumerate()
                        .map(|(i, t)| {
                            tokenizer
                                .encode_chat(&messages(t), true)
                                .map(Arc::from)
                                .map_err(|source| PromptError {
                                    index: c * chunk + i,
                                    source,
                                })
                        })
                        .collect::<Result<Vec<Arc<[u32]>>, _>>()
                })
            })
            .collect();
        let mut all = Vec::with_capacity(texts.len());
        for h in handles {
            all.extend(h.join().expect("tokenizing thread panicked")?);
        }
        Ok::<_, PromptError>(all)
    })?;
    Ok(Prompts { texts, ids })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_differ_only_in_body_and_filter_keys() {
        let approx = policy("kvroute-text-approx").unwrap();
        assert!(approx.gateway);
        assert_eq!(approx.api, Api::ChatText);
        assert_eq!(
            Value::Object(approx.filter_keys),
            json!({"text": {"exact": false}})
        );
        let exact = policy("kvroute-text-chat").unwrap();
        assert!(exact.gateway && exact.filter_keys.is_empty());
        assert_eq!(policy("kvroute-ids").unwrap().api, Api::CompletionsIds);
        assert_eq!(
            policy("kvroute-text-prompt").unwrap().api,
            Api::CompletionsPrompt
        );
        assert!(!policy("sglang-router").unwrap().gateway);
        assert!(policy("oracle").is_none());
    }

    #[test]
    fn every_text_scenario_policy_has_a_way_to_run() {
        let (_, names) = super::super::args::SCENARIOS
            .iter()
            .find(|(s, _)| *s == "text")
            .unwrap();
        for n in *names {
            assert!(policy(n).is_some(), "{n}");
        }
    }

    fn qwen3() -> TextTokenizer {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizer/qwen3");
        TextTokenizer::from_dir(&dir).expect("the repository's Qwen3 tokenizer")
    }

    #[test]
    fn prepared_chats_share_exactly_the_shared_blocks() {
        let rec = |ids: &[u64]| TraceRecord {
            timestamp: 0,
            input_length: 512 * ids.len(),
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        let records = [rec(&[1, 2, 3]), rec(&[1, 2, 4]), rec(&[9])];
        let tok = qwen3();
        let p = prepare(&records, &tok, 2).unwrap();
        assert_eq!((p.texts.len(), p.ids.len()), (3, 3));
        assert_eq!(&*p.texts[0], records[0].text());
        // The chat is the prompt's 512 tokens a block inside the template's few tokens.
        let plain = tok.encode(&p.texts[0]).unwrap();
        assert_eq!(plain.len(), 3 * 512);
        let overhead = p.ids[0].len() - plain.len();
        assert!((1..32).contains(&overhead), "{overhead}");
        assert!(p.ids[0].windows(plain.len()).any(|w| w == &plain[..]));
        // Two shared blocks: at least their tokens agree, and not the third block's.
        let common = p.ids[0]
            .iter()
            .zip(p.ids[1].iter())
            .take_while(|(a, b)| a == b)
            .count();
        assert!((2 * 512..3 * 512).contains(&common), "{common}");
        assert_eq!(p.ids[0].len(), p.ids[1].len());
        // Made on one thread or two, the same prompts.
        let one = prepare(&records, &tok, 1).unwrap();
        assert_eq!(one.ids, p.ids);
    }
}
