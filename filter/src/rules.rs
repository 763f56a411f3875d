//! Which configuration a request gets: the first Higress rule whose matcher fits the
//! request's route, domain or service, or the global one.

use std::rc::Rc;

use proxy_wasm::types::MapType;

use crate::config::{Config, Matcher};
use crate::host;
use crate::vm::VmRef;

/// The configuration of this request: a matching Higress rule's, or the global one.
pub(crate) fn select_config(vm: &VmRef) -> Rc<Config> {
    let plugin = &vm.plugin;
    if plugin.rules.is_empty() {
        return plugin.global.clone();
    }
    let route = || {
        host::get_property(&["route_name"])
            .and_then(|v| String::from_utf8(v).ok())
            .unwrap_or_default()
    };
    for (m, cfg) in &plugin.rules {
        let hit = match m {
            Matcher::Route(names) => {
                let r = route();
                names.contains(&r)
            }
            Matcher::RoutePrefix(names) => {
                let r = route();
                names.iter().any(|n| r.starts_with(n.as_str()))
            }
            Matcher::Domain(patterns) => {
                let authority =
                    host::get_header(MapType::HttpRequestHeaders, ":authority").unwrap_or_default();
                let authority = String::from_utf8_lossy(&authority);
                let hostname = authority.rsplit_once(':').map_or(&*authority, |(h, p)| {
                    if p.bytes().all(|c| c.is_ascii_digit()) {
                        h
                    } else {
                        &authority
                    }
                });
                patterns
                    .iter()
                    .any(|p| crate::config::domain_matches(p, hostname))
            }
            Matcher::Service(names) => {
                let c = host::get_property(&["cluster_name"])
                    .and_then(|v| String::from_utf8(v).ok())
                    .unwrap_or_default();
                names
                    .iter()
                    .any(|n| c == *n || c.ends_with(&format!("||{n}")))
            }
        };
        if hit {
            return cfg.clone();
        }
    }
    plugin.global.clone()
}
