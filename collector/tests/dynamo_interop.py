#!/usr/bin/env python3
"""The Dynamo reader against a real NVIDIA Dynamo 1.6.1 worker (`make test-dynamo-interop`).

Installs ai-dynamo 1.6.1 and its runtime in a venv (target/dynamo-venv, reused when it already
holds them), starts nats-server, Dynamo's mocker engine (CPU, file discovery, the NATS event
and request planes) and kvroute-collector binaries with --dynamo-namespace, sends requests
through Dynamo's own client, and checks through the collectors' /query that:

1. a collector running from the start indexes every block the worker reports (the 1.6.1
   subject and event arrays), nothing undecodable;
2. a collector started after those events were published asks the worker's KV query endpoint
   for its whole cache on the first event it hears and then matches the earlier prompts too;
3. the same late start with --dynamo-recovery off does not (the prompts published before it
   started match nothing there);
4. a collector that was running and lost some of the worker's messages (stopped with SIGSTOP
   until nats-server, which pings every second here, closed its connection as stale: NATS Core
   keeps nothing for it) sees the jump in event ids when it is back, asks the worker's KV query
   for the missing range and applies it: the prompts published while it was away match, and
   the earlier ones still do; its twin with --dynamo-recovery off, running from the start and
   through the same outage, clears the worker instead and matches none of them.

Then the same worker on Dynamo's default TCP request plane (DYN_REQUEST_PLANE=tcp, a second
mocker with its own file discovery root; the first one and its collectors stopped), with
collectors given --dynamo-recovery tcp --dynamo-discovery-dir (the mocker's DYN_FILE_KV):

5. a collector started late finds the worker's KV query endpoint in the discovery record,
   asks it over TCP for the whole cache and matches the earlier prompts; its twin with the
   NATS request plane only (--dynamo-recovery nats, no discovery) gets no answer
   (`unreachable`) and matches none of them;
6. a running collector that lost messages the same way as in 4 fills the range over TCP.

Then a third mocker on the TCP request plane with etcd discovery (DYN_DISCOVERY_BACKEND=etcd,
a real etcd from tools/install-etcd.sh, Dynamo's default outside Kubernetes):

7. a collector started late with --dynamo-recovery tcp --dynamo-discovery-etcd finds the
   worker's KV query endpoint in etcd (through etcd's JSON gateway), asks it over TCP for the
   whole cache and matches the earlier prompts; its twin given no discovery (NATS request
   plane only) gets no answer and matches none of them.

Nothing is skipped: a failed install or a missing binary fails the test, with the reason.
"""
import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
PROFILE = os.environ.get("KVROUTE_PROFILE", "debug")
COLLECTOR = TARGET / PROFILE / "kvroute-collector"
VENV = Path(os.environ.get("KVROUTE_DYNAMO_VENV", TARGET / "dynamo-venv"))
DYNAMO_VERSION = "1.6.1"
PACKAGES = [f"ai-dynamo-runtime=={DYNAMO_VERSION}", "aiohttp", "certifi", "kubernetes<33",
            "msgpack", "msgspec", "prometheus-client", "pyzmq", "redis<9", "tqdm",
            "transformers>=4.56", "typing-extensions", "zstandard", "nats-py"]
BLOCK = 16
MODEL = "mock"
DEADLINE = 60.0

procs = []


def log(msg):
    print(f"[dynamo-interop {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fail(msg):
    log("FAIL: " + msg)
    for p, name, path in procs:
        if path and Path(path).exists():
            tail = Path(path).read_text(errors="replace").splitlines()[-15:]
            print(f"--- last lines of {name} ---\n" + "\n".join(tail), flush=True)
    stop_all()
    sys.exit(1)


def stop_all():
    for p, _, _ in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p, _, _ in reversed(procs):
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    procs.clear()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name, argv, env, logdir):
    path = logdir / f"{name}.log"
    f = open(path, "w")
    p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs.append((p, name, path))
    return p, path


def venv_python():
    return VENV / "bin" / "python"


def venv_ready():
    py = venv_python()
    if not py.exists():
        return False
    probe = ("import importlib.metadata as m, sys; import dynamo.mocker, nats, msgpack; "
             f"sys.exit(m.version('ai-dynamo') != '{DYNAMO_VERSION}' or "
             f"m.version('ai-dynamo-runtime') != '{DYNAMO_VERSION}')")
    return subprocess.run([str(py), "-c", probe], capture_output=True).returncode == 0


def install():
    """The venv with ai-dynamo 1.6.1 (the wheel alone: its declared dependencies pull engines
    the mocker does not need) and what its mocker imports."""
    if venv_ready():
        log(f"reusing {VENV}")
        return
    t0 = time.time()
    log(f"installing ai-dynamo {DYNAMO_VERSION} into {VENV} (about a minute)")
    shutil.rmtree(VENV, ignore_errors=True)
    steps = [[sys.executable, "-m", "venv", str(VENV)]]
    pip = [str(venv_python()), "-m", "pip", "--disable-pip-version-check", "-q"]
    dl = VENV / "dl"
    steps += [pip + ["download", f"ai-dynamo=={DYNAMO_VERSION}", "--no-deps", "-d", str(dl)],
              pip + ["install", "--no-deps", str(dl / f"ai_dynamo-{DYNAMO_VERSION}-py3-none-any.whl")],
              pip + ["install"] + PACKAGES]
    for argv in steps:
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"installing Dynamo failed: {' '.join(argv)}\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    if not venv_ready():
        fail("Dynamo installed but `import dynamo.mocker` or its version check fails")
    log(f"installed in {time.time() - t0:.0f} s")


CLIENT = r'''
import asyncio, os, sys
from dynamo._core import DistributedRuntime
async def main():
    rt = DistributedRuntime(asyncio.get_running_loop(), os.environ["DYN_DISCOVERY_BACKEND"],
                            os.environ["DYN_REQUEST_PLANE"],
                            event_plane="nats")
    client = await rt.endpoint("dynamo.backend.generate").client()
    await asyncio.wait_for(client.wait_for_instances(), 30)
    for k in map(int, sys.argv[1:]):
        req = {"token_ids": list(range(1000, 1048)) + list(range(2000 + 100 * k, 2020 + 100 * k)),
               "stop_conditions": {"max_tokens": 4}, "sampling_options": {},
               "output_options": {}, "eos_token_ids": []}
        async for _ in await client.generate(req):
            pass
    rt.shutdown()
asyncio.run(main())
'''


def prompt(k):
    """Request k's first four blocks: 48 shared tokens, then 16 of its own."""
    return list(range(1000, 1048)) + list(range(2000 + 100 * k, 2016 + 100 * k))


def send(env, *ks):
    r = subprocess.run([str(venv_python()), "-c", CLIENT] + [str(k) for k in ks],
                       env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        fail(f"Dynamo's client failed:\n{r.stderr[-3000:]}")


def http(port, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        raw = r.read()
    return json.loads(raw) if path != "/metrics" else raw.decode()


def matched(port, k):
    """Each instance's longest match of request k's prompt, in tokens."""
    try:
        r = http(port, "/query", {"token_ids": prompt(k), "model_name": MODEL})
    except urllib.error.HTTPError as e:
        if e.code == 404:  # no worker of that model registered yet
            return {}
        raise
    return {i: m["longest_matched"] for i, m in r["instances"].items()}


def count(port, dir_, outcome):
    text = http(port, "/metrics")
    m = re.search(rf'kvroute_bus_messages_total{{dir="{dir_}",outcome="{outcome}"}} (\d+)', text)
    return int(m.group(1)) if m else 0


def until(what, check, deadline=DEADLINE):
    end = time.time() + deadline
    while True:
        last = check()
        if last is True:
            return
        if time.time() > end:
            fail(f"{what}: still {last!r} after {deadline:.0f} s")
        time.sleep(0.2)


def connections(mport, state, subs=False):
    """nats-server's collector connections in `state` (open or closed), by its monitoring port."""
    url = f"http://127.0.0.1:{mport}/connz?state={state}&limit=1024" + ("&subs=1" if subs else "")
    with urllib.request.urlopen(url, timeout=5) as r:
        conns = json.loads(r.read())["connections"] or []
    return [c for c in conns if c.get("name") == "kvroute-collector"]


def wait_health(port, name):
    def ok():
        try:
            return http(port, "/health")["status"] == "ok" or "not ok"
        except Exception as e:  # not up yet
            return repr(e)
    until(f"{name} /health", ok, 30)


def collector(name, nats_url, logdir, *extra):
    port = free_port()
    argv = [str(COLLECTOR), "--listen", f"127.0.0.1:{port}", "--nats", nats_url,
            "--dynamo-namespace", "dynamo", "--dynamo-model", MODEL,
            "--dynamo-block-size", str(BLOCK), "--dynamo-address", "127.0.0.1:9", *extra]
    start(name, argv, dict(os.environ, RUST_LOG="info"), logdir)
    wait_health(port, name)
    # NATS Core keeps nothing for a late subscriber: the reader must be subscribed before the
    # events this test counts on are published.
    until(f"{name} subscribed", lambda: "dynamo: reading KV events" in (logdir / f"{name}.log").read_text() or "no", 30)
    return port


def stop(*names):
    """Stops the processes `names` started, leaving the others running."""
    for p, name, _ in procs:
        if name in names and p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p, name, _ in procs:
        if name in names:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    procs[:] = [x for x in procs if x[1] not in names]


def outage(pids, nats_mport, while_away):
    """Stops `pids` until nats-server closes their connections as stale (NATS Core then keeps
    nothing for them), runs `while_away`, resumes them and waits until they are subscribed
    again on new connections."""
    before = {x["cid"] for x in connections(nats_mport, "open")}
    stale0 = sum(x.get("reason") == "Stale Connection" for x in connections(nats_mport, "closed"))
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        until(f"nats-server closes {len(pids)} collectors as stale",
              lambda: sum(x.get("reason") == "Stale Connection"
                          for x in connections(nats_mport, "closed")) - stale0 >= len(pids)
              or connections(nats_mport, "closed"), 20)
        while_away()
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    until("the stopped collectors resubscribed",
          lambda: sum(x["cid"] not in before and
                      any(sub.endswith(".kv-events") for sub in x.get("subscriptions_list") or [])
                      for x in connections(nats_mport, "open", subs=True)) >= len(pids)
          or connections(nats_mport, "open", subs=True), 30)


def tcp_plane(work, nats_url, nats_mport):
    """Cases 5 and 6: the worker on the TCP request plane, found through file discovery."""
    disc = work / "discovery-tcp"
    env = dict(os.environ, NATS_SERVER=nats_url, DYN_DISCOVERY_BACKEND="file",
               DYN_FILE_KV=str(disc), DYN_EVENT_PLANE="nats", DYN_REQUEST_PLANE="tcp",
               DYN_TCP_RPC_HOST="127.0.0.1", HF_HUB_OFFLINE="1", DYN_LOG="info")
    tcp = ("--dynamo-recovery", "tcp", "--dynamo-discovery-dir", str(disc))
    e = collector("collector-e", nats_url, work, *tcp)
    pid_e = procs[-1][0].pid
    start("mocker-tcp", [str(venv_python()), "-m", "dynamo.mocker", "--num-gpu-blocks-override", "64",
                         "--block-size", str(BLOCK), "--kv-bytes-per-token", "64"], env, work)
    until("the TCP mocker's KV query endpoint in discovery",
          lambda: any("worker%5Fkv%5Fquery" in f.name for f in (disc / "v1/instances").glob("*"))
          if (disc / "v1/instances").is_dir() else "no discovery yet", 60)
    record = next(f for f in (disc / "v1/instances").glob("*") if "worker%5Fkv%5Fquery" in f.name)
    transport = json.loads(record.read_text())["transport"]
    if "tcp" not in transport:
        fail(f"the mocker's KV query endpoint is not on the TCP request plane: {transport}")
    send(env, 10, 11, 12)
    until("collector E matches request 12", lambda: len(matched(e, 12)) == 1 and 64 in matched(e, 12).values() or matched(e, 12))
    worker = next(iter(matched(e, 12)))
    log(f"TCP plane: worker {worker}, its KV query endpoint at {transport['tcp']}")

    # 5. Late: asked over TCP (F) or over NATS only (G, which no one answers).
    f = collector("collector-f", nats_url, work, *tcp)
    g = collector("collector-g", nats_url, work)
    send(env, 13)
    until("collector F matches request 13", lambda: matched(f, 13) == {worker: 64} or matched(f, 13))
    for k in (10, 11, 12):
        if matched(f, k) != {worker: 64}:
            fail(f"collector F (late, recovery tcp), request {k}: {matched(f, k)}")
    if count(f, "dynamo_recovery", "dumped") != 1 or count(f, "dynamo_discovery", "tcp") != 1:
        fail(f"collector F: {count(f, 'dynamo_recovery', 'dumped')} tree dumps, "
             f"{count(f, 'dynamo_discovery', 'tcp')} TCP lookups, not 1 and 1")
    log("collector F (late start, --dynamo-recovery tcp): the tree dump over TCP, requests 10-13 matched")
    until("collector G's KV query finds no NATS responder",
          lambda: count(g, "dynamo_recovery", "unreachable") >= 1 or "not yet")
    for k in (10, 11, 12):
        got = matched(g, k).get(worker, 0)
        if got != 0:
            fail(f"collector G (late, NATS request plane only) matches request {k} for {got} tokens")
    log("collector G (late start, --dynamo-recovery nats, no discovery): unreachable, requests 10-12 match nothing")

    # 6. A gap on E, filled over TCP.
    if count(e, "dynamo", "gap"):
        fail("collector E: a gap before the outage")

    def away():
        send(env, 14, 15)
        until("collector F (running) matches request 15", lambda: matched(f, 15) == {worker: 64} or matched(f, 15))
    outage([pid_e], nats_mport, away)
    send(env, 16)
    until("collector E hears the jump", lambda: count(e, "dynamo", "gap") >= 1 or "no gap")
    until("collector E's KV query over TCP",
          lambda: count(e, "dynamo_recovery", "recovered") == 1 or count(e, "dynamo_recovery", "recovered"))
    for outcome in ("unreachable", "timeout", "refused", "bad_answer", "overflow", "busy", "dumped"):
        if count(e, "dynamo_recovery", outcome):
            fail(f"collector E's KV queries counted {outcome}: {count(e, 'dynamo_recovery', outcome)}")
    if count(e, "dynamo_discovery", "tcp") != 1:
        fail(f"collector E: {count(e, 'dynamo_discovery', 'tcp')} TCP lookups, not 1")
    until("collector E matches request 16", lambda: matched(e, 16) == {worker: 64} or matched(e, 16))
    for k in range(10, 17):
        if matched(e, k) != {worker: 64}:
            fail(f"collector E after the gap, request {k}: {matched(e, k)}")
    log(f"collector E (running, lost requests 14-15, --dynamo-recovery tcp): "
        f"{count(e, 'dynamo', 'gap')} gap, the range recovered over TCP, requests 10-16 matched")


def etcd_plane(work, nats_url):
    """Case 7: the worker on the TCP request plane, found through etcd discovery."""
    etcd_bin = subprocess.run(["bash", str(ROOT / "tools/install-etcd.sh")],
                              capture_output=True, text=True)
    if etcd_bin.returncode != 0:
        fail("tools/install-etcd.sh failed:\n" + etcd_bin.stderr)
    cport, pport = free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{cport}"
    start("etcd", [etcd_bin.stdout.strip(), "--name", "kvroute-interop",
                   "--data-dir", str(work / "etcd"),
                   "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                   "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
                   "--initial-cluster", f"kvroute-interop=http://127.0.0.1:{pport}"],
          dict(os.environ), work)

    def etcd_up():
        try:
            with urllib.request.urlopen(etcd_url + "/health", timeout=2) as r:
                return json.loads(r.read()).get("health") == "true" or "not healthy"
        except Exception as e:  # not up yet
            return repr(e)
    until("etcd /health", etcd_up, 30)

    def etcd_keys():
        body = json.dumps({"key": base64.b64encode(b"v1/instances/").decode(),
                           "range_end": base64.b64encode(b"v1/instances0").decode()}).encode()
        req = urllib.request.Request(etcd_url + "/v3/kv/range", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            kvs = json.loads(r.read()).get("kvs") or []
        return {base64.b64decode(kv["key"]).decode(): json.loads(base64.b64decode(kv["value"]))
                for kv in kvs}

    env = dict(os.environ, NATS_SERVER=nats_url, DYN_DISCOVERY_BACKEND="etcd",
               ETCD_ENDPOINTS=etcd_url, DYN_EVENT_PLANE="nats", DYN_REQUEST_PLANE="tcp",
               DYN_TCP_RPC_HOST="127.0.0.1", HF_HUB_OFFLINE="1", DYN_LOG="info")
    env.pop("DYN_FILE_KV", None)
    h = collector("collector-h", nats_url, work, "--dynamo-recovery", "off")
    start("mocker-etcd", [str(venv_python()), "-m", "dynamo.mocker", "--num-gpu-blocks-override", "64",
                          "--block-size", str(BLOCK), "--kv-bytes-per-token", "64"], env, work)
    until("the etcd mocker's KV query endpoint in etcd",
          lambda: any("/worker_kv_query_source_" in k for k in etcd_keys()) or "not yet", 60)
    key, record = next((k, v) for k, v in etcd_keys().items() if "/worker_kv_query_source_" in k)
    if "tcp" not in record["transport"]:
        fail(f"the etcd mocker's KV query endpoint is not on the TCP request plane: {record}")
    send(env, 20, 21, 22)
    until("collector H matches request 22", lambda: len(matched(h, 22)) == 1 and 64 in matched(h, 22).values() or matched(h, 22))
    worker = next(iter(matched(h, 22)))
    log(f"etcd discovery: worker {worker}, its KV query endpoint at {key}: {record['transport']['tcp']}")

    # 7. Late: found through etcd and asked over TCP (I), or over NATS only (J).
    i = collector("collector-i", nats_url, work, "--dynamo-recovery", "tcp",
                  "--dynamo-discovery-etcd", etcd_url)
    j = collector("collector-j", nats_url, work)
    send(env, 23)
    until("collector I matches request 23", lambda: matched(i, 23) == {worker: 64} or matched(i, 23))
    for k in (20, 21, 22):
        if matched(i, k) != {worker: 64}:
            fail(f"collector I (late, etcd discovery), request {k}: {matched(i, k)}")
    if count(i, "dynamo_recovery", "dumped") != 1 or count(i, "dynamo_discovery", "tcp") != 1:
        fail(f"collector I: {count(i, 'dynamo_recovery', 'dumped')} tree dumps, "
             f"{count(i, 'dynamo_discovery', 'tcp')} TCP lookups, not 1 and 1")
    for outcome in ("missing", "malformed", "other_transport"):
        if count(i, "dynamo_discovery", outcome):
            fail(f"collector I's lookups counted {outcome}: {count(i, 'dynamo_discovery', outcome)}")
    log("collector I (late start, --dynamo-discovery-etcd): the tree dump over TCP, requests 20-23 matched")
    until("collector J's KV query finds no NATS responder",
          lambda: count(j, "dynamo_recovery", "unreachable") >= 1 or "not yet")
    for k in (20, 21, 22):
        got = matched(j, k).get(worker, 0)
        if got != 0:
            fail(f"collector J (late, NATS request plane only) matches request {k} for {got} tokens")
    log("collector J (late start, no discovery): unreachable, requests 20-22 match nothing")


def main():
    t0 = time.time()
    if not COLLECTOR.exists():
        fail(f"{COLLECTOR} missing: `cargo build -p kvroute-collector` first (make test-e2e does)")
    install()
    nats_bin = subprocess.run(["bash", str(ROOT / "tools/install-nats-server.sh")],
                              capture_output=True, text=True)
    if nats_bin.returncode != 0:
        fail("tools/install-nats-server.sh failed:\n" + nats_bin.stderr)
    work = Path(tempfile.mkdtemp(prefix="kvroute-dynamo-"))
    nats_port = free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    nats_mport = free_port()
    # A client that answers no PING for three seconds is closed as stale (step 4's outage; the
    # default waits minutes). Running clients answer within milliseconds.
    (work / "nats.conf").write_text('ping_interval: "1s"\nping_max: 2\n')
    start("nats-server", [nats_bin.stdout.strip(), "-c", str(work / "nats.conf"), "-a",
                          "127.0.0.1", "-p", str(nats_port), "-m", str(nats_mport),
                          "-js", "-sd", str(work / "js")], dict(os.environ), work)
    env = dict(os.environ, NATS_SERVER=nats_url, DYN_DISCOVERY_BACKEND="file",
               DYN_FILE_KV=str(work / "discovery"), DYN_EVENT_PLANE="nats",
               DYN_REQUEST_PLANE="nats", DYN_TCP_RPC_HOST="127.0.0.1", HF_HUB_OFFLINE="1",
               DYN_LOG="info")
    a = collector("collector-a", nats_url, work)
    pid_a = procs[-1][0].pid
    d = collector("collector-d", nats_url, work, "--dynamo-recovery", "off")
    pid_d = procs[-1][0].pid
    start("mocker", [str(venv_python()), "-m", "dynamo.mocker", "--num-gpu-blocks-override", "64",
                     "--block-size", str(BLOCK), "--kv-bytes-per-token", "64"], env, work)
    until("the mocker's KV query endpoint", lambda: "worker_kv_query_source" in (work / "mocker.log").read_text() or "not yet", 60)

    # 1. From the start: every prompt's four blocks, under the worker's Dynamo id.
    send(env, 0, 1, 2)
    until("collector A matches request 2", lambda: list(matched(a, 2).values()) == [64] or matched(a, 2))
    worker = next(iter(matched(a, 2)))
    for k in (0, 1):
        if matched(a, k) != {worker: 64}:
            fail(f"collector A, request {k}: {matched(a, k)}")
    for outcome in ("undecodable", "too_large", "gap"):
        if count(a, "dynamo", outcome):
            fail(f"collector A counted {outcome}: {count(a, 'dynamo', outcome)}")
    log(f"collector A: worker {worker}, requests 0-2 matched 64 tokens each "
        f"({count(a, 'dynamo', 'applied')} events applied)")

    # 2. and 3. Late: requests 0-2 were published before these two started.
    b = collector("collector-b", nats_url, work)
    c = collector("collector-c", nats_url, work, "--dynamo-recovery", "off")
    send(env, 3)
    until("collector B matches request 3", lambda: matched(b, 3) == {worker: 64} or matched(b, 3))
    for k in (0, 1, 2):
        if matched(b, k) != {worker: 64}:
            fail(f"collector B (late, recovery nats), request {k}: {matched(b, k)}")
    if count(b, "dynamo_recovery", "dumped") != 1:
        fail(f"collector B: {count(b, 'dynamo_recovery', 'dumped')} tree dumps, not 1")
    log("collector B (late start, --dynamo-recovery nats): the worker's tree dump, requests 0-3 matched")
    until("collector C hears request 3", lambda: count(c, "dynamo", "applied") >= 1 or "nothing applied")
    for k in (0, 1, 2, 3):
        got = matched(c, k).get(worker, 0)
        if got != 0:
            fail(f"collector C (late, recovery off) matches request {k} for {got} tokens: "
                 "it cannot know blocks stored before it started")
    log("collector C (late start, --dynamo-recovery off): requests 0-3 match nothing, as expected")
    for k in (0, 1, 2, 3):
        if matched(a, k) != {worker: 64} or matched(d, k) != {worker: 64}:
            fail(f"request {k}: collector A {matched(a, k)}, collector D {matched(d, k)}")

    # 4. A gap: A (recovery nats) and D (off), both running from the start, stop reading until
    # the server drops them as stale; requests 4 and 5 are published meanwhile, lost to both;
    # request 6 after they reconnect.
    if count(a, "dynamo", "gap") or count(d, "dynamo", "gap"):
        fail("a gap before the outage")
    for name in ("collector-a", "collector-d"):
        log_text = (work / f"{name}.log").read_text()
        if log_text.count("nats: connected") != 1:
            fail(f"{name} (re)connected {log_text.count('nats: connected')} times before the outage")
    before = {x["cid"] for x in connections(nats_mport, "open")}
    stale0 = sum(x.get("reason") == "Stale Connection" for x in connections(nats_mport, "closed"))
    for pid in (pid_a, pid_d):
        os.kill(pid, signal.SIGSTOP)
    try:
        until("nats-server closes collectors A and D as stale",
              lambda: sum(x.get("reason") == "Stale Connection"
                          for x in connections(nats_mport, "closed")) - stale0 >= 2
              or connections(nats_mport, "closed"), 20)
        send(env, 4, 5)
        until("collector B (running) matches request 5", lambda: matched(b, 5) == {worker: 64} or matched(b, 5))
    finally:
        for pid in (pid_a, pid_d):
            os.kill(pid, signal.SIGCONT)
    # Back on the server and subscribed again (two new connections with the kv-events
    # subscription) before request 6 is published, or it would be lost too.
    until("collectors A and D resubscribed",
          lambda: sum(x["cid"] not in before and
                      any(sub.endswith(".kv-events") for sub in x.get("subscriptions_list") or [])
                      for x in connections(nats_mport, "open", subs=True)) >= 2
          or connections(nats_mport, "open", subs=True), 30)
    send(env, 6)
    until("collector A hears the jump", lambda: count(a, "dynamo", "gap") >= 1 or "no gap")
    until("collector A's KV query for the range",
          lambda: count(a, "dynamo_recovery", "recovered") == 1 or count(a, "dynamo_recovery", "recovered"))
    for outcome in ("unreachable", "timeout", "refused", "bad_answer", "overflow", "busy", "dumped"):
        if count(a, "dynamo_recovery", outcome):
            fail(f"collector A's KV queries counted {outcome}: {count(a, 'dynamo_recovery', outcome)}")
    until("collector A matches request 6", lambda: matched(a, 6) == {worker: 64} or matched(a, 6))
    for k in range(6):
        # 4 and 5 only from the worker's answer: A was off the server while they were published.
        if matched(a, k) != {worker: 64}:
            fail(f"collector A after the gap, request {k}: {matched(a, k)}")
    log(f"collector A (running, lost requests 4-5, --dynamo-recovery nats): "
        f"{count(a, 'dynamo', 'gap')} gap, the range recovered from the worker, requests 0-6 matched")
    until("collector D hears the jump", lambda: count(d, "dynamo", "gap") >= 1 or "no gap")
    gaps = re.search(rf'kvroute_sequence_gaps_total{{instance="{worker}",dp="0"}} (\d+)',
                     http(d, "/metrics"))
    if not gaps or int(gaps.group(1)) < 1:
        fail("collector D (recovery off) counted no sequence gap for the worker")
    for k in range(6):
        # 0-3 were matched before the outage: the gap cleared them; 4 and 5 it never heard.
        got = matched(d, k).get(worker, 0)
        if got != 0:
            fail(f"collector D (recovery off) matches request {k} for {got} tokens after the gap")
    for outcome in ("recovered", "dumped"):
        if count(d, "dynamo_recovery", outcome):
            fail(f"collector D (recovery off) counted {outcome}")
    log("collector D (same outage, --dynamo-recovery off): the gap cleared the worker, "
        "requests 0-5 match nothing")
    stop("mocker", "collector-a", "collector-b", "collector-c", "collector-d")
    tcp_plane(work, nats_url, nats_mport)
    stop("mocker-tcp", "collector-e", "collector-f", "collector-g")
    etcd_plane(work, nats_url)
    stop_all()
    shutil.rmtree(work, ignore_errors=True)
    log(f"PASS in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException as e:  # a crash of the test itself still stops what it started
        stop_all()
        raise
