//! The root context: configuration, metrics, and the feed sync of the lease holder.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvroute::approx::TextTable;
use kvroute::feed::Page;
use kvroute::mirror::{self, Keys, SyncError};
use kvroute::select::SplitMix64;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, MapType};

use crate::config::{self, millis, Mode};
use crate::host::{self, HostStore};
use crate::http::Http;
use crate::report::Sent;
use crate::vm::{MetaCache, Metrics, NoTokenizer, Scratch, Vm, VmRef};

/// Failed feed pulls in a row after which the lease holder moves to the next feed cluster:
/// one lost pull is a blip, two at the sync period are a collector that is gone.
const FAILOVER_AFTER: u32 = 2;

pub(crate) struct Root {
    vm: Option<VmRef>,
    /// The feed callout in flight, if any, and when it was sent (ms).
    in_flight: Option<(u32, u64)>,
    /// Index into `Config::feed_clusters` of the collector the feed is pulled from.
    feed_cluster: usize,
    /// Feed pulls failed in a row on it.
    feed_failures: u32,
    /// The `/v1/load` report in flight: its token, when it was sent (ms), and what it said
    /// (stored as this gateway's share of the fleet once accepted).
    report: Option<(u32, u64, Sent)>,
    /// The last load report's time plus the speculative time-to-live: own speculative
    /// entries expiring after it were written since, and go in the next report.
    holds_after: u64,
    /// Block holds applied in the current tick.
    blocks_this_tick: u64,
    ticks: Cell<u64>,
    last_error_log_ms: u64,
    /// Whether the last feed page's load totals left this gateway's own report out (a
    /// collector that honours `gateway=`): own reports are then not subtracted again.
    totals_exclude_own: bool,
    /// Per-phase timing, from the VM configuration (`crate::timing`).
    timing: bool,
}

impl Root {
    pub fn new() -> Root {
        Root {
            vm: None,
            in_flight: None,
            feed_cluster: 0,
            feed_failures: 0,
            report: None,
            holds_after: 0,
            blocks_this_tick: 0,
            ticks: Cell::new(0),
            last_error_log_ms: 0,
            totals_exclude_own: false,
            timing: false,
        }
    }

    fn lease_ms(cfg: &config::Config) -> u64 {
        let (sync, feed) = (millis(cfg.sync_interval), millis(cfg.feed_timeout));
        sync.saturating_mul(3)
            .max(feed.saturating_add(sync.saturating_mul(2)))
    }

    /// Pulls the next feed page.
    fn pull(&mut self, vm: &Vm) {
        let cfg = vm.config();
        let store = HostStore;
        let query = match mirror::read_state(&store, &vm.keys) {
            Ok((s, _)) => s.feed_query(),
            Err(_) => String::new(),
        };
        let mut path = format!("/v1/feed{query}");
        // With fleet load, ask for the totals without our own report: we add our live books.
        if let Some(id) = cfg.fleet.then(|| crate::report::gateway_id(vm)).flatten() {
            path.push(if query.is_empty() { '?' } else { '&' });
            path.push_str("gateway=");
            crate::report::push_url_encoded(&mut path, &id);
        }
        let auth = cfg.read_token.as_ref().map(|t| format!("Bearer {t}"));
        let mut headers = vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", cfg.authority.as_str()),
        ];
        if let Some(a) = auth.as_deref() {
            headers.push(("authorization", a));
        }
        let cluster = self.feed_cluster(cfg);
        match host::http_call(cluster, headers, None, cfg.feed_timeout) {
            Some(token) => self.in_flight = Some((token, host::now_ms())),
            None => {
                host::increment_metric(vm.metrics.feed_errors, 1);
                let msg = format!("kvroute: cannot call cluster `{cluster}` for the feed");
                self.log_error(&msg);
                self.feed_failed(vm);
            }
        }
    }

    /// The cluster the feed is pulled from (and load reports sent to).
    fn feed_cluster<'c>(&self, cfg: &'c config::Config) -> &'c str {
        cfg.feed_clusters
            .get(self.feed_cluster)
            .unwrap_or(&cfg.cluster)
    }

    /// One more failed pull; after [`FAILOVER_AFTER`] in a row, the next feed cluster
    /// takes over. A collector of the same NATS stream takes the cursor over (a handover
    /// page: no snapshot); any other answers a snapshot, switched in whole, and until it is
    /// the index already held serves.
    fn feed_failed(&mut self, vm: &Vm) {
        self.feed_failures += 1;
        let clusters = &vm.config().feed_clusters;
        if self.feed_failures < FAILOVER_AFTER || clusters.len() < 2 {
            return;
        }
        let from = self.feed_cluster(vm.config()).to_owned();
        self.feed_cluster = (self.feed_cluster + 1) % clusters.len();
        self.feed_failures = 0;
        host::increment_metric(vm.metrics.collector_failovers, 1);
        log::warn!(
            "kvroute: collector cluster `{from}` failed {} feed pulls in a row; now `{}`",
            FAILOVER_AFTER,
            self.feed_cluster(vm.config())
        );
    }

    fn log_error(&mut self, msg: &str) {
        // At most one line per second per VM: a collector that is down must not flood logs.
        let now = host::now_ms();
        if now.saturating_sub(self.last_error_log_ms) >= 1000 {
            self.last_error_log_ms = now;
            log::warn!("{msg}");
        }
    }

    fn on_feed(&mut self, vm: &Vm, num_headers: usize, body_size: usize) {
        let status = (num_headers > 0)
            .then(|| host::get_header(MapType::HttpCallResponseHeaders, ":status"))
            .flatten()
            .and_then(|s| {
                std::str::from_utf8(&s)
                    .ok()
                    .and_then(|s| s.parse::<u16>().ok())
            });
        if status != Some(200) {
            host::increment_metric(vm.metrics.feed_errors, 1);
            self.log_error(&format!("kvroute: feed pull failed (status {status:?})"));
            self.feed_failed(vm);
            return;
        }
        let body =
            host::get_buffer(BufferType::HttpCallResponseBody, 0, body_size).unwrap_or_default();
        host::increment_metric(vm.metrics.feed_bytes, body.len() as i64);
        let page = match Page::decode(&body) {
            Ok(p) => p,
            Err(e) => {
                host::increment_metric(vm.metrics.feed_errors, 1);
                self.log_error(&format!("kvroute: bad feed page: {e}"));
                self.feed_failed(vm);
                return;
            }
        };
        self.feed_failures = 0;
        host::increment_metric(vm.metrics.feed_pages, 1);
        let cfg = vm.config();
        let now = host::now_ms();
        let excludes = host::get_header(
            MapType::HttpCallResponseHeaders,
            kvroute::feed::LOAD_EXCLUDES_HEADER,
        );
        self.totals_exclude_own = excludes
            .is_some_and(|v| crate::report::gateway_id(vm).is_some_and(|id| v == id.as_bytes()));
        let replica = host::get_header(
            MapType::HttpCallResponseHeaders,
            kvroute::feed::REPLICA_HEADER,
        )
        .and_then(|v| String::from_utf8(v).ok())
        .and_then(|v| kvroute::router::Replica::parse(&v))
        .unwrap_or_default();
        crate::report::take_fleet(vm, &page, now, self.totals_exclude_own, replica);
        match mirror::apply_page(&HostStore, &vm.keys, &cfg.limits, &page, now) {
            Ok(applied) => {
                self.take_peer_holds(vm, &page, now);
                self.blocks_this_tick += applied.stats.blocks;
                host::increment_metric(vm.metrics.bucket_full, applied.stats.bucket_full as i64);
                if applied.handover {
                    host::increment_metric(vm.metrics.handovers, 1);
                    log::info!(
                        "kvroute: feed taken over by another collector of the stream (epoch {}, cursor {})",
                        page.epoch,
                        page.cursor
                    );
                }
                if applied.switched {
                    host::increment_metric(vm.metrics.resyncs, 1);
                    log::info!(
                        "kvroute: index switched in (epoch {}, cursor {})",
                        page.epoch,
                        page.cursor
                    );
                }
                if applied.more && self.blocks_this_tick < cfg.max_blocks_per_tick {
                    self.pull(vm);
                }
            }
            Err(e @ (SyncError::EpochMismatch { .. } | SyncError::HandoverRefused(_))) => {
                // The cursor was dropped: ask for a snapshot right away.
                log::info!("kvroute: {e}; asking for a snapshot");
                self.pull(vm);
            }
            Err(e) => {
                host::increment_metric(vm.metrics.feed_errors, 1);
                self.log_error(&format!("kvroute: feed page not applied: {e}"));
            }
        }
        self.report_lag(vm);
    }

    /// Adds the other gateways' decisions a page carries (op `Held`) to the speculative
    /// table, when their worker slots are those of the index this gateway routes on.
    fn take_peer_holds(&self, vm: &Vm, page: &Page, now: u64) {
        if vm.config().speculative_ttl.is_zero()
            || !page
                .ops
                .iter()
                .any(|o| matches!(o, kvroute::feed::Op::Held { .. }))
        {
            return;
        }
        let routed_on = mirror::read_state(&HostStore, &vm.keys)
            .ok()
            .filter(|(s, _)| s.has_index && s.epoch == page.epoch);
        if routed_on.is_none() {
            return;
        }
        match kvroute::router::take_peer_holds(&HostStore, &vm.keys, &page.ops, now) {
            Ok(t) => {
                host::increment_metric(vm.metrics.peer_holds, t.stored.into());
                host::increment_metric(vm.metrics.speculative_evictions, t.evicted.into());
            }
            Err(e) => log::debug!("kvroute: other gateways' decisions not stored: {e}"),
        }
    }

    /// Posts this Envoy's in-flight counts, one report at a time.
    fn send_report(&mut self, vm: &Vm, now: u64) {
        let cfg = vm.config();
        if !cfg.fleet {
            return;
        }
        if let Some((_, sent, _)) = &self.report {
            if now.saturating_sub(*sent) <= millis(cfg.feed_timeout).saturating_mul(2) + 1000 {
                return;
            }
        }
        let holds_after = self.holds_after;
        self.report = crate::report::send(vm, self.feed_cluster(cfg), now, holds_after)
            .map(|(t, r)| (t, now, r));
        if self.report.is_some() {
            // Less a millisecond: an entry written later in this same one is sent twice
            // rather than never.
            self.holds_after = now
                .saturating_add(millis(cfg.speculative_ttl))
                .saturating_sub(1);
        }
    }

    fn report_lag(&self, vm: &Vm) {
        if let Ok((s, _)) = mirror::read_state(&HostStore, &vm.keys) {
            let lag = if s.has_index {
                host::now_ms().saturating_sub(s.synced_at_ms)
            } else {
                u32::MAX as u64
            };
            host::record_metric(vm.metrics.sync_lag_ms, lag);
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        // A feed page or a report's answer is written to the state and the fleet totals.
        if let Some(vm) = &self.vm {
            vm.forget_recent();
        }
        if self.report.as_ref().map(|r| r.0) == Some(token_id) {
            if let (Some((_, _, sent)), Some(vm)) = (self.report.take(), self.vm.clone()) {
                crate::report::on_answer(&vm, num_headers, &sent, !self.totals_exclude_own);
            }
            return;
        }
        if self.in_flight.map(|(t, _)| t) != Some(token_id) {
            return;
        }
        self.in_flight = None;
        if let Some(vm) = self.vm.clone() {
            self.on_feed(&vm, num_headers, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, vm_configuration_size: usize) -> bool {
        let raw = host::get_buffer(BufferType::VmConfiguration, 0, vm_configuration_size)
            .unwrap_or_default();
        match crate::timing::parse_vm_config(&raw) {
            Ok(on) => {
                self.timing = on;
                true
            }
            Err(e) => {
                host::log(proxy_wasm::types::LogLevel::Error, &e);
                false
            }
        }
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let raw = host::get_buffer(
            BufferType::PluginConfiguration,
            0,
            plugin_configuration_size,
        )
        .unwrap_or_default();
        let plugin = match config::parse_plugin(&raw) {
            Ok(p) => p,
            Err(e) => {
                // Logged at error level whatever the configured level: Envoy rejects the config.
                host::log(proxy_wasm::types::LogLevel::Error, &e.to_string());
                return false;
            }
        };
        log::set_max_level(plugin.global.log_level);
        let name = host::get_property(&["plugin_name"])
            .and_then(|n| String::from_utf8(n).ok())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "kvroute".to_owned());
        let keys = Keys::new(&name);
        let vm_id =
            mirror::next_vm_id(&HostStore, &keys).unwrap_or_else(|_| host::now_ms() | 1 << 63);
        let seed = plugin
            .global
            .random_seed
            .unwrap_or(vm_id ^ host::now_ms().rotate_left(17));
        let mode = plugin.global.mode;
        let interval = plugin.global.sync_interval;
        let text = &plugin.global.text;
        let text_table = TextTable::new(
            &format!("{}/text", keys.prefix()),
            text.max_entries,
            millis(text.ttl),
        );
        self.vm = Some(Rc::new(Vm {
            plugin,
            keys,
            metrics: Metrics::define(),
            vm_id: Cell::new(vm_id),
            rng: RefCell::new(SplitMix64(seed)),
            cache: RefCell::new(MetaCache::default()),
            scratch: RefCell::new(Scratch::default()),
            no_tokenizer: RefCell::new(NoTokenizer::default()),
            recent: RefCell::default(),
            text_table,
            timing: crate::timing::Timing::define(self.timing),
        }));
        if mode == Mode::Local && !host::set_tick_period(interval) {
            log::warn!("kvroute: cannot set the tick period");
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(vm) = self.vm.clone() else { return };
        // The lease holder may write the state below; the others read it fresh once a tick.
        vm.forget_recent();
        // Every VM adds what its requests counted to the report's shared totals.
        crate::report::flush(&vm);
        self.ticks.set(self.ticks.get() + 1);
        self.blocks_this_tick = 0;
        let cfg = vm.config();
        let now = host::now_ms();
        if let Some((_, sent)) = self.in_flight {
            // The host answers every callout (a timeout is an answer); this only guards a
            // host that loses one.
            if now.saturating_sub(sent) <= millis(cfg.feed_timeout).saturating_mul(2) + 1000 {
                self.report_lag(&vm);
                return;
            }
            self.in_flight = None;
        }
        match mirror::acquire_lease(
            &HostStore,
            &vm.keys,
            vm.vm_id.get(),
            now,
            Self::lease_ms(cfg),
        ) {
            Ok(true) => {
                self.pull(&vm);
                self.send_report(&vm, now);
            }
            Ok(false) => self.report_lag(&vm),
            Err(e) => self.log_error(&format!("kvroute: lease: {e}")),
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        match &self.vm {
            Some(vm) => Some(Box::new(Http::new(vm.clone(), context_id))),
            None => Some(Box::new(Http::passthrough(context_id))),
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
