//! The hashing contract against `testdata/vectors/hash_contract.json`, made by an independent
//! implementation and checked against Dynamo's own hashes.

use kvroute::hash::{self, BlockHash, SeqHash};
use serde_json::Value;

fn hashes(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().parse().unwrap())
        .collect()
}

#[test]
fn every_contract_vector_passes() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/testdata/vectors/hash_contract.json"
    );
    let text = std::fs::read_to_string(path).expect("testdata/vectors/hash_contract.json in the repository");
    let doc: Value = serde_json::from_str(&text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let block_size = case["block_size"].as_u64().unwrap() as usize;
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let seed = hash::seed(case["lora_name"].as_str(), case["cache_salt"].as_str());
        assert_eq!(seed, case["seed"].as_u64().unwrap(), "{name}: seed");
        let blocks = hash::block_hashes(&tokens, block_size, seed).unwrap();
        let want: Vec<BlockHash> = hashes(&case["block_hashes"])
            .into_iter()
            .map(BlockHash)
            .collect();
        assert_eq!(blocks, want, "{name}: block hashes");
        let seqs = hash::sequence_hashes(&tokens, block_size, seed).unwrap();
        let want: Vec<SeqHash> = hashes(&case["sequence_hashes"])
            .into_iter()
            .map(SeqHash)
            .collect();
        assert_eq!(seqs, want, "{name}: sequence hashes");
    }
}
