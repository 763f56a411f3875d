//! Text requests: no token ids, a completions `prompt` string or chat `messages`.
//!
//! 1. The canonical text is read and chain-hashed ([`kvroute::approx`]); text that cannot be
//!    read fails open (`bad_text`).
//! 2. Exact: the collector tokenizes the text (`POST /query` with the prompt or the messages
//!    passed on verbatim) and answers like a token query; the answer goes through the local
//!    roster and books (local mode) or the remote path. This is the one callout local mode
//!    makes per request. A 404 (no tokenizer for the model) is remembered per model for
//!    `text.no_tokenizer_ttl_ms`; a 404, a timeout or any other failure falls to 3.
//! 3. Approximate: the engines recorded for the longest prefix of the chain
//!    ([`approx::TextTable::lookup`]) become matches for the same `router::route` as token
//!    requests, with `CHARS_PER_TOKEN` characters counted as a token. It
//!    needs the engine list of the local index: in remote mode, or before the
//!    first sync, the request goes on unrouted (`no_match`, `stale_index`). Its index may be
//!    stale (the collector down): the table is the filter's own knowledge.
//!
//! Every text decision, exact or approximate, records its engine in the table, so approximate
//! mode learns from exact answers too; and an exact answer takes the table's decisions younger
//! than `route.speculative_ttl_ms` as held, so a burst of siblings sharing a prompt follows
//! the first before the engine's KV events reach the collector.

use kvroute::api::QueryResponse;
use kvroute::approx::{self, CHARS_PER_TOKEN};
use kvroute::event::WorkerId;
use kvroute::lookup::WorkerMatch;
use kvroute::mirror::{self, CAS_RETRIES};
use kvroute::router::{self, Field, Verdict};
use kvroute::scope::ScopeId;
use proxy_wasm::types::Action;

use super::remote::{call_query, query_answer};
use super::{Http, Phase, Text, TextPath, TextScope};
use crate::books;
use crate::config::{millis, Config, Mode};
use crate::host::{self, HostStore};
use crate::outcome::Outcome;
use crate::vm::{Scratch, VmRef};

/// Most character blocks hashed (64 Mi characters at 128 per block; the body limit comes
/// first).
const MAX_TEXT_BLOCKS: usize = 1 << 19;

/// The decision's block size in estimated tokens.
fn text_block_tokens(cfg: &Config) -> u32 {
    (cfg.text.block_chars / CHARS_PER_TOKEN).max(1)
}

impl Http {
    /// A text request's decision: the exact callout, or approximate mode at once.
    pub(super) fn decide_text(
        &mut self,
        vm: &VmRef,
        cfg: &Config,
        scratch: &mut Scratch,
        text: Text<'_>,
        scope: TextScope,
    ) -> Action {
        let canon = &mut scratch.text;
        let read = match text {
            Text::Prompt { raw, escaped, .. } => approx::prompt_text(raw, escaped, canon),
            Text::Messages { json } => {
                approx::messages_text(json, cfg.text.max_messages as usize, canon)
            }
        };
        if let Err(e) = read {
            log::debug!("kvroute[{}]: text not routed: {e}", self.id);
            self.finish(vm, Outcome::BadText);
            return Action::Continue;
        }
        let seed = approx::text_seed(ScopeId::of(
            &scope.tenant,
            &scope.served,
            None,
            scope.salt.as_deref(),
        ));
        let chars = approx::chain_hashes(
            canon,
            cfg.text.block_chars as usize,
            seed,
            MAX_TEXT_BLOCKS,
            &mut self.text_hashes,
        );
        self.query_tokens = (chars / CHARS_PER_TOKEN as usize).min(u32::MAX as usize) as u32;
        let now = host::now_ms();
        let skip = vm
            .no_tokenizer
            .try_borrow()
            .is_ok_and(|n| n.contains(&scope.served, now));
        if cfg.text.exact && skip {
            host::increment_metric(vm.metrics.text.callouts_skipped, 1);
        }
        if cfg.text.exact && !skip {
            if let Some(token) = self.call_text(cfg, text, &scope) {
                self.text = Some(scope);
                self.callout = Some(token);
                self.phase = Phase::WaitingCallout;
                return Action::Pause;
            }
            host::increment_metric(vm.metrics.text.exact_errors, 1);
        }
        self.text = Some(scope);
        self.fall_back(vm, cfg, Outcome::CollectorError);
        Action::Continue
    }

    /// Sends `/query` with the text; the callout token.
    fn call_text(&self, cfg: &Config, text: Text<'_>, scope: &TextScope) -> Option<u32> {
        // The prompt string and the messages array go on as the client's bytes (checked
        // well-formed by the scanner); the names are escaped by serde.
        let mut body = Vec::with_capacity(256);
        body.extend_from_slice(b"{\"model_name\":");
        serde_json::to_writer(&mut body, &scope.served).ok()?;
        body.extend_from_slice(b",\"tenant_id\":");
        serde_json::to_writer(&mut body, &scope.tenant).ok()?;
        if let Some(salt) = &scope.salt {
            body.extend_from_slice(b",\"cache_salt\":");
            serde_json::to_writer(&mut body, salt).ok()?;
        }
        match text {
            Text::Prompt { json, .. } => {
                body.extend_from_slice(b",\"prompt\":");
                body.extend_from_slice(json);
            }
            Text::Messages { json } => {
                body.extend_from_slice(b",\"messages\":");
                body.extend_from_slice(json);
            }
        }
        body.push(b'}');
        call_query(cfg, &body)
    }

    /// The collector's answer to a text query.
    pub(super) fn on_text_answer(
        &mut self,
        vm: &VmRef,
        cfg: &Config,
        num_headers: usize,
        body_size: usize,
    ) {
        match query_answer(num_headers, body_size) {
            Ok(resp) => {
                host::increment_metric(vm.metrics.text.exact, 1);
                self.text_path = Some(TextPath::Exact);
                if cfg.mode == Mode::Local && self.route_answer_local(vm, cfg, &resp) {
                    return;
                }
                self.query_tokens = resp
                    .query_blocks
                    .saturating_mul(resp.block_size.max(1))
                    .max(self.query_tokens);
                self.route_answer(vm, cfg, &resp);
            }
            Err(Some(404)) => {
                let served = self.text.as_ref().map_or("", |s| s.served.as_str());
                log::debug!("kvroute[{}]: no tokenizer for `{served}`", self.id);
                host::increment_metric(vm.metrics.text.no_tokenizer, 1);
                let until = host::now_ms().saturating_add(millis(cfg.text.no_tokenizer_ttl));
                if let Ok(mut n) = vm.no_tokenizer.try_borrow_mut() {
                    n.insert(served, until);
                }
                self.fall_back(vm, cfg, Outcome::NoMatch);
            }
            Err(status) => {
                log::debug!("kvroute[{}]: text /query failed ({status:?})", self.id);
                host::increment_metric(vm.metrics.text.exact_errors, 1);
                self.fall_back(vm, cfg, Outcome::CollectorError);
            }
        }
    }

    /// Approximate mode, or `why` when it is off.
    fn fall_back(&mut self, vm: &VmRef, cfg: &Config, why: Outcome) {
        if cfg.text.approx {
            self.approximate(vm, cfg);
        } else {
            self.finish(vm, why);
        }
    }

    /// Local mode's route on an exact answer: the answer's instances become matches of the
    /// mirror's worker slots, so the decision sees every instance (cold ones too) and books
    /// per slot like token requests. `false` when none of the answer's instances is in the
    /// mirror (not synced yet): the caller takes the remote path.
    fn route_answer_local(&mut self, vm: &VmRef, cfg: &Config, resp: &QueryResponse) -> bool {
        let store = HostStore;
        let Ok((state, _)) = mirror::read_state(&store, &vm.keys) else {
            return false;
        };
        let Ok(mut cache) = vm.cache.try_borrow_mut() else {
            return false;
        };
        cache.refresh(&store, &vm.keys, &state);
        let Some(scope) = self.text.clone() else {
            return false;
        };
        let Some(mut matches) = router::answer_on_roster(resp, &cache.roster) else {
            return false;
        };
        let bs = u64::from(resp.block_size.max(1));
        // Text decisions younger than the speculative time-to-live count as held (GPU tier),
        // as for token requests: siblings arriving before the engine's KV events follow.
        // Their characters are converted to the answer's blocks and never exceed the query.
        if !cfg.speculative_ttl.is_zero() {
            let now = host::now_ms();
            let since = now.saturating_sub(millis(cfg.speculative_ttl));
            let recent = vm
                .text_table
                .lookup_since(&store, &self.text_hashes, now, since);
            let chars_per_block = u64::from(CHARS_PER_TOKEN) * bs;
            for (slot, depth) in recent.holders {
                let est = u64::from(depth) * u64::from(cfg.text.block_chars) / chars_per_block;
                router::hold(
                    &mut matches,
                    slot,
                    est.min(u64::from(resp.query_blocks)) as u32,
                );
            }
        }
        let (model, _) = cache.meta.resolve(&scope.tenant, &scope.served);
        let model = model.to_owned();
        drop(cache);
        self.query_tokens = resp.query_blocks.saturating_mul(resp.block_size.max(1));
        let query = router::Query {
            blocks: resp.query_blocks,
            block_size: resp.block_size.max(1),
        };
        self.decide_on(vm, cfg, &matches, &scope.tenant, &model, query);
        true
    }

    /// Approximate mode: the recorded holders of the text's longest prefix.
    fn approximate(&mut self, vm: &VmRef, cfg: &Config) {
        self.text_path = Some(TextPath::Approx);
        if cfg.mode != Mode::Local {
            self.finish(vm, Outcome::NoMatch);
            return;
        }
        let store = HostStore;
        let state = match mirror::read_state(&store, &vm.keys) {
            Ok((s, _)) if s.has_index => s,
            _ => {
                self.finish(vm, Outcome::StaleIndex);
                return;
            }
        };
        let Some(scope) = self.text.clone() else {
            self.finish(vm, Outcome::NoMatch);
            return;
        };
        let model = match vm.cache.try_borrow_mut() {
            Ok(mut cache) => {
                cache.refresh(&store, &vm.keys, &state);
                cache
                    .meta
                    .resolve(&scope.tenant, &scope.served)
                    .0
                    .to_owned()
            }
            Err(_) => {
                self.finish(vm, Outcome::NoMatch);
                return;
            }
        };
        let found = vm
            .text_table
            .lookup(&store, &self.text_hashes, host::now_ms());
        self.reads = found.reads;
        let matches: Vec<WorkerMatch> = found
            .holders
            .iter()
            .map(|&(slot, d)| WorkerMatch {
                worker: WorkerId(slot),
                blocks: [d; 3],
            })
            .collect();
        host::increment_metric(vm.metrics.text.approx, 1);
        let query = router::Query {
            blocks: u32::try_from(self.text_hashes.len()).unwrap_or(u32::MAX),
            block_size: text_block_tokens(cfg),
        };
        self.decide_on(vm, cfg, &matches, &scope.tenant, &model, query);
    }

    /// The local decision over the roster with `matches`, then the route, the books and the
    /// record of the text's prefixes.
    fn decide_on(
        &mut self,
        vm: &VmRef,
        cfg: &Config,
        matches: &[WorkerMatch],
        tenant: &str,
        model: &str,
        query: router::Query,
    ) {
        let now = host::now_ms();
        let Ok(cache) = vm.cache.try_borrow() else {
            self.finish(vm, Outcome::NoMatch);
            return;
        };
        let picture = books::picture(vm, cfg, now);
        let field = Field::Roster {
            roster: &cache.roster,
            matches,
            tenant,
            model,
        };
        let verdict = match vm.rng.try_borrow_mut() {
            Ok(mut rng) => router::route(field, query, &picture, &cfg.policy, &mut *rng).verdict,
            Err(_) => Verdict::NoMatch,
        };
        drop(cache);
        let Some(slot) = (match &verdict {
            Verdict::Route { target, .. } => target.slot(),
            _ => None,
        }) else {
            return self.conclude(vm, cfg, picture, verdict, query.block_size);
        };
        let rec = vm
            .text_table
            .record(&HostStore, &self.text_hashes, slot, now, CAS_RETRIES);
        host::increment_metric(vm.metrics.text.evictions, rec.evicted.into());
        host::increment_metric(vm.metrics.text.lost_writes, rec.lost.into());
        self.conclude(vm, cfg, picture, verdict, query.block_size);
    }
}
