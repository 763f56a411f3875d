//! A request's headers read in one crossing (`proxy_get_header_map_pairs`) and looked up in
//! the VM: the filter asks for up to five of them (the client's destination header, content
//! type and length, the configured token, model and tenant headers). In Envoy's V8 a read that
//! finds its header costs ~1.4 µs, most of it the host calling back into the VM to allocate
//! the value, and one read of the whole map (a few hundred bytes on a typical request) costs
//! the same (timing mode's probes).

/// The header map as the host serialized it: a count, then a (name length, value length) pair
/// per header, then each name and value, each followed by a NUL. Names are lowercase in
/// Envoy; lookups ignore ASCII case all the same.
#[derive(Debug, Default, Clone)]
pub struct Headers {
    bytes: Vec<u8>,
}

fn u32_at(b: &[u8], at: usize) -> Option<usize> {
    let w = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as usize)
}

impl Headers {
    /// The host's serialized map; `None` when it is malformed (the caller then asks the host
    /// header by header).
    pub fn parse(bytes: Vec<u8>) -> Option<Headers> {
        let b = &bytes;
        let n = u32_at(b, 0)?;
        let mut at = n.checked_mul(8)?.checked_add(4)?;
        if at > b.len() {
            return None;
        }
        for i in 0..n {
            let (k, v) = (u32_at(b, 4 + 8 * i)?, u32_at(b, 8 + 8 * i)?);
            at = at.checked_add(k)?.checked_add(v)?.checked_add(2)?;
        }
        (at == b.len()).then_some(Headers { bytes })
    }

    /// Every (name, value). The lengths were checked by [`Headers::parse`]; a slice that
    /// would not be in bounds reads as empty all the same.
    fn entries(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let b = &self.bytes;
        let n = u32_at(b, 0).unwrap_or(0);
        let mut at = 4 + 8 * n;
        (0..n).map(move |i| {
            let k = u32_at(b, 4 + 8 * i).unwrap_or(0);
            let v = u32_at(b, 8 + 8 * i).unwrap_or(0);
            let name = b.get(at..at + k).unwrap_or_default();
            let value = b.get(at + k + 1..at + k + 1 + v).unwrap_or_default();
            at += k + v + 2;
            (name, value)
        })
    }

    /// The first value of `name` (ASCII case ignored).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.entries()
            .find(|(k, _)| k.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// Whether `name` is present (ASCII case ignored).
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serialize(pairs: &[(&str, &str)]) -> Vec<u8> {
        let mut b = (pairs.len() as u32).to_le_bytes().to_vec();
        for (k, v) in pairs {
            b.extend((k.len() as u32).to_le_bytes());
            b.extend((v.len() as u32).to_le_bytes());
        }
        for (k, v) in pairs {
            b.extend(k.as_bytes());
            b.push(0);
            b.extend(v.as_bytes());
            b.push(0);
        }
        b
    }

    #[test]
    fn finds_values_by_name_whatever_the_case() {
        let h = Headers::parse(serialize(&[
            (":path", "/v1/completions"),
            ("content-type", "application/json"),
            ("x-token-ids", ""),
            ("X-Dest", "a"),
            ("x-dest", "b"),
        ]))
        .unwrap();
        assert_eq!(h.get("Content-Type"), Some(&b"application/json"[..]));
        assert_eq!(h.get("x-token-ids"), Some(&b""[..]));
        assert_eq!(h.get("x-dest"), Some(&b"a"[..]));
        assert!(h.contains("X-DEST"));
        assert!(!h.contains("content-length"));
        assert!(Headers::parse(serialize(&[])).unwrap().get("a").is_none());
    }

    #[test]
    fn a_map_whose_lengths_lie_is_refused_at_every_cut() {
        let good = serialize(&[("a", "1"), ("bb", "22")]);
        for cut in 0..good.len() {
            assert!(
                Headers::parse(good[..cut].to_vec()).is_none(),
                "cut at {cut}"
            );
        }
        let mut long = good.clone();
        long.push(0);
        assert!(Headers::parse(long).is_none());
        let mut huge = good;
        huge[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Headers::parse(huge).is_none());
    }
}
