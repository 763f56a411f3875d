//! The NATS subjects of Dynamo's KV events and of its workers' KV query endpoints (the facts:
//! [`super`]). Apart from the reader so that the settings can name the subjects without
//! depending on it.

/// The topic of Dynamo's KV events.
pub const TOPIC: &str = "kv-events";

/// Dynamo's subjects for the KV events of `namespace` (and `component`, or every component):
/// first the event plane's since the endpoint joined it,
/// `namespace.<ns>.component.<c>.endpoint.<e>.kv-events` (any endpoint; checked against
/// ai-dynamo 1.6.1), then the earlier `namespace.<ns>.component.<c>.kv-events`. A deployment
/// publishes on one of them; reading both costs one idle subscription and spares an operator
/// from matching the flag to the Dynamo release.
///
/// # Errors
/// An empty namespace or component.
pub fn subjects(namespace: &str, component: Option<&str>) -> Result<Vec<String>, &'static str> {
    if namespace.is_empty() || component.is_some_and(str::is_empty) {
        return Err("an empty name");
    }
    let component = component.map_or_else(|| "*".to_owned(), segment);
    let base = format!("namespace.{}.component.{component}", segment(namespace));
    Ok(vec![
        format!("{base}.endpoint.*.{TOPIC}"),
        format!("{base}.{TOPIC}"),
    ])
}

/// The NATS request-plane subject of the KV query endpoint of the worker that published on
/// `event_subject` (`namespace.<ns>.component.<c>...`) through event publisher `publisher_id`:
/// `<ns>_<c>.worker_kv_query_source_<publisher id, hex>-<worker id, hex>` (ai-dynamo 1.6.1:
/// the endpoint is named after the publisher, the instance is the worker). `None` when the
/// event subject does not have that shape (a `--dynamo-subject` of another naming) or a name
/// could not be a subject token.
pub fn query_subject(event_subject: &str, publisher_id: u64, worker_id: u64) -> Option<String> {
    let mut t = event_subject.split('.');
    let (Some("namespace"), Some(ns), Some("component"), Some(c)) =
        (t.next(), t.next(), t.next(), t.next())
    else {
        return None;
    };
    let (ns, c) = (unsegment(ns)?, unsegment(c)?);
    let ok = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if !ok(&ns) || !ok(&c) {
        return None;
    }
    Some(format!(
        "{ns}_{c}.worker_kv_query_source_{publisher_id:x}-{worker_id:x}"
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

/// [`segment`] undone; `None` for a malformed escape or bytes that are not UTF-8.
fn unsegment(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_follow_dynamo_naming() {
        assert_eq!(
            subjects("dynamo", Some("backend")).unwrap(),
            [
                "namespace.dynamo.component.backend.endpoint.*.kv-events",
                "namespace.dynamo.component.backend.kv-events"
            ]
        );
        assert_eq!(
            subjects("dynamo", None).unwrap()[0],
            "namespace.dynamo.component.*.endpoint.*.kv-events"
        );
        // Dots and wildcards in a name cannot change the subject's shape.
        assert_eq!(
            subjects("a.b", Some("x*")).unwrap()[1],
            "namespace.a%2Eb.component.x%2A.kv-events"
        );
        assert!(subjects("", None).is_err());
        assert!(subjects("ns", Some("")).is_err());
    }

    #[test]
    fn query_subjects_are_built_from_the_event_alone() {
        // Captured from ai-dynamo 1.6.1's mocker (testdata/dynamo/README.md): publisher
        // 1124591175272090, worker 7030154717409816316.
        assert_eq!(
            query_subject(
                "namespace.dynamo.component.backend.endpoint.generate.kv-events",
                1_124_591_175_272_090,
                7_030_154_717_409_816_316
            )
            .as_deref(),
            Some("dynamo_backend.worker_kv_query_source_3fecf4985069a-61902077d73faefc")
        );
        assert_eq!(
            query_subject("namespace.a%2Db.component.c.kv-events", 1, 255).as_deref(),
            Some("a-b_c.worker_kv_query_source_1-ff")
        );
        // Names a subject token cannot hold, and subjects of another shape.
        assert_eq!(
            query_subject("namespace.a%2Eb.component.c.kv-events", 1, 1),
            None
        );
        assert_eq!(
            query_subject("namespace.a%2.component.c.kv-events", 1, 1),
            None
        );
        assert_eq!(query_subject("dynamo.kv_events", 1, 1), None);
    }
}
