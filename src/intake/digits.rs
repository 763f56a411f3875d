//! Decimal digits a machine word at a time (SWAR): the value of up to eight ASCII digits read
//! from one 64-bit word, for every digit path of the token scanner.

/// The value of the `digits` (1 to 7) ASCII digits at the start of the little-endian word
/// `raw`.
#[inline]
pub(crate) fn swar_digits(raw: u64, digits: usize) -> u64 {
    eight_digits(aligned_digits(raw, digits))
}

/// The first `digits` (1 to 7) ASCII digits of the little-endian word `raw` as byte values
/// 0–9 moved to the word's top, zeros below: an eight-digit number with leading zeros, its
/// most significant digit in the lowest byte.
#[inline]
pub(crate) fn aligned_digits(raw: u64, digits: usize) -> u64 {
    raw.wrapping_sub(0x3030_3030_3030_3030) << (8 * (8 - digits))
}

/// The value of eight digits laid out as [`aligned_digits`] gives them (SWAR, as in
/// simdjson's `parse_eight_digits_unrolled`): pairs, then fours, then the eight.
#[inline]
pub(crate) fn eight_digits(v: u64) -> u64 {
    let v = v.wrapping_mul(10).wrapping_add(v >> 8);
    ((v & 0x0000_00FF_0000_00FF)
        .wrapping_mul(100 + (1_000_000 << 32))
        .wrapping_add(((v >> 16) & 0x0000_00FF_0000_00FF).wrapping_mul(1 + (10_000 << 32))))
        >> 32
}
