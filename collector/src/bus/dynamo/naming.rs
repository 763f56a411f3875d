//! The NATS subjects of Dynamo's KV events and the names of its workers' KV query endpoints
//! (their NATS subjects and discovery records; the facts: [`super`]). Apart from the reader
//! so that the settings can name the subjects without depending on it.

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

/// A worker's KV query endpoint, as Dynamo names it (ai-dynamo 1.6.1: the endpoint is named
/// after the worker's kv-events publisher, the instance is the worker).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueryEndpoint {
    pub namespace: String,
    pub component: String,
    /// `worker_kv_query_source_<publisher id, hex>`.
    pub endpoint: String,
    pub worker_id: u64,
}

impl QueryEndpoint {
    /// Its NATS request-plane subject: `<ns>_<c>.<endpoint>-<worker id, hex>`.
    pub fn subject(&self) -> String {
        format!(
            "{}_{}.{}-{:x}",
            self.namespace, self.component, self.endpoint, self.worker_id
        )
    }

    /// The name of its record in Dynamo's file discovery, under `v1/instances/`: the key
    /// `<ns>/<c>/<endpoint>/<worker id, hex>` with every byte outside `[A-Za-z0-9]` written
    /// `%XX` (as 1.6.1 names its files; `testdata/dynamo/tcp_request_plane_1.6.1.txt`).
    pub fn discovery_file(&self) -> String {
        let key = format!(
            "{}/{}/{}/{:x}",
            self.namespace, self.component, self.endpoint, self.worker_id
        );
        let mut out = String::with_capacity(key.len() * 2);
        for b in key.bytes() {
            if b.is_ascii_alphanumeric() {
                out.push(char::from(b));
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        out
    }
}

/// The KV query endpoint of the worker that published on `event_subject`
/// (`namespace.<ns>.component.<c>...`) through event publisher `publisher_id`. `None` when the
/// event subject does not have that shape (a `--dynamo-subject` of another naming) or a name
/// could not be a subject token.
pub fn query_endpoint(
    event_subject: &str,
    publisher_id: u64,
    worker_id: u64,
) -> Option<QueryEndpoint> {
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
    Some(QueryEndpoint {
        namespace: ns,
        component: c,
        endpoint: format!("worker_kv_query_source_{publisher_id:x}"),
        worker_id,
    })
}

/// The NATS request-plane subject of that endpoint ([`QueryEndpoint::subject`]).
pub fn query_subject(event_subject: &str, publisher_id: u64, worker_id: u64) -> Option<String> {
    query_endpoint(event_subject, publisher_id, worker_id).map(|q| q.subject())
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

    #[test]
    fn discovery_files_are_named_as_dynamo_names_them() {
        // ai-dynamo 1.6.1's file discovery, TCP request plane (testdata/dynamo/README.md).
        let text = include_str!("../../../../testdata/dynamo/tcp_request_plane_1.6.1.txt");
        let file = text
            .lines()
            .find_map(|l| l.strip_prefix("instance_file: v1/instances/"))
            .unwrap();
        let q = query_endpoint(
            "namespace.dynamo.component.backend.endpoint.generate.kv-events",
            1_646_687_948_392_183,
            14_507_558_946_996_755_466,
        )
        .unwrap();
        assert_eq!(q.endpoint, "worker_kv_query_source_5d9a76a3846f7");
        assert_eq!(q.discovery_file(), file);
    }
}
