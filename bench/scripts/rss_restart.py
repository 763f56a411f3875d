#!/usr/bin/env python3
"""RSS of a collector restarted mid-run, against the same collector before the restart.

16 simulated engines (`kvroute-sim engine`, 20,000-block caches, fast prefill) publish vLLM KV
events to one collector (`--state-dir`, `--feed-log-entries 200000`, a state snapshot every 5
s) while a client keeps ~200k blocks in the index and churning (random prompts on 200 shared
prefixes). At `--restart-at` seconds the collector is killed -9 and started again, either
from its state file (`--restart state`: what a replica of the chaos soak does) or without it
(`--restart replay`: every engine replayed from 0), and a full feed snapshot is requested
every 20 s. RSS is sampled every second.

Each run starts two fleets side by side: the collector as shipped, and the same binary with
its malloc thresholds left to glibc (`GLIBC_TUNABLES` set, which makes
`server::fix_malloc_thresholds` stand down), so the difference is the allocator's alone.

    python3 bench/scripts/rss_restart.py [--restart state|replay] [--seconds 420]

Needs `make native` (target/native/kvroute-collector and kvroute-sim).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "native"
ENGINES = 16
CAPACITY = 20_000


def rss_mb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


class Fleet:
    def __init__(self, name: str, base: int, env: dict, workdir: Path, restart: str):
        self.name, self.base, self.env, self.restart = name, base, env, restart
        self.state = workdir / f"state-{name}"
        self.log = open(workdir / f"{name}.log", "w")
        self.sims, self.specs = [], []
        for i in range(ENGINES):
            port, pub, rep = base + 10 + i, f"tcp://127.0.0.1:{base + 40 + i}", f"tcp://127.0.0.1:{base + 70 + i}"
            self.sims.append(subprocess.Popen(
                [str(BIN / "kvroute-sim"), "engine", "--listen", f"127.0.0.1:{port}", "--name", f"e{i}",
                 "--capacity-blocks", str(CAPACITY), "--prefill-tokens-per-s", "5000000",
                 "--decode-ms-per-token", "0.1", "--prefill-overhead-ms", "0",
                 "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.specs += ["--worker", f"instance_id=e{i},endpoint={pub},model=sim-model,block_size=16,"
                                       f"address=127.0.0.1:{port},replay={rep}"]
        self.collector = self.start()
        self.samples: list[tuple[float, int | None]] = []

    def start(self) -> subprocess.Popen:
        return subprocess.Popen(
            [str(BIN / "kvroute-collector"), "--listen", f"127.0.0.1:{self.base}",
             "--feed-log-entries", "200000", "--state-dir", str(self.state),
             "--snapshot-interval-secs", "5", *self.specs],
            env=self.env, stdout=subprocess.DEVNULL, stderr=self.log)

    def kill_and_restart(self) -> None:
        self.collector.send_signal(signal.SIGKILL)
        self.collector.wait()
        if self.restart == "replay":
            subprocess.run(["rm", "-rf", str(self.state)], check=True)
        self.collector = self.start()

    def snapshot(self) -> None:
        # Another epoch: the collector builds (or reuses) a full snapshot for this reader.
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.base}/v1/feed?epoch=1&since=0", timeout=10).read()
        except OSError:
            pass

    def blocks(self) -> int | None:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.base}/metrics", timeout=2).read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("kvroute_index_blocks "):
                return int(float(line.split()[1]))
        return None

    def stop(self) -> None:
        for p in [self.collector, *self.sims]:
            p.send_signal(signal.SIGKILL)
            p.wait()


def load(fleets: list[Fleet], stop: threading.Event) -> None:
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 30_000) for _ in range(1024)] for _ in range(200)]

    def one(args: tuple[Fleet, int]) -> None:
        fleet, seed = args
        r = random.Random(seed)
        prompt = r.choice(prefixes) + [r.randrange(1, 30_000) for _ in range(1024)]
        body = json.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 1}).encode()
        port = fleet.base + 10 + r.randrange(ENGINES)
        try:
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"}),
                timeout=10).read()
        except OSError:
            pass

    n = 0
    with ThreadPoolExecutor(8) as ex:
        while not stop.is_set():
            list(ex.map(one, [(f, n * 1000 + i) for f in fleets for i in range(32)]))
            n += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--restart", choices=["state", "replay"], default="state")
    ap.add_argument("--restart-at", type=float, default=90.0)
    ap.add_argument("--seconds", type=float, default=420.0)
    ap.add_argument("--base-port", type=int, default=21000)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-rss-"))
    shipped = dict(os.environ)
    for k in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        shipped.pop(k, None)
    dynamic = dict(shipped, GLIBC_TUNABLES="glibc.malloc.check=0")
    fleets = [Fleet("shipped", args.base_port, shipped, workdir, args.restart),
              Fleet("glibc-dynamic", args.base_port + 1000, dynamic, workdir, args.restart)]
    stop = threading.Event()
    threading.Thread(target=load, args=(fleets, stop), daemon=True).start()
    t0 = time.monotonic()
    restarted, next_snapshot, blocks = False, args.restart_at + 20, {}
    try:
        while (t := time.monotonic() - t0) < args.seconds:
            if not restarted and t >= args.restart_at:
                for f in fleets:
                    f.kill_and_restart()
                restarted = True
            if restarted and t >= next_snapshot:
                next_snapshot += 20
                for f in fleets:
                    f.snapshot()
            for f in fleets:
                f.samples.append((t, rss_mb(f.collector.pid)))
                if int(t) % 30 == 0:
                    blocks[f.name] = f.blocks()
            time.sleep(1.0)
    finally:
        stop.set()
        for f in fleets:
            f.stop()
    half = (args.restart_at + args.seconds) / 2
    print(f"restart {args.restart} at {args.restart_at:.0f} s, {args.seconds:.0f} s in all, "
          f"index blocks at the end {blocks}; work dir {workdir}")
    print()
    print("| collector | RSS before the restart (median of its last 30 s) | after (min–max, from 10 s on) "
          "| median over the last half | growth over the last half |")
    print("|---|---|---|---|---|")
    for f in fleets:
        before = [m for t, m in f.samples if args.restart_at - 30 <= t < args.restart_at and m]
        after = [m for t, m in f.samples if t >= args.restart_at + 10 and m]
        last = [m for t, m in f.samples if t >= half and m]
        first_min = [m for t, m in f.samples if half <= t < half + 60 and m]
        last_min = [m for t, m in f.samples if t >= args.seconds - 60 and m]
        growth = statistics.median(last_min) / statistics.median(first_min) - 1
        print(f"| {f.name} | {statistics.median(before):.0f} MB | {min(after)}–{max(after)} MB "
              f"| {statistics.median(last):.0f} MB | {growth:+.1%} |")
    with open(workdir / "samples.json", "w") as out:
        json.dump({f.name: f.samples for f in fleets}, out)


if __name__ == "__main__":
    main()
