//! The byte reader and writers shared by every binary format of the core: the feed pages
//! ([`crate::feed`]) and the filter's shared-data values ([`crate::mirror`]). Integers are
//! little-endian; every read is bounds-checked and none panics, whatever the input.

/// Why a read failed, with the byte offset it failed at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The input ended before the value did.
    #[error("truncated at byte {0}")]
    Truncated(usize),
    /// The bytes are there but do not make a valid value.
    #[error("bad value at byte {at}: {what}")]
    Value {
        /// Offset of the value's first byte.
        at: usize,
        /// What was wrong.
        what: &'static str,
    },
}

/// A cursor over a byte slice.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, at: 0 }
    }

    /// Offset of the next byte to read.
    pub fn position(&self) -> usize {
        self.at
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or(CodecError::Truncated(self.at))?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], CodecError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    /// One byte.
    pub fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.array::<1>()?[0])
    }

    /// A byte that must be 0 or 1.
    pub fn bool(&mut self) -> Result<bool, CodecError> {
        let at = self.at;
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(CodecError::Value { at, what: "bool" }),
        }
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self) -> Result<u16, CodecError> {
        self.array().map(u16::from_le_bytes)
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, CodecError> {
        self.array().map(u32::from_le_bytes)
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, CodecError> {
        self.array().map(u64::from_le_bytes)
    }

    /// An LEB128 varint of at most 64 bits.
    pub fn varint(&mut self) -> Result<u64, CodecError> {
        let start = self.at;
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.u8()?;
            let bits = (byte & 0x7f) as u64;
            if shift == 63 && bits > 1 {
                return Err(CodecError::Value {
                    at: start,
                    what: "varint overflows u64",
                });
            }
            v |= bits << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(CodecError::Value {
            at: start,
            what: "varint too long",
        })
    }

    /// A varint that must fit a `u32`.
    pub fn u32_varint(&mut self) -> Result<u32, CodecError> {
        let at = self.at;
        u32::try_from(self.varint()?).map_err(|_| CodecError::Value {
            at,
            what: "value exceeds u32",
        })
    }

    /// A UTF-8 string behind a varint length of at most `max` bytes.
    pub fn str_varint(&mut self, max: usize) -> Result<String, CodecError> {
        let at = self.at;
        let len = self.varint()?;
        if len > max as u64 {
            return Err(CodecError::Value {
                at,
                what: "string too long",
            });
        }
        self.utf8(at, len as usize)
    }

    /// A UTF-8 string behind a `u16` length.
    pub fn str_u16(&mut self) -> Result<String, CodecError> {
        let at = self.at;
        let len = self.u16()? as usize;
        self.utf8(at, len)
    }

    fn utf8(&mut self, at: usize, len: usize) -> Result<String, CodecError> {
        core::str::from_utf8(self.take(len)?)
            .map(str::to_owned)
            .map_err(|_| CodecError::Value {
                at,
                what: "string not UTF-8",
            })
    }
}

/// Appends `v` as an LEB128 varint.
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
fn cut(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Appends `s` (cut at a character boundary to `max` bytes) behind a varint length.
pub fn put_str_varint(out: &mut Vec<u8>, s: &str, max: usize) {
    let s = cut(s, max);
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// Appends `s` (cut at a character boundary to 65,535 bytes) behind a `u16` length.
pub fn put_str_u16(out: &mut Vec<u8>, s: &str) {
    let s = cut(s, u16::MAX as usize);
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The little-endian `u64` at byte `at` of `b`, or 0 past the end: for in-place reads of
/// values whose length was checked when they were parsed.
#[inline]
pub fn le_u64(b: &[u8], at: usize) -> u64 {
    match b.get(at..at.saturating_add(8)) {
        Some(s) => {
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            u64::from_le_bytes(a)
        }
        None => 0,
    }
}

/// The little-endian `u16` at byte `at` of `b`, or 0 past the end.
#[inline]
pub fn le_u16(b: &[u8], at: usize) -> u16 {
    match b.get(at..at.saturating_add(2)) {
        Some(s) => u16::from_le_bytes([s[0], s[1]]),
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip() {
        let mut out = Vec::new();
        put_varint(&mut out, 300);
        put_str_u16(&mut out, "héllo");
        put_str_varint(&mut out, "ab", 16);
        out.extend_from_slice(&7u64.to_le_bytes());
        let mut r = Reader::new(&out);
        assert_eq!(r.varint(), Ok(300));
        assert_eq!(r.str_u16().as_deref(), Ok("héllo"));
        assert_eq!(r.str_varint(16).as_deref(), Ok("ab"));
        assert_eq!(r.u64(), Ok(7));
        assert_eq!(r.remaining(), 0);
        assert_eq!(r.u8(), Err(CodecError::Truncated(out.len())));
    }

    #[test]
    fn strings_are_cut_on_character_boundaries() {
        let mut out = Vec::new();
        put_str_varint(&mut out, "aé", 2);
        assert_eq!(Reader::new(&out).str_varint(2).as_deref(), Ok("a"));
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        assert!(Reader::new(&[0xff; 11]).varint().is_err());
        assert!(Reader::new(&[2]).bool().is_err());
        assert!(Reader::new(&[5, 0, b'a']).str_u16().is_err());
        assert!(Reader::new(&[0x80, 0x80, 0x80, 0x80, 0x10])
            .u32_varint()
            .is_err());
        assert_eq!(le_u64(&[1, 2], 0), 0);
        assert_eq!(le_u16(&[1, 2], usize::MAX), 0);
    }
}
