#!/usr/bin/env python3
"""The fleet page in a real browser, and the Grafana dashboard against real metrics
(`make test-ui` runs this).

The stack: `kvroute-collector` with a read token, three `kvroute-sim engine` processes
publishing KV events (one of them with two dp ranks), and Envoy 1.40 running the filter with
that token, so a gateway reports load and the filter's stats are real. Then headless Chromium
(Debian's `chromium`, driven by Playwright over the DevTools protocol, no browser download):

  - no token, then a wrong one: an error on the page and no engine rows;
  - the right one: every worker of `/workers` is a row, with the same block count;
  - the prompt probe, with token ids and with a JSON body: the bars (hashed in the browser by
    the WebAssembly core, looked up with /query_by_hash) equal what POST /query answers for the
    same tokens, and the page's own cross-check says they agree;
  - the page sends nothing but GETs and the read-only POST /query, /query_by_hash;
  - a screenshot at bench-out/ui/fleet.png (`--update-docs` also copies it to
    docs/fleet-page.png, the one the README shows).

Then every metric a query of dashboards/kvroute.json names must exist in the collector's
/metrics or Envoy's /stats/prometheus, scraped from this stack.

Prints one line per test and `N passed, N failed`; exits 1 on any failure. Needs the venv of
envoy-config/install-envoy.sh with `playwright` (the make target installs both), `make wasm`
and the collector and simulator binaries.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvstack as K  # noqa: E402

REPO = K.REPO
READ_TOKEN = "fleet-page-test-" + os.urandom(4).hex()
BS = K.DEFAULT_BLOCK_SIZE
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags headless Chromium hangs on refused connections.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
VIEWPORT = {"width": 1440, "height": 900}
TIMEOUT_S = 20.0
SHOT = REPO / "bench-out" / "ui" / "fleet.png"
DOCS_SHOT = REPO / "docs" / "fleet-page.png"
DASHBOARD = REPO / "dashboards" / "kvroute.json"
DOCS_TRAFFIC_S = 100.0
RNG = random.Random(13)


class Failure(AssertionError):
    pass


def check(cond: object, msg: str) -> None:
    if not cond:
        raise Failure(msg)


def auth(token: str = READ_TOKEN) -> dict[str, str]:
    return {"authorization": "Bearer " + token}


def free_port_pair() -> int:
    """A free loopback port p with p + 1 free too: a sim engine's dp rank r publishes on its
    rank-0 ports + r, as vLLM does."""
    for _ in range(100):
        p = K.free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        K._taken_ports.add(p + 1)
        return p
    raise RuntimeError("no free port pair")


class UiStack(K.Stack):
    """The stack with a read token on the collector, handed to the filter too, and a second
    dp rank on the last engine (registered like vLLM's: one worker per rank)."""

    def __init__(self, cfg: K.StackConfig):
        super().__init__(cfg)
        self.dp_engine = self.engines[-1]
        self.dp_engine.zmq_port = free_port_pair()
        self.dp_engine.replay_port = free_port_pair()

    def collector_argv(self, port: int | None = None) -> list[str]:
        e = self.dp_engine
        rank1 = (f"instance_id={e.name},endpoint=tcp://127.0.0.1:{e.zmq_port + 1},"
                 f"model={self.cfg.model},block_size={self.cfg.block_size},address={e.address},"
                 f"replay=tcp://127.0.0.1:{e.replay_port + 1},dp_rank=1")
        return super().collector_argv(port) + ["--worker", rank1, "--read-token", READ_TOKEN]

    def engine_argv(self, e: K.Engine) -> list[str]:
        argv = super().engine_argv(e)
        return argv + ["--dp-size", "2"] if e is self.dp_engine else argv

    def render_envoy(self, path: Path | None = None) -> Path:
        out = super().render_envoy(path)
        text = out.read_text(encoding="utf-8")
        anchor = '"authority": "kvroute-collector",'
        check(anchor in text, "envoy.yaml: the collector block changed; update ui_test.py")
        out.write_text(text.replace(anchor, f'{anchor} "read_token": "{READ_TOKEN}",', 1),
                       encoding="utf-8")
        return out

    def query(self, tokens: list[int], tenant: str | None = None,
              model: str | None = None) -> dict:
        body: dict[str, object] = {"token_ids": tokens, "model_name": model or self.cfg.model}
        if tenant:
            body["tenant_id"] = tenant
        r = K.http("POST", self.collector_url + "/query", body, headers=auth(), timeout=5)
        if r.status != 200:
            raise RuntimeError(f"/query: {r.status} {r.body[:200]!r}")
        return r.json()

    def explain(self, tokens: list[int]) -> dict:
        body = {"token_ids": tokens, "model_name": self.cfg.model}
        r = K.http("POST", self.collector_url + "/v1/explain", body, headers=auth(), timeout=5)
        if r.status != 200:
            raise RuntimeError(f"/v1/explain: {r.status} {r.body[:200]!r}")
        return r.json()

    def workers(self) -> list[dict]:
        r = K.http("GET", self.collector_url + "/workers", headers=auth(), timeout=5)
        check(r.status == 200, f"/workers: {r.status}")
        return r.json()["workers"]


# ----------------------------------------------------------------------------------------
# The page
# ----------------------------------------------------------------------------------------

class Page:
    """One headless Chromium with a fresh profile, on the fleet page."""

    def __init__(self, pw, url: str):
        self.profile = tempfile.mkdtemp(prefix="kvroute-chromium-")
        self.ctx = pw.chromium.launch_persistent_context(
            self.profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport=VIEWPORT)
        self.ctx.set_default_timeout(TIMEOUT_S * 1000)
        self.page = self.ctx.pages[0] if self.ctx.pages else self.ctx.new_page()
        self.errors: list[str] = []
        self.requests: list[tuple[str, str]] = []
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("console", self._console)
        self.page.on("request", lambda r: self.requests.append((r.method, r.url)))
        self.page.goto(url)

    def _console(self, msg) -> None:
        # Chromium logs every 401 it receives as a console error: those are the test's own.
        if msg.type == "error" and "status of 401" not in msg.text:
            self.errors.append(f"console: {msg.text}")

    def close(self) -> None:
        try:
            self.ctx.close()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)

    def use_token(self, token: str) -> None:
        self.page.fill("#token", token)
        self.page.click("#token-use")

    def error_text(self) -> str:
        el = self.page.locator("#error")
        return el.inner_text() if el.is_visible() else ""

    def rows(self) -> dict[tuple[str, int], int]:
        """(instance, dp) -> the block count the row shows."""
        out = {}
        for r in self.page.locator("#engines tbody tr").all():
            key = (r.get_attribute("data-instance"), int(r.get_attribute("data-dp")))
            shown = r.locator('td[data-field="blocks"]').inner_text().replace(",", "")
            out[key] = int(shown)
        return out

    def probe(self, text: str) -> dict[str, int]:
        """Runs the probe; instance -> the tokens its bar shows as matched."""
        self.page.fill("#probe-input", text)
        self.page.click("#probe-run")
        # "Probing…" is muted; the outcome is ok or bad.
        self.page.wait_for_function(
            "() => document.getElementById('probe-status').className !== 'muted'")
        status = self.page.locator("#probe-status")
        check("ok" in (status.get_attribute("class") or ""),
              f"probe: {status.inner_text()!r}")
        return {b.get_attribute("data-instance"): int(b.get_attribute("data-matched"))
                for b in self.page.locator("#probe-bars .probe-bar").all()}

    def explained(self) -> tuple[str | None, list[str]]:
        """The last probe's explain box: the winner it names and the instances it lists."""
        verdict = self.page.locator("#explain-verdict")
        rows = [r.get_attribute("data-instance")
                for r in self.page.locator("#probe-explain tbody tr").all()]
        return verdict.get_attribute("data-winner"), rows


def expected_rows(stack: UiStack) -> dict[tuple[str, int], int]:
    return {(w["instance_id"], w["dp_rank"]): w["blocks"] for w in stack.workers()}


def matched_by_query(stack: UiStack, tokens: list[int]) -> dict[str, int]:
    """What POST /query says, with 0 for every instance of the model it does not list."""
    inst = stack.query(tokens)["instances"]
    out = {w["instance_id"]: 0 for w in stack.workers()}
    out.update({name: m["longest_matched"] for name, m in inst.items()})
    return out


def test_token_refused(page: Page) -> None:
    # No token yet: the collector asks for one.
    K.wait_until(lambda: "read token" in page.error_text(), TIMEOUT_S, "the no-token error")
    check(page.page.locator("#engines tbody tr").count() == 0, "rows shown without a token")
    page.use_token("not-" + READ_TOKEN)
    K.wait_until(lambda: "refused this read token" in page.error_text(), TIMEOUT_S,
                 "the wrong-token error")
    check(page.page.locator("#engines tbody tr").count() == 0, "rows shown for a wrong token")
    check(not page.page.locator("#data").is_visible(), "fleet data visible for a wrong token")


def test_engines_listed(page: Page, stack: UiStack) -> None:
    page.use_token(READ_TOKEN)
    K.wait_until(lambda: page.page.locator("#engines tbody tr").count() > 0, TIMEOUT_S,
                 "engine rows")
    check(page.error_text() == "", f"error shown with the right token: {page.error_text()!r}")
    last: dict = {}

    def same() -> bool:
        want, got = expected_rows(stack), page.rows()
        last.update(want=want, got=got)
        return want == got
    try:
        # The page refreshes every 2 s; blocks are still until the next request.
        K.wait_until(same, TIMEOUT_S, "the page's rows to equal /workers", interval=0.5)
    except TimeoutError:
        raise Failure(f"rows differ from /workers: page {last.get('got')} vs {last.get('want')}")
    check(len(last["want"]) >= 4, f"expected 3 engines, one with 2 dp ranks: {last['want']}")
    check(any(b > 0 for b in last["want"].values()), "no engine holds blocks")


def banner(page: Page) -> list[tuple[str, str]]:
    """The alarm banner's lines: ("alarm:<kind>" or "problem", text); empty when hidden. Read
    in one evaluation: the page replaces the lines at every refresh."""
    lines = page.page.evaluate("""() => {
        if (document.getElementById("alarms").hidden) return [];
        return [...document.querySelectorAll("#alarm-list li")].map((li) =>
            [li.dataset.alarm !== undefined ? "alarm:" + li.dataset.alarm : "problem",
             li.textContent]);
    }""")
    return [(k, t) for k, t in lines]


def test_degraded_banner(page: Page, stack: UiStack) -> None:
    """A degraded collector says why on the page: each alarm of /health and each other reason
    (here the event bus down) is a line of the banner, and the banner follows /health back."""
    nats = "nats: not connected (nats://127.0.0.1:4222: connection refused)"
    silent = "engine e9 registered 300 s ago has sent no KV event while serving 12 requests"
    fake = {"status": "degraded", "reasons": [nats, silent], "epoch": 1, "workers": 4,
            "connected": 4, "alarms": [{"alarm": "engine_silent", "subject": "e9",
                                        "reason": silent, "causes": ["events off"]}]}
    route = "**/health"
    page.page.route(route, lambda r: r.fulfill(status=200, content_type="application/json",
                                               body=json.dumps(fake)))
    try:
        want = [("alarm:engine_silent", silent), ("problem", nats)]
        K.wait_until(lambda: banner(page) == want, TIMEOUT_S, f"the banner to show {want}",
                     interval=0.25)
        badge = page.page.locator("#health")
        check(badge.inner_text() == "collector degraded", f"badge: {badge.inner_text()!r}")
    finally:
        page.page.unroute(route)

    def real() -> list[tuple[str, str]]:
        h = K.http("GET", stack.collector_url + "/health", headers=auth(), timeout=5).json()
        raised = {a["reason"] for a in h["alarms"]}
        return ([(f"alarm:{a['alarm']}", a["reason"]) for a in h["alarms"]]
                + [("problem", r) for r in h["reasons"] if r not in raised])
    K.wait_until(lambda: banner(page) == real(), TIMEOUT_S, "the banner to follow /health back",
                 interval=0.25)


def test_probe(page: Page, stack: UiStack, prompts: dict[str, list[int]]) -> None:
    for name, tokens in prompts.items():
        want = matched_by_query(stack, tokens)
        got = page.probe(", ".join(map(str, tokens)))
        check(got == want, f"probe of {name} (token ids): bars {got} vs /query {want}")
        check(max(want.values()) > 0, f"{name}: nothing cached, the check would be empty")
        # The explain box shows /v1/explain's decision: the holder of the longest prefix wins
        # on this idle fleet, and every instance of the model is listed.
        winner, rows = page.explained()
        why = stack.explain(tokens)
        check(winner == why["winner"]["instance_id"],
              f"explain box of {name}: winner {winner} vs /v1/explain {why['winner']}")
        check(rows == [i["instance_id"] for i in why["instances"]],
              f"explain box of {name}: rows {rows} vs /v1/explain")
        check(want.get(winner, 0) == max(want.values()),
              f"{name}: /v1/explain picked {winner}, not a longest holder {want}")
    tokens = prompts["a"]
    body = json.dumps({"model": stack.cfg.model, "prompt": tokens, "max_tokens": 1})
    got = page.probe(body)
    want = matched_by_query(stack, tokens)
    check(got == want, f"probe (JSON body): bars {got} vs /query {want}")


def test_read_only(page: Page) -> None:
    allowed_posts = {"/query", "/query_by_hash", "/v1/explain"}
    for method, url in page.requests:
        path = "/" + url.split("/", 3)[-1].split("?")[0]
        if method == "GET":
            continue
        check(method == "POST" and path in allowed_posts, f"the page sent {method} {path}")
    check(any(m == "POST" for m, _ in page.requests), "the probe sent no query")
    check(not page.errors, "browser errors: " + "; ".join(page.errors[:5]))


class Traffic:
    """Requests through Envoy from a few threads (prompts that share prefixes, a few dozen
    output tokens each), so the page has history to chart and load in flight to show."""

    def __init__(self, stack: UiStack, prompts: dict[str, list[int]], threads: int = 6):
        self.stop = threading.Event()
        self.sent = 0
        rng = random.Random(5)
        bases = list(prompts.values())

        def loop():
            while not self.stop.is_set():
                base = rng.choice(bases)
                tokens = base[: rng.randrange(BS, len(base) + 1)] + K.random_tokens(rng.randrange(BS, 4 * BS), rng)
                if len(bases) < 40:
                    bases.append(tokens)
                try:
                    stack.completion(stack.kvroute_url, tokens, max_tokens=rng.randrange(20, 120))
                    self.sent += 1
                except OSError:
                    time.sleep(0.1)
        self.threads = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def test_screenshot(page: Page, stack: UiStack, prompts: dict[str, list[int]],
                    update_docs: bool) -> None:
    traffic = None
    if update_docs:
        # The picture the README shows: a couple of minutes of history, load in flight.
        traffic = Traffic(stack, prompts)
        time.sleep(DOCS_TRAFFIC_S)
        page.probe(", ".join(map(str, prompts["a"])))
        time.sleep(2.5)
    SHOT.parent.mkdir(parents=True, exist_ok=True)
    page.page.screenshot(path=str(SHOT), full_page=True)
    if traffic:
        traffic.close()
        check(traffic.sent > 0, "no request went through Envoy")
    check(SHOT.stat().st_size > 20_000, f"{SHOT} is suspiciously small")
    if update_docs:
        DOCS_SHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SHOT, DOCS_SHOT)


def test_forget_token(page: Page) -> None:
    page.page.click("#token-forget")
    K.wait_until(lambda: "read token" in page.error_text(), TIMEOUT_S, "the no-token error")
    check(page.page.locator("#engines tbody tr").count() == 0, "rows left after Forget")
    check(page.page.locator("#probe-bars .probe-bar").count() == 0, "bars left after Forget")


# ----------------------------------------------------------------------------------------
# The dashboard
# ----------------------------------------------------------------------------------------

# Words of PromQL that are not metric names.
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "offset", "bool", "rate", "irate", "increase", "delta", "idelta",
    "deriv", "histogram_quantile", "sum_over_time", "avg_over_time", "max_over_time",
    "min_over_time", "last_over_time", "changes", "resets", "abs", "clamp_min", "clamp_max",
    "round", "ceil", "floor", "vector", "scalar", "time", "timestamp", "label_replace",
    "label_join", "sort", "sort_desc", "absent", "le", "inf", "nan",
}


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query, rows' collapsed panels and variables included."""
    out = []

    def panels(ps):
        for p in ps:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", "?"), t["expr"]))
            panels(p.get("panels", []))
    panels(dash.get("panels", []))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if v.get("type") == "query" and isinstance(q, str):
            out.append((f"variable {v.get('name')}", q))
    return out


def metric_refs(expr: str) -> tuple[set[str], set[str]]:
    """Metric names an expression reads, and the `__name__=~"..."` regexes it matches."""
    regexes = set(re.findall(r'__name__\s*=~\s*"([^"]+)"', expr))
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)           # string literals
    text = re.sub(r"\{[^}]*\}", "{}", text)                    # label matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)                   # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)                    # dashboard variables
    # label_values(metric, label) in variable queries.
    names = set(re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", text))
    text = re.sub(r"label_values\([^)]*\)", "", text)
    for tok in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if tok.lower() not in PROMQL_WORDS and not re.fullmatch(r"\d+[smhdwy]?", tok):
            names.add(tok)
    return names, regexes


def exported_names(text: str, counter_suffix: str) -> set[str]:
    """Every sample name a Prometheus text exposition has or would have: the samples, and
    for each `# TYPE` family its series names (families with no series yet still count).
    `counter_suffix`: "_total" for OpenMetrics (the collector), "" for Envoy's format."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, fam, kind = line.split(None, 3)
            if kind == "counter":
                names.add(fam + counter_suffix)
            elif kind == "histogram":
                names.update({fam + "_bucket", fam + "_sum", fam + "_count"})
            elif kind == "summary":
                names.update({fam, fam + "_sum", fam + "_count"})
            else:
                names.add(fam)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, 1)[0])
    return names


def test_dashboard(stack: UiStack) -> None:
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    ids = [p["id"] for p in dash["panels"]]
    check(len(ids) == len(set(ids)), "dashboard panel ids repeat")
    exprs = dashboard_exprs(dash)
    check(len(exprs) >= 15, f"only {len(exprs)} queries in the dashboard")
    r = K.http("GET", stack.collector_url + "/metrics", timeout=5)
    check(r.status == 200, f"collector /metrics: {r.status}")
    collector = exported_names(r.body.decode(), "_total")
    r = K.http("GET", stack.admin_url + "/stats/prometheus", timeout=5)
    check(r.status == 200, f"Envoy /stats/prometheus: {r.status}")
    envoy = exported_names(r.body.decode(), "")
    check("kvroute_requests_routed" in envoy, "Envoy exports none of the filter's metrics")
    missing, empty_regex, used = [], [], {"collector": 0, "envoy": 0}
    for title, expr in exprs:
        names, regexes = metric_refs(expr)
        check(names or regexes, f"{title}: no metric found in {expr!r}")
        # A query scoped to one job must find its metrics in that binary's own exposition:
        # the filter and the collector both have e.g. a `kvroute_feed_bytes`.
        if "$envoy_job" in expr:
            source, exported = "envoy", envoy
        elif "$collector_job" in expr:
            source, exported = "collector", collector
        else:
            source, exported = None, collector | envoy
        for n in sorted(names - exported):
            missing.append(f"{title}: {n} ({source or 'either'})")
        for rx in regexes:
            if not any(re.fullmatch(rx, n) for n in exported):
                empty_regex.append(f"{title}: {rx}")
        if source:
            used[source] += 1
    check(not missing, "dashboard names metrics the binaries do not export: " + "; ".join(missing))
    check(not empty_regex, "dashboard regexes match nothing: " + "; ".join(empty_regex))
    check(used["collector"] and used["envoy"], f"queries per source: {used}")


# ----------------------------------------------------------------------------------------

def warm_stack(stack: UiStack) -> dict[str, list[int]]:
    """Prompts cached on the engines: a on engine-0, b on engine-1, a's first three blocks
    and then its own on engine-2 (and a's first block on its dp rank 1), so the probe's bars
    differ. Also requests through Envoy, so
    the filter's stats move and the gateway reports load."""
    e0, e1, e2 = stack.engines
    a = K.random_tokens(6 * BS + 5, RNG)
    b = K.random_tokens(9 * BS, RNG)
    c = a[: 3 * BS] + K.random_tokens(2 * BS, RNG)
    stack.warm(e0, a)
    stack.warm(e1, b)
    stack.warm(e2, c)
    # And on engine-2's second dp rank, a's first block and then its own.
    d = a[:BS] + K.random_tokens(3 * BS, RNG)
    r = stack.completion(e2.url, d, extra_headers={"x-data-parallel-rank": "1"})
    check(r.status == 200 and r.headers.get("x-kvroute-sim-dp-rank") == "1",
          f"request to engine-2 dp rank 1: {r.status} {r.headers}")
    K.wait_until(lambda: stack.query(d)["instances"].get(e2.name, {}).get("dp", {}).get("1") == len(d),
                 TIMEOUT_S, "the collector to index dp rank 1")
    for _ in range(4):
        r = stack.completion(stack.kvroute_url, K.random_tokens(4 * BS, RNG))
        check(r.status == 200, f"request through Envoy: {r.status}")
    stack.wait_routed(e0, a)
    return {"a": a, "b": b, "c": c}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--update-docs", action="store_true",
                    help="also copy the screenshot to docs/fleet-page.png")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    passed = failed = 0

    def run(name: str, fn, *a) -> None:
        nonlocal passed, failed
        t0 = time.monotonic()
        try:
            fn(*a)
            passed += 1
            print(f"ok    {name} ({time.monotonic() - t0:.1f}s)", flush=True)
        except Exception as exc:
            failed += 1
            print(f"FAIL  {name} ({time.monotonic() - t0:.1f}s): {exc}", flush=True)
            if not isinstance(exc, Failure):
                traceback.print_exc()

    stack = UiStack(K.StackConfig(engines=3))
    try:
        stack.start()
        prompts = warm_stack(stack)
        with sync_playwright() as pw:
            page = Page(pw, stack.collector_url + "/ui/")
            try:
                run("ui: no token or a wrong one shows an error and no data", test_token_refused, page)
                run("ui: every engine with the block count of /workers", test_engines_listed, page, stack)
                run("ui: a degraded /health's alarms and reasons are shown in the banner",
                    test_degraded_banner, page, stack)
                run("ui: probe bars equal POST /query", test_probe, page, stack, prompts)
                run("ui: screenshot", test_screenshot, page, stack, prompts, args.update_docs)
                run("ui: read-only, no browser errors", test_read_only, page)
                run("ui: Forget drops every piece of data", test_forget_token, page)
            finally:
                page.close()
        run("dashboard: every metric it names is exported", test_dashboard, stack)
    except Exception:
        failed += 1
        traceback.print_exc()
        stack.dump_logs()
    finally:
        stack.stop()
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
