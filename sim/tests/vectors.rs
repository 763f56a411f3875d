//! The encoder against the payloads the real publishers produced (testdata/vectors, made by
//! running vLLM 0.33.0 / 0.23.0 and SGLang 0.5.23 with msgspec): byte for byte.

use kvroute::event::EngineHash;
use kvroute_sim::wire::{encode_batch, EventFormat, Extras, WireEvent};

const H1: u64 = 13_366_815_110_101_616_827;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>, bs: usize) -> WireEvent {
    WireEvent::stored(
        hashes.iter().map(|&h| EngineHash(h)).collect(),
        parent.map(EngineHash),
        tokens,
        bs,
    )
}

const PLAIN: Extras = Extras {
    vllm_group_fields: false,
};
const GROUP: Extras = Extras {
    vllm_group_fields: true,
};

#[test]
fn vllm_033_block_stored_matches_the_real_bytes() {
    let b = encode_batch(
        EventFormat::Vllm033,
        PLAIN,
        1.5,
        &[stored(&[H1, 7], None, (1..=8).collect(), 4)],
        Some(0),
    );
    assert_eq!(hex(&b), "93cb3ff800000000000091de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfb9807785afee48bb07b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c000");
}

#[test]
fn vllm_033_block_stored_with_group_fields_matches_the_real_bytes() {
    let b = encode_batch(
        EventFormat::Vllm033,
        GROUP,
        2.0,
        &[stored(
            &[14_660_323_646_696_587_421],
            Some(H1),
            vec![9, 10, 11, 12],
            4,
        )],
        None,
    );
    assert_eq!(hex(&b), "93cb400000000000000091de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfcb73eeaed59c009db1706172656e745f626c6f636b5f68617368cfb9807785afee48bba9746f6b656e5f69647394090a0b0caa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6ec0");
}

#[test]
fn vllm_033_removed_and_cleared_match_the_real_bytes() {
    let ev = [
        WireEvent::removed(vec![EngineHash(H1), EngineHash(7)]),
        WireEvent::AllBlocksCleared,
    ];
    let b = encode_batch(EventFormat::Vllm033, PLAIN, 4.0, &ev, Some(0));
    assert_eq!(hex(&b), "93cb40100000000000009283a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392cfb9807785afee48bb07a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400");
}

#[test]
fn vllm_033_live_publisher_frame_matches() {
    // The live ZmqEventPublisher capture: BlockRemoved([0], "GPU") at ts 10.0, dp 0.
    let b = encode_batch(
        EventFormat::Vllm033,
        PLAIN,
        10.0,
        &[WireEvent::removed(vec![EngineHash(0)])],
        Some(0),
    );
    assert_eq!(hex(&b), "93cb40240000000000009183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739100a66d656469756da347505500");
}

#[test]
fn vllm_023_array_events_match_the_real_bytes() {
    let b = encode_batch(
        EventFormat::Vllm023,
        PLAIN,
        1.5,
        &[stored(&[H1, 7], None, (1..=8).collect(), 4)],
        Some(0),
    );
    assert_eq!(hex(&b), "93cb3ff8000000000000919cab426c6f636b53746f72656492cfb9807785afee48bb07c098010203040506070804c0a3475055c0c0c0c0c000");
    let b = encode_batch(
        EventFormat::Vllm023,
        GROUP,
        2.0,
        &[stored(
            &[14_660_323_646_696_587_421],
            Some(H1),
            vec![9, 10, 11, 12],
            4,
        )],
        None,
    );
    assert_eq!(hex(&b), "93cb4000000000000000919cab426c6f636b53746f72656491cfcb73eeaed59c009dcfb9807785afee48bb94090a0b0c04c0a3475055c091c000ae66756c6c5f617474656e74696f6ec0c0");
    let ev = [
        WireEvent::removed(vec![EngineHash(H1), EngineHash(7)]),
        WireEvent::AllBlocksCleared,
    ];
    let b = encode_batch(EventFormat::Vllm023, PLAIN, 4.0, &ev, Some(0));
    assert_eq!(hex(&b), "93cb40100000000000009294ac426c6f636b52656d6f76656492cfb9807785afee48bb07a3475055c091b0416c6c426c6f636b73436c656172656400");
}

#[test]
fn sglang_map_events_match_the_real_bytes() {
    let h = [
        (-3_488_128_144_981_237_669i64) as u64,
        5_674_439_469_042_975_057,
    ];
    let ev = [
        stored(&h, None, (1..=8).collect(), 4),
        WireEvent::removed(vec![EngineHash(h[0])]),
        WireEvent::AllBlocksCleared,
    ];
    let b = encode_batch(
        EventFormat::Sglang,
        Extras::engine(EventFormat::Sglang),
        1.5,
        &ev,
        Some(0),
    );
    assert_eq!(hex(&b), "93cb3ff80000000000009387a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d3cf97adeedb59e05bcf4ebfa8a1f3c34151b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347505583a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391d3cf97adeedb59e05ba66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400");
}

#[test]
fn the_engines_own_hashes_reproduce_the_sglang_vector() {
    let h = kvroute_sim::engine_hash::HashScheme::Sglang.hashes(&(1..=8).collect::<Vec<u32>>(), 4);
    let b = encode_batch(
        EventFormat::Sglang,
        Extras::engine(EventFormat::Sglang),
        1.5,
        &[stored(&[h[0].0, h[1].0], None, (1..=8).collect(), 4)],
        Some(0),
    );
    assert!(hex(&b).contains("92d3cf97adeedb59e05bcf4ebfa8a1f3c34151"));
}
