use kvroute_host_test::{Gateway, HostError, Mode, StreamState};

use crate::support::*;

const CONFIG: &str = r#"{"collector": {"cluster": "kvroute_collector"}}"#;

#[test]
fn the_real_filter_loads_and_fails_open_without_tokens() {
    let mut gw = Gateway::builder(fixture("kvroute_filter"))
        .config(CONFIG)
        .allow_on_headers_stop_iteration(true)
        .workers(2)
        .build()
        .expect("kvroute_filter loads and accepts its minimal configuration");
    gw.cluster_manual("kvroute_collector");
    gw.advance(std::time::Duration::from_secs(1));
    for worker in 0..2 {
        let r = gw.request().worker(worker).path("/v1/completions").send();
        assert_eq!(r.state, StreamState::Complete, "{:?}", r.error());
        assert!(r.continued());
    }
    assert!(gw.errors().is_empty(), "{:?}", gw.errors());
}

#[test]
fn the_real_filter_higress_build_needs_higress() {
    let err = Gateway::load(fixture("kvroute_filter_higress"), CONFIG).unwrap_err();
    assert!(matches!(err, HostError::UnknownImport { .. }), "{err}");
    Gateway::builder(fixture("kvroute_filter_higress"))
        .config(CONFIG)
        .mode(Mode::Higress)
        .build()
        .expect("the Higress build loads in Higress mode");
}
