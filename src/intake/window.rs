//! The token array's common stretch, 64 bytes at a time: a window of tokens of 1 to 7 digits
//! separated by `,` or `, ` is checked whole from four byte-class masks, then every token in
//! it is read without a branch on its separator.
//!
//! The masks come from 16-byte SIMD compares: wasm `simd128` (the filter's build, as Envoy's
//! V8 and wasmtime run it) and x86-64's SSE2 (native builds). Elsewhere four masks cost more
//! than they save, and [`take`] leaves every window to the caller's per-token path with the
//! one mask it needs. [`masks_scalar`], a byte loop, is the reference the SIMD masks are
//! tested against. A window that fails the check also goes to the per-token path, which reads
//! (or refuses) it exactly as the byte-at-a-time parser would.

#[cfg(simd)]
use super::digits::{aligned_digits, eight_digits};

/// What [`take`] made of a window.
pub(crate) enum Window {
    /// Its tokens were read; the next window starts this many bytes further.
    #[cfg_attr(not(simd), allow(dead_code))]
    Taken(usize),
    /// Left to the per-token path, with bit `k` set when byte `k` is not an ASCII digit.
    Left { nondigit: u64 },
}

/// Reads the window's tokens into `tokens` when they pass the check (see [`read`]).
#[cfg(simd)]
#[inline]
pub(crate) fn take(win: &[u8; 72], tokens: &mut Vec<u32>, limit: usize) -> Window {
    let m = masks(win.first_chunk::<64>().unwrap_or(&[0; 64]));
    match read(win, &m, tokens, limit) {
        Some(n) => Window::Taken(n),
        None => Window::Left { nondigit: !m.digit },
    }
}

/// Without SIMD compares: every window to the per-token path.
#[cfg(not(simd))]
#[inline]
pub(crate) fn take(win: &[u8; 72], _tokens: &mut Vec<u32>, _limit: usize) -> Window {
    Window::Left {
        nondigit: nondigit_swar(win),
    }
}

/// Bit `k` set when `w[k]` is not an ASCII digit, for the first 64 bytes of `w`, a word at a
/// time.
#[cfg(not(simd))]
#[inline]
fn nondigit_swar(w: &[u8; 72]) -> u64 {
    let mut m = 0u64;
    for k in 0..8 {
        let mut word = [0u8; 8];
        word.copy_from_slice(&w[k * 8..k * 8 + 8]);
        let x = u64::from_le_bytes(word).wrapping_sub(0x3030_3030_3030_3030);
        let flags = (x | x.wrapping_add(0x7676_7676_7676_7676)) & 0x8080_8080_8080_8080;
        // Gather the eight flag bits (one per byte) into one byte, byte k to bit k.
        m |= ((flags >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * k);
    }
    m
}

/// Bit `k` of each mask describes byte `k` of a 64-byte window.
#[cfg(simd)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Masks {
    /// `0`–`9`.
    pub digit: u64,
    /// `,`.
    pub comma: u64,
    /// ` ` (only the one space Python's `json.dumps` writes after a comma is taken here).
    pub space: u64,
    /// `0`, for leading zeros.
    pub zero: u64,
}

/// The masks by a byte loop: the reference the SIMD masks are tested against.
#[cfg(all(test, simd))]
pub(crate) fn masks_scalar(w: &[u8; 64]) -> Masks {
    let mut m = Masks::default();
    for (k, &c) in w.iter().enumerate() {
        m.digit |= u64::from(c.wrapping_sub(b'0') < 10) << k;
        m.comma |= u64::from(c == b',') << k;
        m.space |= u64::from(c == b' ') << k;
        m.zero |= u64::from(c == b'0') << k;
    }
    m
}

/// The masks of a 64-byte window, 16 bytes at a time by [`classes`].
#[cfg(simd)]
#[inline]
pub(crate) fn masks(w: &[u8; 64]) -> Masks {
    let mut m = Masks::default();
    for (k, chunk) in w.as_chunks::<16>().0.iter().enumerate() {
        let [digit, comma, space, zero] = classes(chunk).map(|b| u64::from(b) << (16 * k));
        m.digit |= digit;
        m.comma |= comma;
        m.space |= space;
        m.zero |= zero;
    }
    m
}

/// Bit `k` set when byte `k` of `chunk` is a digit, a comma, a space, a `0` (wasm `simd128`,
/// as Envoy's V8 and wasmtime run it).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline]
fn classes(chunk: &[u8; 16]) -> [u16; 4] {
    use core::arch::wasm32::*;
    let (lo, hi) = chunk.split_at(8);
    let lo = u64::from_le_bytes(lo.try_into().unwrap_or_default());
    let hi = u64::from_le_bytes(hi.try_into().unwrap_or_default());
    let x = u64x2(lo, hi);
    let digit = u8x16_le(u8x16_sub(x, u8x16_splat(b'0')), u8x16_splat(9));
    [
        digit,
        u8x16_eq(x, u8x16_splat(b',')),
        u8x16_eq(x, u8x16_splat(b' ')),
        u8x16_eq(x, u8x16_splat(b'0')),
    ]
    .map(|v| u8x16_bitmask(v))
}

/// [`classes`] by SSE2, part of every x86-64.
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[inline]
fn classes(chunk: &[u8; 16]) -> [u16; 4] {
    // SAFETY: SSE2 is enabled for this build (the cfg above; it is x86-64's baseline).
    unsafe { classes_sse2(chunk) }
}

#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[target_feature(enable = "sse2")]
fn classes_sse2(chunk: &[u8; 16]) -> [u16; 4] {
    use core::arch::x86_64::*;
    let (lo, hi) = chunk.split_at(8);
    let lo = i64::from_le_bytes(lo.try_into().unwrap_or_default());
    let hi = i64::from_le_bytes(hi.try_into().unwrap_or_default());
    let x = _mm_set_epi64x(hi, lo);
    // A digit: its value minus `0` is at most 9 (unsigned), i.e. min(v, 9) == v.
    let v = _mm_sub_epi8(x, _mm_set1_epi8(b'0' as i8));
    let digit = _mm_cmpeq_epi8(_mm_min_epu8(v, _mm_set1_epi8(9)), v);
    let eq = |c: u8| _mm_cmpeq_epi8(x, _mm_set1_epi8(c as i8));
    [digit, eq(b','), eq(b' '), eq(b'0')].map(|c| _mm_movemask_epi8(c) as u16)
}

/// The tokens of a window that starts at a token, when the window passes the check: appends
/// them to `tokens` and returns how many bytes they and their separators take (the next
/// window starts at the last token start found, which is read again there). `None` when the
/// window holds anything else, a token of 8 or more digits or one with a leading zero, fewer
/// than two token starts, or more tokens than `limit` allows.
///
/// Checked whole: inside the stretch before the window's last token start, every byte is a
/// digit, a comma after a digit, or a space after a comma, and no token has a leading zero or
/// 8 digits.
#[cfg(simd)]
#[inline]
pub(crate) fn read(
    win: &[u8; 72],
    m: &Masks,
    tokens: &mut Vec<u32>,
    limit: usize,
) -> Option<usize> {
    let d = m.digit;
    let starts = d & !(d << 1);
    // The last token start; none, or only one at the window's first byte: nothing to take.
    let last = 63u32
        .checked_sub(starts.leading_zeros())
        .filter(|&l| l > 0)? as usize;
    let r = (1u64 << last) - 1;
    let (c, s) = (m.comma & r, m.space & r);
    let stray = r & !(d | c | s);
    // With nothing else in the stretch, these two leave only `d,d` and `d, d`: a space or
    // comma after a space, a comma or a space after a comma, a window not starting at a
    // token, and the stretch's last byte (before a token start) are all caught by them.
    let bad_space = s & !(c << 1);
    let bad_comma = c & !(d << 1);
    let leading_zero = starts & r & m.zero & (d >> 1);
    let two = d & (d << 1);
    let four = two & (two << 2);
    let eight = four & (four << 4);
    if stray | bad_space | bad_comma | leading_zero | (eight & r) != 0 {
        return None;
    }
    let mut st = starts & r;
    let count = st.count_ones() as usize;
    if tokens.len() + count > limit {
        return None;
    }
    let nondigit = !d;
    // The digits of a token at `at`, laid out as eight with leading zeros.
    let laid_out = |at: usize| {
        let digits = (nondigit >> at).trailing_zeros() as usize;
        let word = win[at..].first_chunk::<8>().copied().unwrap_or_default();
        aligned_digits(u64::from_le_bytes(word), digits)
    };
    tokens.reserve(count);
    // Four tokens at a time: laid out one by one, their values combined together.
    for _ in 0..count / 4 {
        let mut four = [0u64; 4];
        for lane in &mut four {
            *lane = laid_out(st.trailing_zeros() as usize);
            st &= st - 1;
        }
        tokens.extend_from_slice(&values4(four));
    }
    while st != 0 {
        tokens.push(eight_digits(laid_out(st.trailing_zeros() as usize)) as u32);
        st &= st - 1;
    }
    Some(last)
}

/// The values of four tokens laid out by [`aligned_digits`], in 16-bit then 32-bit
/// lanes: pairs of digits (`a·10 + b`), fours (a dot product by 100 and 1), then eights (a
/// dot product by 10,000 and 1 after narrowing to 16 bits; every four fits).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline]
fn values4(four: [u64; 4]) -> [u32; 4] {
    use core::arch::wasm32::*;
    let fours = |lo: u64, hi: u64| {
        let v = u64x2(lo, hi);
        // Byte 2k is the more significant digit of pair k (the lowest byte is the first).
        let pairs = i16x8_add(
            i16x8_mul(v128_and(v, u16x8_splat(0x00ff)), u16x8_splat(10)),
            u16x8_shr(v, 8),
        );
        i32x4_dot_i16x8(pairs, i32x4_splat((1 << 16) | 100))
    };
    let fours = i16x8_narrow_i32x4(fours(four[0], four[1]), fours(four[2], four[3]));
    let v = i32x4_dot_i16x8(fours, i32x4_splat((1 << 16) | 10_000));
    [
        u32x4_extract_lane::<0>(v),
        u32x4_extract_lane::<1>(v),
        u32x4_extract_lane::<2>(v),
        u32x4_extract_lane::<3>(v),
    ]
}

/// [`values4`] a word at a time (native builds: SSE2 has no cheap way to write four lanes).
#[cfg(all(simd, not(all(target_arch = "wasm32", target_feature = "simd128"))))]
#[inline]
fn values4(four: [u64; 4]) -> [u32; 4] {
    four.map(|v| eight_digits(v) as u32)
}

#[cfg(all(test, simd))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `read` on the first 72 bytes of `text` (padded with `]`).
    fn read_text(text: &str) -> Option<(usize, Vec<u32>)> {
        let mut win = [b']'; 72];
        win[..text.len()].copy_from_slice(text.as_bytes());
        let mut tokens = Vec::new();
        let m = masks(win.first_chunk::<64>().unwrap());
        read(&win, &m, &mut tokens, usize::MAX).map(|n| (n, tokens))
    }

    #[test]
    fn clean_windows_are_read_up_to_their_last_token_start() {
        let text = "1, 22,333, 4444,55555, 666666, 7777777,0, 9, 10,11, 12,13, 14, 15";
        let (taken, tokens) = read_text(text).unwrap();
        // The window's last token start is `15`'s, at byte 63: read again by the next window.
        assert_eq!(&text[taken..], "15");
        assert_eq!(
            tokens,
            [1, 22, 333, 4444, 55555, 666666, 7777777, 0, 9, 10, 11, 12, 13, 14]
        );
    }

    #[test]
    fn every_break_of_the_pattern_leaves_the_window_to_the_token_path() {
        let clean = "1, 22,333, 4444,55555, 666666, 7777777,0, 9, 10,11, 12,13, 14, 15";
        assert!(read_text(clean).is_some());
        for (from, to) in [
            ("1, 22", "-1, 22"),     // not at a token start
            ("1, 22", "1,,22"),      // a comma after a comma
            ("1, 22", "1 ,22"),      // a space before a comma
            ("1, 22", "1,  2"),      // two spaces
            ("1, 22", "1\n,22"),     // other whitespace
            ("1, 22", "1.0,2"),      // a fraction
            ("22,333", "22,033"),    // a leading zero
            (",0,", ",00"),          // a leading zero, one digit more
            ("7777777", "77777777"), // 8 digits
        ] {
            let text = clean.replacen(from, to, 1);
            assert!(read_text(&text).is_none(), "{text}");
        }
        // One token start only, or none: nothing to take.
        assert!(read_text("1234567, 1").is_some());
        assert!(read_text("1234567").is_none());
        assert!(read_text(&"\"x".repeat(30)).is_none());
    }

    proptest! {
        /// Four tokens' values from 16-bit lanes are the words' one at a time.
        #[test]
        fn four_values_together_are_each_alone(
            four in prop::array::uniform4((1usize..=7, any::<u64>())),
        ) {
            let words = four.map(|(digits, seed)| {
                let ascii: [u8; 8] = core::array::from_fn(|k| b'0' + (seed >> (k * 4)) as u8 % 10);
                aligned_digits(u64::from_le_bytes(ascii), digits)
            });
            let one_by_one = words.map(|w| eight_digits(w) as u32);
            prop_assert_eq!(values4(words), one_by_one);
        }

        /// The SIMD masks are the byte loop's on any bytes, the classes' boundaries included.
        #[test]
        fn simd_masks_are_the_byte_loops(w in prop::collection::vec(
            prop_oneof![Just(b'0'), Just(b'9'), Just(b','), Just(b' '), Just(b'/'), Just(b':'),
                        Just(0u8), Just(0x80u8), Just(0xffu8), any::<u8>()], 64)) {
            let w: [u8; 64] = w.try_into().unwrap();
            prop_assert_eq!(masks(&w), masks_scalar(&w));
        }
    }
}
