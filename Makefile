# kvroute — the two commands are `make demo` and `make test`.
#
# Everything a fresh machine lacks is installed here: the wasm32-wasip1 target (rustup), a C++
# compiler for the vendored libzmq (apt-get, when absent) and a Python venv with Envoy 1.40
# (envoy-config/install-envoy.sh). Builds use two jobs: the
# machines this runs on have two cores.

CARGO      ?= cargo
JOBS       ?= 2
TARGET_DIR ?= $(if $(CARGO_TARGET_DIR),$(CARGO_TARGET_DIR),target)
WASM_OUT   := $(TARGET_DIR)/wasm32-wasip1/release
# The Higress build has other features: it gets a target dir of its own so that the stock and
# Higress builds do not invalidate each other's artifacts.
HIGRESS_TARGET_DIR := $(TARGET_DIR)/higress
# The filter without wasm SIMD (.cargo/config.toml turns it on), for a runtime that refuses it.
SCALAR_TARGET_DIR := $(TARGET_DIR)/scalar
# Test fixtures of the host-test crate: every package under host-test/fixtures/.
FIXTURES   := $(foreach f,$(wildcard host-test/fixtures/*/Cargo.toml),-p $(shell sed -n 's/^name *= *"\(.*\)"/\1/p' $(f) | head -n1))

export CARGO_TERM_COLOR ?= never

# The dev-profile collector and simulator the end-to-end, soak and UI tests run (and the JS
# tests' hash_cli). Alone, a target builds just those. `make test` passes TEST_BINS instead: the
# `cargo test --no-run` that test-rust has already done, whose binaries are uplifted to the same
# paths. One feature set for the whole run, so the dependencies are not compiled a second and a
# third time for `-p` builds with fewer features (about 5 minutes of CI on two cores).
DEV_BINS  ?= $(CARGO) build -j$(JOBS) -p kvroute-collector -p kvroute-sim
HASH_CLI  ?= $(CARGO) build -j$(JOBS) -p kvroute --example hash_cli
TEST_BINS := $(CARGO) test -j$(JOBS) --workspace --no-run

.PHONY: all setup wasm wasm-unbooked wasm-floor native lint layout test test-rust test-e2e bench bench-routing bench-routing-scenarios bench-collector bench-ingest-stall bench-soak bench-latency demo demo-ha clean js js-tools test-js bench-js

all: wasm native

setup:
	@rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	@# The collector links libzmq built from source (zmq-sys): it needs a C++ compiler, no libzmq package.
	@command -v c++ >/dev/null 2>&1 || { apt-get update && apt-get install -y g++; }

## make wasm: the filter at target/wasm32-wasip1/release/kvroute_filter.wasm, its Higress
## twin kvroute_filter_higress.wasm and its build without SIMD kvroute_filter_scalar.wasm beside
## it, and the host-test fixture plugins.
wasm: setup
	$(CARGO) build -j$(JOBS) --release --target wasm32-wasip1 -p kvroute-filter $(FIXTURES)
	$(CARGO) build -j$(JOBS) --release --target wasm32-wasip1 -p kvroute-filter --features higress --target-dir $(HIGRESS_TARGET_DIR)
	cp $(HIGRESS_TARGET_DIR)/wasm32-wasip1/release/kvroute_filter.wasm $(WASM_OUT)/kvroute_filter_higress.wasm
	CARGO_TARGET_WASM32_WASIP1_RUSTFLAGS="-C target-feature=-simd128" $(CARGO) build -j$(JOBS) --release --target wasm32-wasip1 -p kvroute-filter --target-dir $(SCALAR_TARGET_DIR)
	cp $(SCALAR_TARGET_DIR)/wasm32-wasip1/release/kvroute_filter.wasm $(WASM_OUT)/kvroute_filter_scalar.wasm
	@ls -l $(WASM_OUT)/kvroute_filter.wasm $(WASM_OUT)/kvroute_filter_higress.wasm $(WASM_OUT)/kvroute_filter_scalar.wasm

## Native binaries (collector, simulator) for the demo and the end-to-end tests.
native: setup
	$(CARGO) build -j$(JOBS) --profile native -p kvroute-collector -p kvroute-sim

lint: setup layout
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy -j$(JOBS) --workspace --all-targets -- -D warnings
	$(CARGO) clippy -j$(JOBS) --target wasm32-wasip1 -p kvroute -p kvroute-filter -- -D warnings
	CARGO_TARGET_WASM32_WASIP1_RUSTFLAGS="-C target-feature=-simd128" $(CARGO) clippy -j$(JOBS) --target wasm32-wasip1 -p kvroute --target-dir $(SCALAR_TARGET_DIR) -- -D warnings
	$(CARGO) rustdoc -j$(JOBS) -p kvroute --lib -- -D missing_docs

## The layout rules (no import cycle between a crate's files, no oversized file without a
## reason): tools/layout_check.py.
layout:
	python3 tools/layout_check_test.py
	python3 tools/layout_check.py

## make test: lint, the wasm build, the core's intake and hashing as wasm in Node's V8, every
## Rust test, the end-to-end tests through Envoy, the short chaos soak, the JavaScript package's
## Node tests and the fleet page in headless Chromium.
test: lint wasm
	$(MAKE) test-wasm-core
	$(MAKE) check-rules
	$(MAKE) test-rust
	$(MAKE) test-e2e DEV_BINS="$(TEST_BINS)"
	$(MAKE) test-soak-ha DEV_BINS="$(TEST_BINS)"
	$(MAKE) test-js HASH_CLI="$(TEST_BINS)"
	$(MAKE) test-ui DEV_BINS="$(TEST_BINS)"

## The Prometheus alerting rules of the collector's alarms, checked by promtool.
check-rules:
	bash tools/install-promtool.sh
	promtool check rules dashboards/alerts.yaml
.PHONY: check-rules

## The core's intake and hashing tests built for wasm32-wasip1 with SIMD on, as the filter
## ships, and run in Node's V8 with liftoff off, as Envoy runs the filter: the SIMD byte-class
## masks against the byte loop, the scanner against serde_json, the hash vectors.
WASI_RUNNER := node --no-liftoff --no-warnings $(CURDIR)/tools/wasi-node.mjs
test-wasm-core:
	CARGO_TARGET_WASM32_WASIP1_RUNNER="$(WASI_RUNNER)" $(CARGO) test -j$(JOBS) -p kvroute --target wasm32-wasip1 --lib -- intake:: hash::
	CARGO_TARGET_WASM32_WASIP1_RUNNER="$(WASI_RUNNER)" $(CARGO) test -j$(JOBS) -p kvroute --target wasm32-wasip1 --test intake_props --test hash_vectors
.PHONY: test-wasm-core

# The collector's NATS tests (collector/tests/nats.rs, dynamo.rs) start a real nats-server -js.
test-rust:
	bash tools/install-nats-server.sh >/dev/null
	$(CARGO) test -j$(JOBS) --workspace

## The NATS JetStream event bus and the Dynamo reader alone (part of test-rust).
test-nats:
	bash tools/install-nats-server.sh >/dev/null
	$(CARGO) test -j$(JOBS) -p kvroute-collector --test nats --test dynamo
.PHONY: test-nats

# The end-to-end tests use dev-profile binaries (their dependencies are optimized, see
# Cargo.toml); under `make test`, the ones test-rust already built (DEV_BINS above).
test-e2e: wasm
	$(DEV_BINS)
	bash envoy-config/install-envoy.sh >/dev/null
	KVROUTE_PROFILE=debug python3 envoy-config/e2e_test.py
	KVROUTE_PROFILE=debug python3 envoy-config/e2e_text_test.py
	KVROUTE_PROFILE=debug python3 envoy-config/e2e_alarm_test.py
	$(MAKE) test-dynamo-interop

## make test-dynamo-interop: the Dynamo reader against a real ai-dynamo 1.6.1 worker (its CPU
## mocker, installed in $(TARGET_DIR)/dynamo-venv: about a minute the first time, seconds after).
test-dynamo-interop:
	$(DEV_BINS)
	bash tools/install-nats-server.sh >/dev/null
	bash tools/install-etcd.sh >/dev/null
	KVROUTE_PROFILE=debug python3 collector/tests/dynamo_interop.py
.PHONY: test-dynamo-interop

## The filter without its load books (feature bench-unbooked), for the host bench only: the
## bookkeeping line prices the books as the difference. Never shipped.
UNBOOKED_TARGET_DIR := $(TARGET_DIR)/unbooked
wasm-unbooked: setup
	$(CARGO) build -j$(JOBS) --release --target wasm32-wasip1 -p kvroute-filter --features bench-unbooked --target-dir $(UNBOOKED_TARGET_DIR)
	cp $(UNBOOKED_TARGET_DIR)/wasm32-wasip1/release/kvroute_filter.wasm $(WASM_OUT)/kvroute_filter_unbooked.wasm

## The least a body-reading filter does (feature bench-floor), for `make bench-latency`'s
## floor line: what any wasm filter that waits for the body costs Envoy. Never shipped.
FLOOR_TARGET_DIR := $(TARGET_DIR)/floor
wasm-floor: setup
	$(CARGO) build -j$(JOBS) --release --target wasm32-wasip1 -p kvroute-filter --features bench-floor --target-dir $(FLOOR_TARGET_DIR)
	cp $(FLOOR_TARGET_DIR)/wasm32-wasip1/release/kvroute_filter.wasm $(WASM_OUT)/kvroute_filter_floor.wasm

## make bench: criterion benchmarks of the core, the collector and the filter in the host.
bench: setup wasm wasm-unbooked
	$(CARGO) bench -j$(JOBS) -p kvroute
	$(CARGO) run -j$(JOBS) --profile bench -p kvroute --example memory
	$(CARGO) bench -j$(JOBS) -p kvroute-host-test
	KVROUTE_BENCH_N=400 $(CARGO) bench -j$(JOBS) -p kvroute-filter --bench benches
	$(CARGO) bench -j$(JOBS) -p kvroute-collector

## make bench-routing: kvroute as shipped (Envoy + the filter built by `make wasm` + the
## collector) beside every other policy, three scenarios, one simulated fleet (~10 minutes).
bench-routing: wasm
	bash bench/scripts/bench-routing.sh --speed 10 --limit 2000 --engines 4

## make bench-routing-scenarios: the same comparison where the defaults were not fitted: an
## uneven split between two gateways, a slow engine, no KV events, long outputs, an engine
## failing and restarting, 16 engines, a shared-prefix workload (see bench/src/routing/scenarios.rs).
bench-routing-scenarios: wasm
	bash bench/scripts/bench-routing.sh --speed 10 --limit 500 --engines 4 \
	  --scenarios uneven,heterogeneous,no-events,decode-heavy,failure,scale,shared-prefix

## make bench-collector: ingest and /query against Dynamo's indexer (installs it in a venv).
bench-collector:
	bash bench/scripts/bench-collector.sh

## make bench-ingest-stall: /query p50/p99/max while one 3.5M-block batch is applied (~1 minute).
bench-ingest-stall:
	JOBS=$(JOBS) bash bench/scripts/bench-ingest-stall.sh

## make bench-alarm-soak: a correct fleet (4 engines, Envoy, traffic, the alarm test's short
## windows) for 20 minutes; fails on the first alarm raised (a false positive).
bench-alarm-soak: wasm
	$(CARGO) build -j$(JOBS) -p kvroute-collector -p kvroute-sim
	bash envoy-config/install-envoy.sh >/dev/null
	KVROUTE_PROFILE=debug KVROUTE_ALARM_SOAK_S=1200 KVROUTE_E2E_ONLY=healthy python3 envoy-config/e2e_alarm_test.py
.PHONY: bench-alarm-soak

## make test-soak-ha: issue 23's chaos soak, short (~4 minutes): 3 index replicas and 2 ingest
## collectors on nats-server, 16 simulated engines, 2 Envoys with the filter, the trace through
## both while a script kills collectors, restarts engines and a gateway and pauses NATS; the
## targets a short run measures reliably (envoy-config/soak_ha.py, README "Chaos soak").
test-soak-ha: wasm
	$(DEV_BINS)
	bash envoy-config/install-envoy.sh >/dev/null
	bash tools/install-nats-server.sh >/dev/null
	KVROUTE_PROFILE=debug python3 envoy-config/soak_ha.py --short

## make bench-soak-ha: the same for SOAK_HA_MINUTES (20) minutes of chaos, every target
## reported (bench-out/soak-ha/: summary.json, per_second.csv, rss.csv, a plot with
## matplotlib); exits non-zero on a missed target.
SOAK_HA_MINUTES ?= 20
bench-soak-ha: wasm
	$(CARGO) build -j$(JOBS) -p kvroute-collector -p kvroute-sim
	bash envoy-config/install-envoy.sh >/dev/null
	bash tools/install-nats-server.sh >/dev/null
	KVROUTE_PROFILE=debug python3 envoy-config/soak_ha.py --minutes $(SOAK_HA_MINUTES)
.PHONY: test-soak-ha bench-soak-ha

## make bench-soak: the collector binary, 64 simulated engines and hostile peers for
## SOAK_MINUTES (30) minutes; RSS, refusals and liveness in bench-out/soak/.
SOAK_MINUTES ?= 30
bench-soak:
	JOBS=$(JOBS) bash bench/scripts/bench-soak.sh --minutes $(SOAK_MINUTES) --engines 64

bench-latency: wasm wasm-floor native
	bash envoy-config/bench_latency.sh

## make demo: builds everything, starts a collector, simulated engines and a real Envoy,
## replays a slice of the trace through kvroute and through round-robin, prints both.
demo: wasm native
	bash envoy-config/install-envoy.sh >/dev/null
	python3 envoy-config/run.py demo --no-build

## make demo-ha: the same fleet past one collector (nats-server, 2 ingest and 3 index
## collectors, 16 engines, 2 Envoys failing over between the replicas) under 2.5 minutes of
## kills, engine restarts and a NATS pause; prints which targets held (bench-out/soak-ha-short/).
demo-ha: wasm native
	bash envoy-config/install-envoy.sh >/dev/null
	python3 envoy-config/run.py demo --ha --no-build

## --- js: the core for JavaScript (wasm-bindgen), package @kvroute/core ----------------------
##
## make js: js/pkg (package.json, web/ for browsers and bundlers, node/ for Node) and the
## browser build the collector's fleet page embeds, in collector/ui/pkg (committed to git, so
## the collector builds without wasm tools). The CLI is installed at exactly the version of the
## wasm-bindgen crate in Cargo.lock: the macro and the CLI must agree. It goes where `cargo
## install` puts tools (the cargo home), so every checkout on the machine shares one install.
CARGO_HOME_DIR := $(if $(CARGO_HOME),$(CARGO_HOME),$(HOME)/.cargo)
JS_TOOLS     := $(CARGO_HOME_DIR)
WASM_BINDGEN := $(JS_TOOLS)/bin/wasm-bindgen
WASM_BINDGEN_VERSION := $(shell sed -n '/^name = "wasm-bindgen"$$/{n;s/^version = "\(.*\)"/\1/p;}' Cargo.lock)
JS_VERSION   := $(shell sed -n 's/^version = "\(.*\)"/\1/p' js/Cargo.toml | head -n1)
JS_WASM      := $(TARGET_DIR)/wasm32-unknown-unknown/release/kvroute_js.wasm
# Panic locations carry source paths: remapped so the committed collector/ui/pkg is the same
# bytes whichever checkout or machine builds it.
JS_RUSTFLAGS := --remap-path-prefix=$(CURDIR)=kvroute --remap-path-prefix=$(CARGO_HOME_DIR)=cargo

js-tools:
	@rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown
	@# --locked first; a registry missing one of the CLI's locked dependencies makes it fail,
	@# then the dependencies resolve afresh (the CLI's own version stays pinned).
	@if [ "$$($(WASM_BINDGEN) --version 2>/dev/null)" != "wasm-bindgen $(WASM_BINDGEN_VERSION)" ]; then \
	  $(CARGO) install -j$(JOBS) --force --locked --root $(JS_TOOLS) wasm-bindgen-cli --version $(WASM_BINDGEN_VERSION) || \
	  $(CARGO) install -j$(JOBS) --force --root $(JS_TOOLS) wasm-bindgen-cli --version $(WASM_BINDGEN_VERSION); \
	fi

js: js-tools
	RUSTFLAGS="$(JS_RUSTFLAGS)" $(CARGO) build -j$(JOBS) --release --target wasm32-unknown-unknown -p kvroute-js --lib
	rm -rf js/pkg collector/ui/pkg
	$(WASM_BINDGEN) --target web --remove-name-section --out-dir js/pkg/web $(JS_WASM)
	$(WASM_BINDGEN) --target experimental-nodejs-module --remove-name-section --out-dir js/pkg/node $(JS_WASM)
	sed 's/@VERSION@/$(JS_VERSION)/' js/package.template.json > js/pkg/package.json
	mkdir -p collector/ui/pkg
	cp js/pkg/web/kvroute_js.js js/pkg/web/kvroute_js_bg.wasm js/pkg/web/kvroute_js.d.ts js/pkg/web/kvroute_js_bg.wasm.d.ts collector/ui/pkg/
	@ls -l js/pkg/web/kvroute_js_bg.wasm

## make test-js: the build, the Node tests (hash vectors, the native core on random inputs,
## intake, the decision), then the committed collector/ui/pkg must be what `make js` wrote.
test-js: js
	$(HASH_CLI)
	KVROUTE_HASH_CLI=$(TARGET_DIR)/debug/examples/hash_cli node --test js/test/
	git diff --exit-code --stat -- collector/ui/pkg
	@test -z "$$(git status --porcelain -- collector/ui/pkg)" || { echo "collector/ui/pkg has files git does not know: commit them"; exit 1; }

## make bench-js: hashes of 8k-token prompts per second in Node beside the native core.
bench-js: js
	$(CARGO) build -j$(JOBS) --profile bench -p kvroute --example hash_cli
	node js/bench.mjs
	$(TARGET_DIR)/release/examples/hash_cli --bench

clean:
	$(CARGO) clean

## make setup-browser: what the fleet page's browser test needs: Debian's `chromium` (apt-get,
## when absent) and Playwright, the Python driver only, pinned, in the venv of
## envoy-config/install-envoy.sh. Playwright drives that chromium; it downloads no browser.
PLAYWRIGHT_VERSION ?= 1.65.2
KVROUTE_VENV ?= $(CURDIR)/.venv
.PHONY: setup-browser test-ui
setup-browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }
	@KVROUTE_VENV=$(KVROUTE_VENV) bash envoy-config/install-envoy.sh >/dev/null
	@$(KVROUTE_VENV)/bin/python -c 'import importlib.metadata as m, sys; sys.exit(m.version("playwright") != "$(PLAYWRIGHT_VERSION)")' 2>/dev/null \
		|| $(KVROUTE_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "playwright==$(PLAYWRIGHT_VERSION)"

## make test-ui: the collector's fleet page in headless Chromium (token, engines, probe,
## screenshot at bench-out/ui/fleet.png) and dashboards/kvroute.json against the metrics a
## collector and an Envoy with the filter really export.
test-ui: wasm setup-browser
	$(DEV_BINS)
	KVROUTE_PROFILE=debug KVROUTE_VENV=$(KVROUTE_VENV) $(KVROUTE_VENV)/bin/python envoy-config/ui_test.py
