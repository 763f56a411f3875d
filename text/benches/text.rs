//! kvroute-text alone on the Qwen3 tokenizer: an 8,192-token prompt (the Mooncake replay's
//! text, `synth::trace_text` of 16 blocks) encoded as a completions prompt and as one chat
//! message, a prompt never seen before (fast split and library side by side), and a 20-turn
//! chat rendered by the template without encoding.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvroute_text::{synth, Message, Tokenizer};

fn benches(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizer/qwen3");
    let tokenizer = Tokenizer::from_dir(dir).unwrap();
    let text = synth::trace_text(&(1000..1016).collect::<Vec<u64>>());
    let chat = [Message::new("user", text.clone())];
    let turns: Vec<Message> = (0..20)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            Message::new(role, synth::block_text(i))
        })
        .collect();
    let mut g = c.benchmark_group("qwen3");
    g.measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Elements(8192));
    g.bench_function("encode_8k_prompt", |b| {
        b.iter(|| tokenizer.encode(black_box(&text)).unwrap().len())
    });
    // A prompt never seen before: no piece of it is in the segment cache (its words may be in
    // the fast split's word cache, as the words of any language repeat).
    let mut next = 1_000_000u64;
    g.bench_function("encode_new_8k_prompt", |b| {
        b.iter_batched(
            || {
                next += 16;
                synth::trace_text(&(next..next + 16).collect::<Vec<u64>>())
            },
            |text| tokenizer.encode(black_box(&text)).unwrap().len(),
            criterion::BatchSize::SmallInput,
        )
    });
    g.bench_function("encode_new_8k_prompt_uncached_library", |b| {
        b.iter_batched(
            || {
                next += 16;
                synth::trace_text(&(next..next + 16).collect::<Vec<u64>>())
            },
            |text| {
                tokenizer
                    .encode_uncached(black_box(&text), true)
                    .unwrap()
                    .len()
            },
            criterion::BatchSize::SmallInput,
        )
    });
    g.bench_function("encode_chat_8k", |b| {
        b.iter(|| tokenizer.encode_chat(black_box(&chat), true).unwrap().len())
    });
    g.throughput(Throughput::Elements(20));
    g.bench_function("render_chat_20_turns", |b| {
        b.iter(|| {
            tokenizer
                .render_chat(black_box(&turns), true)
                .unwrap()
                .len()
        })
    });
    g.finish();
}

criterion_group!(text, benches);
criterion_main!(text);
