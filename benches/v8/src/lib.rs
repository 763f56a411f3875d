//! Exports for `bench.mjs`: a buffer for the body, `scan_json` over it and the sequence
//! hashes of the tokens it read, each repeated `iters` times (so one call from JavaScript
//! times many runs).

use std::cell::RefCell;

use kvroute::hash::{sequence_hashes_into, SeqHash, BASE_SEED};
use kvroute::intake::{scan_json, scan_json_bytewise, FieldKind, Found};

thread_local! {
    static TOKENS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    static SEQS: RefCell<Vec<SeqHash>> = const { RefCell::new(Vec::new()) };
}

const FIELDS: [(&str, FieldKind); 4] = [
    ("prompt", FieldKind::TokensOrText),
    ("model", FieldKind::Str),
    ("max_tokens", FieldKind::Uint),
    ("messages", FieldKind::Raw),
];

/// A zeroed buffer of `n` bytes that lives as long as the instance.
#[no_mangle]
pub extern "C" fn buffer(n: usize) -> *mut u8 {
    vec![0u8; n].leak().as_mut_ptr()
}

/// Scans the body at `ptr` `iters` times (`bytewise`: the byte path alone); returns the
/// tokens read over all runs (0 on an error).
///
/// # Safety
/// `ptr` must point at `len` bytes from [`buffer`].
#[no_mangle]
pub unsafe extern "C" fn scan(ptr: *const u8, len: usize, iters: u32, bytewise: u32) -> u32 {
    let body = core::slice::from_raw_parts(ptr, len);
    let mut found = [Found::Absent; 4];
    TOKENS.with_borrow_mut(|t| {
        let mut total = 0u32;
        for _ in 0..iters {
            let r = if bytewise != 0 {
                scan_json_bytewise(body, &FIELDS, t, &mut found, 1 << 20)
            } else {
                scan_json(body, &FIELDS, t, &mut found, 1 << 20)
            };
            if r.is_err() {
                return 0;
            }
            total = total.wrapping_add(t.len() as u32);
        }
        total
    })
}

/// The sequence hashes of the last scan's tokens in blocks of `block_size`, `iters` times;
/// returns the last hash's low 32 bits.
#[no_mangle]
pub extern "C" fn hash(iters: u32, block_size: u32) -> u32 {
    TOKENS.with_borrow(|t| {
        SEQS.with_borrow_mut(|out| {
            for _ in 0..iters {
                let _ = sequence_hashes_into(t, block_size as usize, BASE_SEED, out);
            }
            out.last().map_or(0, |s| s.0 as u32)
        })
    })
}
