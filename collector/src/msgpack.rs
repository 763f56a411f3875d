//! A bounded msgpack reader over a borrowed buffer: the generic half of the event decoder
//! ([`crate::decode`] keeps the engines' event shapes).
//!
//! Hand-written rather than the `rmp` crate's readers: those return lengths without checking
//! them against the bytes that remain, and skipping a value needs a recursive walk either way.
//! Here every length is checked before anything is reserved, nesting is bounded by
//! [`MAX_DEPTH`], and arbitrary bytes give a [`DecodeError`], never a panic.

/// Deepest nesting the reader follows while skipping values it does not need.
pub const MAX_DEPTH: u32 = 32;

/// Why a payload could not be decoded. Positions are byte offsets into the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload ended inside a value.
    #[error("payload truncated at byte {at}")]
    Truncated { at: usize },
    /// A value of the wrong msgpack type.
    #[error("expected {expected} at byte {at}")]
    Type { at: usize, expected: &'static str },
    /// A value of the right type that makes no sense.
    #[error("bad {what} at byte {at}")]
    Value { at: usize, what: &'static str },
    /// Values nested deeper than [`MAX_DEPTH`].
    #[error("values nested deeper than {MAX_DEPTH} at byte {at}")]
    TooDeep { at: usize },
    /// A byte that is no msgpack marker (0xc1).
    #[error("reserved msgpack marker at byte {at}")]
    Reserved { at: usize },
}

pub(crate) fn is_array(m: u8) -> bool {
    (0x90..=0x9f).contains(&m) || m == 0xdc || m == 0xdd
}

pub(crate) fn is_map(m: u8) -> bool {
    (0x80..=0x8f).contains(&m) || m == 0xde || m == 0xdf
}

/// A cursor over a borrowed msgpack buffer.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, at: 0 }
    }

    /// The byte offset of the next value.
    pub(crate) fn at(&self) -> usize {
        self.at
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.at
    }

    pub(crate) fn peek(&self) -> Result<u8, DecodeError> {
        self.buf
            .get(self.at)
            .copied()
            .ok_or(DecodeError::Truncated { at: self.at })
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.remaining() {
            return Err(DecodeError::Truncated { at: self.at });
        }
        let s = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    pub(crate) fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| acc << 8 | b as u64))
    }

    /// A container length, checked against the bytes left (every element takes ≥ 1 byte per
    /// `per_item`), so that a lying header never turns into a huge allocation.
    pub(crate) fn checked_len(
        &self,
        len: u64,
        per_item: usize,
        at: usize,
    ) -> Result<usize, DecodeError> {
        match len.checked_mul(per_item as u64) {
            Some(need) if need <= self.remaining() as u64 => Ok(len as usize),
            _ => Err(DecodeError::Truncated { at }),
        }
    }

    pub(crate) fn array_len(&mut self) -> Result<usize, DecodeError> {
        let at = self.at;
        let len = match self.u8()? {
            m @ 0x90..=0x9f => (m & 0x0f) as u64,
            0xdc => self.be(2)?,
            0xdd => self.be(4)?,
            _ => {
                return Err(DecodeError::Type {
                    at,
                    expected: "array",
                })
            }
        };
        self.checked_len(len, 1, at)
    }

    pub(crate) fn map_len(&mut self) -> Result<usize, DecodeError> {
        let at = self.at;
        let len = match self.u8()? {
            m @ 0x80..=0x8f => (m & 0x0f) as u64,
            0xde => self.be(2)?,
            0xdf => self.be(4)?,
            _ => {
                return Err(DecodeError::Type {
                    at,
                    expected: "map",
                })
            }
        };
        self.checked_len(len, 2, at)
    }

    /// The payload of a str value, if the next value is one.
    pub(crate) fn str_bytes(&mut self) -> Result<Option<&'a [u8]>, DecodeError> {
        let len = match self.peek()? {
            m @ 0xa0..=0xbf => {
                self.at += 1;
                (m & 0x1f) as usize
            }
            0xd9 => {
                self.at += 1;
                self.be(1)? as usize
            }
            0xda => {
                self.at += 1;
                self.be(2)? as usize
            }
            0xdb => {
                self.at += 1;
                self.be(4)? as usize
            }
            _ => return Ok(None),
        };
        self.take(len).map(Some)
    }

    pub(crate) fn str(&mut self) -> Result<&'a str, DecodeError> {
        let at = self.at;
        let bytes = self.str_bytes()?.ok_or(DecodeError::Type {
            at,
            expected: "string",
        })?;
        std::str::from_utf8(bytes).map_err(|_| DecodeError::Value {
            at,
            what: "string is not UTF-8",
        })
    }

    pub(crate) fn opt_str(&mut self) -> Result<Option<&'a str>, DecodeError> {
        if self.peek()? == 0xc0 {
            self.at += 1;
            return Ok(None);
        }
        self.str().map(Some)
    }

    pub(crate) fn bin(&mut self) -> Result<Option<&'a [u8]>, DecodeError> {
        let len = match self.peek()? {
            0xc4 => {
                self.at += 1;
                self.be(1)? as usize
            }
            0xc5 => {
                self.at += 1;
                self.be(2)? as usize
            }
            0xc6 => {
                self.at += 1;
                self.be(4)? as usize
            }
            _ => return Ok(None),
        };
        self.take(len).map(Some)
    }

    /// Any msgpack integer, widened.
    pub(crate) fn int(&mut self) -> Result<Option<i128>, DecodeError> {
        let m = self.peek()?;
        let v = match m {
            0x00..=0x7f => {
                self.at += 1;
                m as i128
            }
            0xe0..=0xff => {
                self.at += 1;
                m as i8 as i128
            }
            0xcc..=0xcf => {
                self.at += 1;
                self.be(1 << (m - 0xcc))? as i128
            }
            0xd0..=0xd3 => {
                self.at += 1;
                let n = 1usize << (m - 0xd0);
                let raw = self.be(n)?;
                let shift = 64 - 8 * n as u32;
                ((raw << shift) as i64 >> shift) as i128
            }
            _ => return Ok(None),
        };
        Ok(Some(v))
    }

    pub(crate) fn opt_int(&mut self) -> Result<Option<i128>, DecodeError> {
        let at = self.at;
        if self.peek()? == 0xc0 {
            self.at += 1;
            return Ok(None);
        }
        self.int()?.map(Some).ok_or(DecodeError::Type {
            at,
            expected: "integer or nil",
        })
    }

    pub(crate) fn f64(&mut self) -> Result<f64, DecodeError> {
        let at = self.at;
        match self.peek()? {
            0xcb => {
                self.at += 1;
                Ok(f64::from_bits(self.be(8)?))
            }
            0xca => {
                self.at += 1;
                Ok(f32::from_bits(self.be(4)? as u32) as f64)
            }
            _ => self.int()?.map(|v| v as f64).ok_or(DecodeError::Type {
                at,
                expected: "number",
            }),
        }
    }

    /// Skips one value of any type.
    pub(crate) fn skip(&mut self, depth: u32) -> Result<(), DecodeError> {
        let at = self.at;
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep { at });
        }
        let m = self.u8()?;
        let (skip, items) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * (m & 0x0f) as u64),
            0x90..=0x9f => (0, (m & 0x0f) as u64),
            0xa0..=0xbf => ((m & 0x1f) as u64, 0),
            0xc1 => return Err(DecodeError::Reserved { at }),
            0xc4 | 0xd9 => (self.be(1)?, 0),
            0xc5 | 0xda => (self.be(2)?, 0),
            0xc6 | 0xdb => (self.be(4)?, 0),
            0xc7 => (self.be(1)? + 1, 0),
            0xc8 => (self.be(2)? + 1, 0),
            0xc9 => (self.be(4)? + 1, 0),
            0xca => (4, 0),
            0xcb => (8, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xce | 0xd2 => (4, 0),
            0xcf | 0xd3 => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (0, self.be(2)?),
            0xdd => (0, self.be(4)?),
            0xde => (0, 2 * self.be(2)?),
            0xdf => (0, 2 * self.be(4)?),
        };
        if skip > self.remaining() as u64 || items > self.remaining() as u64 {
            return Err(DecodeError::Truncated { at });
        }
        self.at += skip as usize;
        for _ in 0..items {
            self.skip(depth + 1)?;
        }
        Ok(())
    }
}
