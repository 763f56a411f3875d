//! Remote mode: a `/query` callout per request, and the route on the collector's answer
//! (booked per instance, since the collector's answer names instances, not mirror slots).

use kvroute::api::{QueryRequest, QueryResponse};
use kvroute::router::{self, Field, Verdict};
use proxy_wasm::types::{Action, BufferType, MapType};

use super::{Http, Phase, Res, Tok};
use crate::books;
use crate::config::Config;
use crate::host;
use crate::outcome::Outcome;
use crate::vm::{Scratch, VmRef};

impl Http {
    pub(super) fn call_remote(
        &mut self,
        vm: &VmRef,
        cfg: &Config,
        scratch: &mut Scratch,
        served: &str,
        tenant: &str,
        salt: Option<&str>,
    ) -> Action {
        let tokens: &[u32] = match self.tokens {
            Res::Done(Some(Tok::Str)) => &scratch.str_tokens,
            Res::Done(Some(Tok::Body(s, e))) => scratch.body_tokens.get(s..e).unwrap_or_default(),
            _ => &[],
        };
        let req = QueryRequest {
            token_ids: tokens.to_vec(),
            model_name: served.to_owned(),
            tenant_id: Some(tenant.to_owned()),
            lora_name: None,
            cache_salt: salt.map(str::to_owned),
        };
        let Ok(body) = serde_json::to_vec(&req) else {
            self.finish(vm, Outcome::CollectorError);
            return Action::Continue;
        };
        match call_query(cfg, &body) {
            Some(token) => {
                self.callout = Some(token);
                self.phase = Phase::WaitingCallout;
                Action::Pause
            }
            None => {
                self.finish(vm, Outcome::CollectorError);
                Action::Continue
            }
        }
    }

    pub(super) fn on_query_response(
        &mut self,
        vm: &VmRef,
        cfg: &Config,
        num_headers: usize,
        body_size: usize,
    ) {
        match query_answer(num_headers, body_size) {
            Ok(resp) => self.route_answer(vm, cfg, &resp),
            // `/query` answers 404 for a model no engine is registered for: what the local
            // mode counts as `no_match` with the name noted for the `no_model` alarm, not a
            // collector failure.
            Err(Some(404)) => {
                if let Res::Done(Some(served)) = &self.model {
                    crate::report::note_no_model(served);
                }
                self.finish(vm, Outcome::NoMatch);
            }
            Err(status) => {
                log::debug!("kvroute[{}]: /query failed (status {status:?})", self.id);
                self.finish(vm, Outcome::CollectorError);
            }
        }
    }

    /// Routes on a collector's `/query` answer, booking per instance.
    pub(super) fn route_answer(&mut self, vm: &VmRef, cfg: &Config, resp: &QueryResponse) {
        // Remote mode books per instance, which the fleet's per-worker totals do not name:
        // its own books only.
        let picture = books::picture(vm, cfg, host::now_ms());
        let query = router::Query {
            blocks: resp.query_blocks,
            block_size: resp.block_size.max(1),
        };
        let verdict = match vm.rng.try_borrow_mut() {
            Ok(mut rng) => {
                router::route(Field::Answer(resp), query, &picture, &cfg.policy, &mut *rng).verdict
            }
            Err(_) => Verdict::NoMatch,
        };
        self.conclude(vm, cfg, picture, verdict, query.block_size);
    }
}

/// Sends `POST /query` with `body` to the collector, with the read token when configured;
/// the callout's token (`None`: the call could not be made). Every `/query` callout (token
/// ids in remote mode, text in both modes) goes through here.
pub(super) fn call_query(cfg: &Config, body: &[u8]) -> Option<u32> {
    let auth = cfg.read_token.as_ref().map(|t| format!("Bearer {t}"));
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/query"),
        (":authority", cfg.authority.as_str()),
        ("content-type", "application/json"),
    ];
    if let Some(a) = auth.as_deref() {
        headers.push(("authorization", a));
    }
    host::http_call(&cfg.cluster, headers, Some(body), cfg.query_timeout)
}

/// The `/query` callout's answer: the parsed body of a 200, else the status (`None`: no
/// answer, a timeout or a reset; `Some(200)`: a body that does not parse).
pub(super) fn query_answer(
    num_headers: usize,
    body_size: usize,
) -> Result<QueryResponse, Option<u16>> {
    let status = (num_headers > 0)
        .then(|| host::get_header(MapType::HttpCallResponseHeaders, ":status"))
        .flatten()
        .and_then(|s| {
            std::str::from_utf8(&s)
                .ok()
                .and_then(|s| s.parse::<u16>().ok())
        });
    if status != Some(200) {
        return Err(status);
    }
    let body = host::get_buffer(BufferType::HttpCallResponseBody, 0, body_size).unwrap_or_default();
    serde_json::from_slice::<QueryResponse>(&body).map_err(|_| status)
}
