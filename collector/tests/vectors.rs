//! Every vector of `testdata/vectors/kv_events_{vllm,sglang}.txt` decodes to the normalized
//! events its `decoded:` line (the Python repr the real publisher encoded) describes.
//!
//! The expected events are derived here from the Python value by a second, deliberately naive
//! normalizer, so the test checks the decoder against the files, not against itself.

use kvroute::event::{EngineHash, KvEvent, StoredBlock, Tier};
use kvroute_collector::decode::decode;

fn vectors_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/vectors")
        .join(name)
}

/// A Python literal: what `repr()` printed in the vector files.
#[derive(Clone, Debug, PartialEq)]
enum Py {
    None,
    Int(i128),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Py>),
    Dict(Vec<(Py, Py)>),
}

struct P<'a> {
    s: &'a [u8],
    i: usize,
}

impl P<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && (self.s[self.i] == b' ' || self.s[self.i] == b',') {
            self.i += 1;
        }
    }

    fn value(&mut self) -> Py {
        self.ws();
        let c = self.s[self.i];
        match c {
            b'[' | b'(' => {
                let close = if c == b'[' { b']' } else { b')' };
                self.i += 1;
                let mut items = Vec::new();
                loop {
                    self.ws();
                    if self.s[self.i] == close {
                        self.i += 1;
                        return Py::List(items);
                    }
                    items.push(self.value());
                }
            }
            b'{' => {
                self.i += 1;
                let mut items = Vec::new();
                loop {
                    self.ws();
                    if self.s[self.i] == b'}' {
                        self.i += 1;
                        return Py::Dict(items);
                    }
                    let k = self.value();
                    self.ws();
                    assert_eq!(self.s[self.i], b':');
                    self.i += 1;
                    let v = self.value();
                    items.push((k, v));
                }
            }
            b'\'' | b'"' => Py::Str(String::from_utf8(self.quoted()).unwrap()),
            b'b' => {
                self.i += 1;
                Py::Bytes(self.quoted())
            }
            b'N' => {
                assert_eq!(&self.s[self.i..self.i + 4], b"None");
                self.i += 4;
                Py::None
            }
            _ => {
                let start = self.i;
                while self.i < self.s.len() && b"-+0123456789.e".contains(&self.s[self.i]) {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).unwrap();
                if t.contains('.') {
                    Py::Float(t.parse().unwrap())
                } else {
                    Py::Int(t.parse().unwrap())
                }
            }
        }
    }

    fn quoted(&mut self) -> Vec<u8> {
        let q = self.s[self.i];
        self.i += 1;
        let mut out = Vec::new();
        while self.s[self.i] != q {
            if self.s[self.i] == b'\\' {
                self.i += 1;
                match self.s[self.i] {
                    b'x' => {
                        let h = std::str::from_utf8(&self.s[self.i + 1..self.i + 3]).unwrap();
                        out.push(u8::from_str_radix(h, 16).unwrap());
                        self.i += 2;
                    }
                    b'n' => out.push(b'\n'),
                    b't' => out.push(b'\t'),
                    b'r' => out.push(b'\r'),
                    other => out.push(other),
                }
            } else {
                out.push(self.s[self.i]);
            }
            self.i += 1;
        }
        self.i += 1;
        out
    }
}

fn parse_py(s: &str) -> Py {
    P {
        s: s.as_bytes(),
        i: 0,
    }
    .value()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn hash_of(v: &Py) -> EngineHash {
    match v {
        Py::Int(i) => EngineHash(*i as i64 as u64),
        Py::Bytes(b) => EngineHash(u64::from_be_bytes(b[b.len() - 8..].try_into().unwrap())),
        other => panic!("not a hash: {other:?}"),
    }
}

fn list(v: &Py) -> &[Py] {
    match v {
        Py::List(l) => l,
        other => panic!("not a list: {other:?}"),
    }
}

fn opt_str(v: Option<&Py>) -> Option<String> {
    match v {
        Some(Py::Str(s)) => Some(s.clone()),
        _ => None,
    }
}

/// The naive normalizer: Python event → expected [`KvEvent`].
fn expected(ev: &Py) -> KvEvent {
    // Bring both shapes to one name → value table.
    let fields: Vec<(String, Py)> = match ev {
        Py::Dict(kv) => kv
            .iter()
            .map(|(k, v)| match k {
                Py::Str(k) => (
                    if k == "type" {
                        "tag".to_owned()
                    } else {
                        k.clone()
                    },
                    v.clone(),
                ),
                _ => panic!(),
            })
            .collect(),
        Py::List(items) => {
            let names: &[&str] = match &items[0] {
                Py::Str(t) if t == "BlockStored" => &[
                    "tag",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                    "lora_name",
                    "extra_keys",
                    "group_idx",
                    "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window",
                ],
                _ => &["tag", "block_hashes", "medium", "group_idx"],
            };
            names
                .iter()
                .zip(items)
                .map(|(n, v)| (n.to_string(), v.clone()))
                .collect()
        }
        other => panic!("not an event: {other:?}"),
    };
    let get = |name: &str| fields.iter().find(|(n, _)| n == name).map(|(_, v)| v);
    let tier = match opt_str(get("medium")).as_deref() {
        None | Some("GPU") => Tier::Gpu,
        Some("CPU") | Some("CPU_PINNED") => Tier::Cpu,
        _ => Tier::Disk,
    };
    match opt_str(get("tag")).as_deref() {
        Some("BlockStored") => {
            let bs = match get("block_size") {
                Some(Py::Int(n)) => *n as usize,
                _ => panic!(),
            };
            let tokens: Vec<u32> = list(get("token_ids").unwrap())
                .iter()
                .map(|t| match t {
                    Py::Int(i) => *i as u32,
                    _ => panic!(),
                })
                .collect();
            let blocks = list(get("block_hashes").unwrap())
                .iter()
                .enumerate()
                .map(|(i, h)| StoredBlock {
                    hash: hash_of(h),
                    tokens: tokens[i * bs..((i + 1) * bs).min(tokens.len())].to_vec(),
                    block_hash: None,
                })
                .collect();
            let parent = match get("parent_block_hash") {
                None | Some(Py::None) => None,
                Some(h) => Some(hash_of(h)),
            };
            KvEvent::BlockStored {
                parent,
                blocks,
                tier,
                lora_name: opt_str(get("lora_name")),
                cache_salt: None,
            }
        }
        Some("BlockRemoved") => KvEvent::BlockRemoved {
            hashes: list(get("block_hashes").unwrap())
                .iter()
                .map(hash_of)
                .collect(),
            tier,
        },
        Some("AllBlocksCleared") => KvEvent::AllBlocksCleared,
        other => panic!("unknown tag {other:?}"),
    }
}

/// Walks a vector file: `hex:` lines followed by `decoded:` lines, and Python lists of hex
/// frames (live PUB frames `[topic, seq, payload]`, DEALER replies `["", topic, seq, payload]`).
fn check_file(name: &str) -> usize {
    let text = std::fs::read_to_string(vectors_path(name)).expect("vector file");
    let lines: Vec<&str> = text.lines().collect();
    let mut checked = 0;
    for (i, line) in lines.iter().enumerate() {
        if let Some(hex) = line.strip_prefix("hex: ") {
            let decoded = lines[i + 1]
                .strip_prefix("decoded: ")
                .expect("decoded line after hex line");
            let py = parse_py(decoded);
            let items = list(&py);
            let got =
                decode(&unhex(hex.trim())).unwrap_or_else(|e| panic!("{name} line {}: {e}", i + 1));
            let want: Vec<KvEvent> = list(&items[1]).iter().map(expected).collect();
            assert_eq!(got.events, want, "{name} line {}", i + 1);
            assert_eq!(
                got.ts,
                match items[0] {
                    Py::Float(f) => f,
                    _ => panic!(),
                }
            );
            let want_dp = match items.get(2) {
                Some(Py::Int(d)) => Some(*d as u32),
                _ => None,
            };
            assert_eq!(got.dp_rank, want_dp, "{name} line {}", i + 1);
            checked += 1;
        } else if line.starts_with("['") {
            let end = line.rfind(']').unwrap() + 1;
            let frames: Vec<Vec<u8>> = list(&parse_py(&line[..end]))
                .iter()
                .map(|f| match f {
                    Py::Str(s) => unhex(s),
                    _ => panic!(),
                })
                .collect();
            // PUB: [topic, seq, payload]; DEALER: ["", topic, seq, payload]; end marker
            // ["", "", ff×8, ""]. The seq frame is the one before the payload.
            let (seq, payload) = (&frames[frames.len() - 2], &frames[frames.len() - 1]);
            assert_eq!(seq.len(), 8);
            if payload.is_empty() {
                assert_eq!(seq, &vec![0xff; 8], "end marker");
                continue;
            }
            let seq = u64::from_be_bytes(seq[..].try_into().unwrap());
            let got = decode(payload).unwrap();
            // The live capture publishes BlockRemoved([seq]) as batch number `seq`.
            assert_eq!(
                got.events,
                vec![KvEvent::BlockRemoved {
                    hashes: vec![EngineHash(seq)],
                    tier: Tier::Gpu
                }]
            );
            checked += 1;
        }
    }
    checked
}

#[test]
fn every_vllm_vector_decodes_to_its_normalized_events() {
    assert!(check_file("kv_events_vllm.txt") >= 14);
}

#[test]
fn every_sglang_vector_decodes_to_its_normalized_events() {
    assert_eq!(check_file("kv_events_sglang.txt"), 2);
}
