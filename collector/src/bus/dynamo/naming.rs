//! The NATS subject Dynamo publishes its workers' KV events on (the facts: [`super`]).
//! Apart from the reader so that the settings can name the subject without depending on it.

/// The topic of Dynamo's KV events.
pub const TOPIC: &str = "kv-events";

/// Dynamo's subject for the KV events of `namespace` (and `component`, or every component).
///
/// # Errors
/// An empty namespace or component.
pub fn subject(namespace: &str, component: Option<&str>) -> Result<String, &'static str> {
    if namespace.is_empty() || component.is_some_and(str::is_empty) {
        return Err("an empty name");
    }
    let component = component.map_or_else(|| "*".to_owned(), segment);
    Ok(format!(
        "namespace.{}.component.{component}.{TOPIC}",
        segment(namespace)
    ))
}

/// One subject segment as Dynamo writes it: bytes outside `[A-Za-z0-9_-]` as `%XX`.
fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_follow_dynamo_naming() {
        assert_eq!(
            subject("dynamo", Some("backend")).unwrap(),
            "namespace.dynamo.component.backend.kv-events"
        );
        assert_eq!(
            subject("dynamo", None).unwrap(),
            "namespace.dynamo.component.*.kv-events"
        );
        // Dots and wildcards in a name cannot change the subject's shape.
        assert_eq!(
            subject("a.b", Some("x*")).unwrap(),
            "namespace.a%2Eb.component.x%2A.kv-events"
        );
        assert!(subject("", None).is_err());
        assert!(subject("ns", Some("")).is_err());
    }
}
