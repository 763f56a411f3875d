#!/usr/bin/env python3
"""End-to-end test of the collector's alarms (issue 21) through a real Envoy.

A fleet with four deliberate faults, under steady traffic through Envoy's kvroute listener
(token prompts sharing prefixes, chat requests sharing a long system prompt, requests for
an unregistered alias; the filter's speculative holders off, so the index alone predicts):
  - engine-0 is registered at an event endpoint nothing listens on (KV events off);
  - engine-1 runs with 32-token blocks, registered with 16;
  - requests name the model `sim-alias`, which no engine is registered for;
  - the collector renders chat with another chat template than the engines (a copy of the
    Qwen3 tokenizer whose template starts with extra text), so every chat prompt it
    tokenizes differs from what the engines cache.
Each fault must raise its alarm within 60 s (`engine_silent` on engine-0, `hash_mismatch`
naming `block_size` on engine-1, `no_model` for the alias, `hash_mismatch` naming
`tokenizer` on a healthy engine), and `/v1/explain` must name the causes. Then the same
fleet without the faults, under the same traffic for a short run, must raise no alarm.

Run: make wasm && cargo build -j2 -p kvroute-collector -p kvroute-sim &&
     KVROUTE_PROFILE=debug python3 envoy-config/e2e_alarm_test.py
Prints one line per test and `N passed, N failed, N skipped`; exits 1 on any failure.
"""
from __future__ import annotations

import json
import random
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvstack as K  # noqa: E402
from e2e_text_test import TOKENIZER_DIR, supports_tokenizer  # noqa: E402

ALIAS = "sim-alias"
WRONG_BLOCK_SIZE = 32
RAISE_WITHIN_S = 60.0
# How long the healthy fleet runs: 40 s in `make test`; `make bench-alarm-soak` sets
# KVROUTE_ALARM_SOAK_S=1200 for the 20-minute no-false-positive soak.
HEALTHY_RUN_S = float(__import__("os").environ.get("KVROUTE_ALARM_SOAK_S", "40"))
# Short windows so that a minute is enough; the volume floor stays well above a trickle.
COLLECTOR_ARGS = ["--alarm-silent-secs", "8", "--truth-window-secs", "30",
                  "--hash-mismatch-min-tokens", "3000", "--hash-mismatch-hold-secs", "5",
                  "--scrape-interval-secs", "0.25"]
# Speculative holders off: within their time-to-live the filter's own memory of where it sent
# a prompt routes (and predicts) its repeats right whatever the tokenizer, which would hide
# the template fault for that long; the index alone is under test.
ENVOY_VALUES = {"FILTER_EXTRA": ', "route": {"speculative_ttl_ms": 0}'}
SYSTEM_PROMPT = " ".join(
    f"Rule {i}: answer the customer of the mill politely, cite the ledger, never guess."
    for i in range(40))


class Failure(AssertionError):
    pass


def check(cond: object, msg: str) -> None:
    if not cond:
        raise Failure(msg)


class FaultyStack(K.Stack):
    """engine-1 runs with another block size than the one registered for the model."""

    def engine_argv(self, e: K.Engine) -> list[str]:
        argv = super().engine_argv(e)
        if e.name == "engine-1":
            i = argv.index("--block-size")
            argv[i + 1] = str(WRONG_BLOCK_SIZE)
        return argv


def mismatched_tokenizer(workdir: Path) -> Path:
    """A copy of the test tokenizer whose chat template renders extra text first."""
    out = workdir / "tokenizer-other-template"
    shutil.copytree(TOKENIZER_DIR, out, dirs_exist_ok=True)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "Deployment notes differ here.\n" + cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    return out


class Traffic:
    """Request loops through Envoy until stopped; failures of single requests are counted,
    not raised (the faults make some fail open by design)."""

    def __init__(self, stack: K.Stack, alias: bool, urls: list[str] | None = None):
        self.s = stack
        self.alias = alias
        # The gateways' kvroute listeners; each request goes through one picked at random.
        self.urls = urls or [stack.kvroute_url]
        self.stop = threading.Event()
        self.sent = 0
        self.errors = 0
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        rng = random.Random(21)
        self.docs = [K.random_tokens(128, rng) for _ in range(4)]

    def _count(self, r) -> None:
        with self.lock:
            self.sent += 1
            if r is None or r.status != 200:
                self.errors += 1

    def _loop(self, make) -> None:
        rng = random.Random(threading.get_ident())
        while not self.stop.is_set():
            try:
                r = make(rng)
            except Exception:  # a timeout or reset: counted, the loop goes on
                r = None
                time.sleep(0.2)
            self._count(r)

    def _tokens(self, rng: random.Random):
        prompt = rng.choice(self.docs) + K.random_tokens(32, rng)
        return self.s.completion(rng.choice(self.urls), prompt, max_tokens=100, timeout=30)

    def _chat(self, rng: random.Random):
        body = {"model": self.s.cfg.model, "max_tokens": 50,
                "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                             # At least one block of its own: a prompt entirely cached
                             # stores nothing, so the engine would send no event for it.
                             {"role": "user", "content":
                              f"Question {rng.randrange(10**9)}: look up order "
                              f"{rng.randrange(10**9)} and invoice {rng.randrange(10**9)} "
                              f"in the ledger of {rng.randrange(10**9)}, then reply."}]}
        return self.s.completion(rng.choice(self.urls), None, body=body,
                                 path="/v1/chat/completions", timeout=30)

    def _alias(self, rng: random.Random):
        time.sleep(0.3)
        body = {"model": ALIAS, "prompt": K.random_tokens(48, rng), "max_tokens": 1}
        return self.s.completion(self.s.kvroute_url, None, body=body, timeout=30)

    def start(self) -> "Traffic":
        loops = [self._tokens] * 3 + [self._chat] * 4
        if self.alias:
            loops.append(self._alias)
        for f in loops:
            t = threading.Thread(target=self._loop, args=(f,), daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=65)


def health(s: K.Stack) -> dict:
    return K.http("GET", s.collector_url + "/health", timeout=5).json()


def raised(h: dict) -> list[tuple[str, str, list[str]]]:
    return [(a["alarm"], a["subject"], a.get("causes", [])) for a in h.get("alarms", [])]


def explain(s: K.Stack, model: str, tokens: list[int]) -> K.Resp:
    return K.http("POST", s.collector_url + "/v1/explain",
                  {"model": model, "token_ids": tokens}, timeout=10)


def test_four_faults_each_raise_their_alarm_and_explain_names_them(workdir: Path) -> None:
    tok = mismatched_tokenizer(workdir)
    cfg = K.StackConfig(engines=4, events_off={0}, envoy_values=ENVOY_VALUES,
                        engine_args=["--tokenizer", str(TOKENIZER_DIR)],
                        collector_args=["--tokenizer", f"{K.DEFAULT_MODEL}={tok}",
                                        *COLLECTOR_ARGS],
                        workdir=workdir / "faulty")
    with FaultyStack(cfg) as s:
        traffic = Traffic(s, alias=True).start()
        try:
            wanted = {
                "engine_silent on engine-0":
                    lambda a: a[0] == "engine_silent" and a[1] == "engine-0/0",
                "hash_mismatch on engine-1 naming block_size":
                    lambda a: (a[0] == "hash_mismatch" and a[1] == "engine-1/0"
                               and a[2][:1] == ["block_size"]),
                f"no_model for {ALIAS}": lambda a: a[0] == "no_model" and a[1] == ALIAS,
                "hash_mismatch on a healthy engine naming tokenizer first":
                    lambda a: (a[0] == "hash_mismatch" and a[1] in ("engine-2/0", "engine-3/0")
                               and a[2][:1] == ["tokenizer"]),
            }
            seen: dict[str, float] = {}
            start = time.monotonic()
            last: dict = {}
            while time.monotonic() - start < RAISE_WITHIN_S and len(seen) < len(wanted):
                last = health(s)
                for name, match in wanted.items():
                    if name not in seen and any(match(a) for a in raised(last)):
                        seen[name] = time.monotonic() - start
                        K.log(f"{name}: raised after {seen[name]:.1f} s")
                time.sleep(0.5)
            missing = [n for n in wanted if n not in seen]
            check(not missing, f"not raised within {RAISE_WITHIN_S:.0f} s: {missing}; "
                               f"/health: {json.dumps(last)[:3000]}; traffic: {traffic.sent} "
                               f"sent, {traffic.errors} failed")
            check(last.get("status") == "degraded", f"/health not degraded: {last}")
            # /v1/explain for the served model names every cause bearing on it.
            r = explain(s, K.DEFAULT_MODEL, traffic.docs[0][:64])
            check(r.status == 200, f"/v1/explain: {r.status} {r.body[:300]!r}")
            causes = {(c["alarm"], c["subject"], cause)
                      for c in r.json().get("likely_causes", []) for cause in c["causes"][:1]}
            for want in [("engine_silent", "engine-0/0", "events_off"),
                         ("hash_mismatch", "engine-1/0", "block_size")]:
                check(want in causes, f"/v1/explain does not name {want}: {causes}")
            check(any(a == "hash_mismatch" and c == "tokenizer" for a, _, c in causes),
                  f"/v1/explain does not name the tokenizer: {causes}")
            # The alias: explaining it names the unknown model; /health names the alias.
            r = explain(s, ALIAS, traffic.docs[0][:64])
            check(400 <= r.status < 500, f"/v1/explain of the alias: {r.status}")
            check(ALIAS in r.body.decode(errors="replace"),
                  f"/v1/explain of the alias does not name it: {r.body[:300]!r}")
            check(any(ALIAS in line for line in last.get("reasons", [])),
                  f"/health reasons do not name {ALIAS}: {last.get('reasons')}")
            m = K.http("GET", s.collector_url + "/metrics", timeout=5).body.decode()
            check('kvroute_alarm{alarm="hash_mismatch",subject="engine-1/0"} 1' in m,
                  "no kvroute_alarm series for engine-1's hash_mismatch")
            check("kvroute_truth_ratio{" in m, "no kvroute_truth_ratio series")
        finally:
            traffic.close()


def test_healthy_fleet_raises_no_alarm(workdir: Path) -> None:
    cfg = K.StackConfig(engines=4, envoy_values=ENVOY_VALUES,
                        engine_args=["--tokenizer", str(TOKENIZER_DIR)],
                        collector_args=["--tokenizer", f"{K.DEFAULT_MODEL}={TOKENIZER_DIR}",
                                        *COLLECTOR_ARGS],
                        workdir=workdir / "healthy")
    with K.Stack(cfg) as s:
        # Two gateways on one collector, as a fleet behind an L4 balancer runs: each engine
        # gets requests from both, whose reports and engine scrapes interleave (false
        # `hash_mismatch` alarms came from exactly that).
        second = s.start_extra_envoy("second", {})
        traffic = Traffic(s, alias=False, urls=[s.kvroute_url, second["kvroute"]]).start()
        try:
            start = time.monotonic()
            ratios_seen = False
            while time.monotonic() - start < HEALTHY_RUN_S:
                h = health(s)
                check(not h.get("alarms"), f"alarm in a healthy fleet after "
                                           f"{time.monotonic() - start:.1f} s: {h['alarms']}")
                m = K.http("GET", s.collector_url + "/metrics", timeout=5).body.decode()
                ratios_seen = ratios_seen or "kvroute_truth_ratio{" in m
                time.sleep(1.0)
            check(ratios_seen, "the truth check never had a ratio: no engine reuse seen")
            check(traffic.sent > 50, f"too little traffic: {traffic.sent}")
            gateways = K.http("GET", s.collector_url + "/v1/load", timeout=5).json()
            check(gateways.get("gateways") == 2,
                  f"both gateways should report load: {gateways}")
        finally:
            traffic.close()


def main() -> int:
    K.install_cleanup()
    result = {"passed": 0, "failed": 0, "skipped": 0}
    bin_dir = K.profile_dir(None)
    if not (supports_tokenizer(bin_dir / "kvroute-collector")
            and supports_tokenizer(bin_dir / "kvroute-sim", "engine")
            and (TOKENIZER_DIR / "tokenizer.json").exists()):
        print("skip  alarms: the binaries have no --tokenizer", flush=True)
        print("0 passed, 0 failed, 2 skipped", flush=True)
        return 0
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="kvroute-alarm-e2e-"))
    only = __import__("os").environ.get("KVROUTE_E2E_ONLY", "")
    for test in [test_four_faults_each_raise_their_alarm_and_explain_names_them,
                 test_healthy_fleet_raises_no_alarm]:
        name = test.__name__[5:]
        if only and only not in name:
            continue
        t0 = time.monotonic()
        try:
            test(root)
            result["passed"] += 1
            print(f"ok    {name} ({time.monotonic() - t0:.1f} s)", flush=True)
        except Exception as e:
            result["failed"] += 1
            print(f"FAIL  {name}: {e}", flush=True)
            if not isinstance(e, Failure):
                traceback.print_exc()
            K.log(f"logs kept in {root}")
    if not result["failed"]:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped",
          flush=True)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
