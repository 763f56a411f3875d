//! An ordered, multi-valued header map with Envoy's rules: names are lower-cased on the way in,
//! lookups take the first value, values are bytes (not necessarily UTF-8).

use std::fmt;

/// Ordered header (or trailer) map, as Envoy keeps it: names lower-cased, duplicates allowed.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Headers {
    entries: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Headers {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds a map from `(name, value)` pairs (names are lower-cased).
    pub fn from_pairs<K: AsRef<str>, V: AsRef<str>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        let mut h = Self::new();
        for (k, v) in pairs {
            h.add(k.as_ref(), v.as_ref());
        }
        h
    }

    /// Appends a value (Envoy `addCopy`).
    pub fn add(&mut self, name: &str, value: &str) {
        self.add_bytes(name.as_bytes(), value.as_bytes());
    }

    /// Appends a byte value.
    pub fn add_bytes(&mut self, name: &[u8], value: &[u8]) {
        self.entries
            .push((name.to_ascii_lowercase(), value.to_vec()));
    }

    /// Replaces every value of `name` by one value, appending it if absent (Envoy `setCopy`).
    pub fn set(&mut self, name: &str, value: &str) {
        self.set_bytes(name.as_bytes(), value.as_bytes());
    }

    /// Byte form of [`Headers::set`].
    pub fn set_bytes(&mut self, name: &[u8], value: &[u8]) {
        let name = name.to_ascii_lowercase();
        match self.entries.iter().position(|(k, _)| *k == name) {
            Some(first) => {
                self.entries[first].1 = value.to_vec();
                let mut i = first + 1;
                while i < self.entries.len() {
                    if self.entries[i].0 == name {
                        self.entries.remove(i);
                    } else {
                        i += 1;
                    }
                }
            }
            None => self.entries.push((name, value.to_vec())),
        }
    }

    /// Removes every value of `name`; removing an absent name is not an error (as in Envoy).
    pub fn remove(&mut self, name: &str) {
        self.remove_bytes(name.as_bytes());
    }

    /// Byte form of [`Headers::remove`].
    pub fn remove_bytes(&mut self, name: &[u8]) {
        let name = name.to_ascii_lowercase();
        self.entries.retain(|(k, _)| *k != name);
    }

    /// First value of `name` as UTF-8 (`None` if absent or not UTF-8).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.get_bytes(name.as_bytes())
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    /// First value of `name` as bytes.
    pub fn get_bytes(&self, name: &[u8]) -> Option<&[u8]> {
        let name = name.to_ascii_lowercase();
        self.entries
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Every value of `name`, in order.
    pub fn get_all(&self, name: &str) -> Vec<&[u8]> {
        let name = name.as_bytes().to_ascii_lowercase();
        self.entries
            .iter()
            .filter(|(k, _)| *k == name)
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    /// Whether `name` has at least one value.
    pub fn contains(&self, name: &str) -> bool {
        self.get_bytes(name.as_bytes()).is_some()
    }

    /// Number of entries (a name with two values counts twice).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the map has no entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries as lossy UTF-8 strings, in order.
    pub fn iter(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.entries.iter().map(|(k, v)| {
            (
                String::from_utf8_lossy(k).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            )
        })
    }

    /// Entries as bytes, in order.
    pub fn iter_bytes(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.entries
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
    }

    /// Sum of name and value lengths.
    pub fn byte_size(&self) -> usize {
        self.entries.iter().map(|(k, v)| k.len() + v.len()).sum()
    }
}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_replaces_all_values_and_keeps_position() {
        let mut h = Headers::from_pairs([("A", "1"), ("b", "2"), ("a", "3")]);
        h.set("a", "x");
        assert_eq!(
            h.iter().collect::<Vec<_>>(),
            vec![("a".into(), "x".into()), ("b".into(), "2".into())]
        );
        h.remove("B");
        assert_eq!(h.len(), 1);
        assert_eq!(h.get("A"), Some("x"));
    }
}
