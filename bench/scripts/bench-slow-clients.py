#!/usr/bin/env python3
"""/query latency while 1,100 slow-body clients attack the collector (issue 23).

Each attacker opens a connection, sends a `/query` head declaring a 100 kB body and one byte of
it, then waits; when the collector closes it (shed for a newcomer, or cut by the body rate /
stall rules) it reconnects at once, so the flood never lets up. Meanwhile one client sends
`--queries` normal `/query` requests, each on a fresh connection (the worst case: every one
must win a slot), and records the time to the whole answer. Scenarios:

- `idle`: no attackers (the baseline of the same run);
- `cap512`: `--max-connections 512`, the cap the issue measured (no answer within 5 s before
  shedding), the shipped body limits (1 s stall, 32 KiB/s past the first second);
- `cap512-patient`: the same cap with body deadlines of 600 s and no rate rule, so only the
  shedder frees slots;
- `derived`: the cap the collector derives from the descriptor limit (no `--max-connections`);
  with the flood held open, the RSS per connection.

Usage: python3 bench/scripts/bench-slow-clients.py [--bin PATH] [--clients 1100] [--queries 300]
Writes bench-out/slow-clients.md and prints it. Standard library only.
"""

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

HEAD = (
    b"POST /query HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 100000\r\n\r\n{"
)
WORKER = "instance_id=10.0.0.1:8000,endpoint=tcp://127.0.0.1:9,model=m,block_size=4"
QUERY = json.dumps({"model_name": "m", "token_ids": list(range(1, 65))}).encode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(port, raw, timeout=5.0):
    """One request on a fresh connection; (status, seconds) or (None, seconds) on failure."""
    start = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(raw)
            got = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        status = int(got.split(b" ", 2)[1]) if got else None
    except (OSError, ValueError, IndexError):
        status = None
    return status, time.perf_counter() - start


def query(port):
    raw = (
        b"POST /query HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(QUERY)
        + QUERY
    )
    return http(port, raw, timeout=5.0)


def metric(port, name):
    raw = b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(raw)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    for line in got.decode(errors="replace").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Flood:
    """`n` attackers on their own event loop thread; counts reconnects."""

    def __init__(self, port, n):
        self.port, self.n = port, n
        self.stop = False
        self.opened = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.main(),))

    async def attacker(self):
        while not self.stop:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(HEAD)
                await writer.drain()
                self.opened += 1
                while not self.stop:
                    try:
                        if not await asyncio.wait_for(reader.read(4096), 0.5):
                            break
                    except asyncio.TimeoutError:
                        continue
                writer.close()
            except OSError:
                await asyncio.sleep(0.01)

    async def main(self):
        await asyncio.gather(*(self.attacker() for _ in range(self.n)))

    def start(self):
        self.thread.start()
        # Every attacker connected once before the measurement starts.
        until = time.time() + 30
        while self.opened < self.n and time.time() < until:
            time.sleep(0.05)

    def join(self):
        self.stop = True
        self.thread.join()


def run(args, name, extra, clients):
    port = free_port()
    proc = subprocess.Popen(
        [args.bin, "--listen", f"127.0.0.1:{port}", "--worker", WORKER, *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        until = time.time() + 20
        while http(port, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")[0] != 200:
            if time.time() > until:
                raise SystemExit(f"{name}: collector did not come up")
            time.sleep(0.05)
        rss_before = rss_kib(proc.pid)
        flood = Flood(port, clients) if clients else None
        if flood:
            flood.start()
        rss_during = rss_kib(proc.pid)
        lat, failed = [], 0
        for _ in range(args.queries):
            status, took = query(port)
            if status == 200:
                lat.append(took)
            else:
                failed += 1
            time.sleep(0.01)
        opened = flood.opened if flood else 0
        if flood:
            flood.join()
        lat.sort()
        pct = lambda q: lat[min(len(lat) - 1, round((len(lat) - 1) * q))] * 1000 if lat else float("nan")
        return {
            "name": name,
            "args": " ".join(extra) or "(defaults)",
            "clients": clients,
            "answered": len(lat),
            "failed": failed,
            "p50": pct(0.5),
            "p99": pct(0.99),
            "max": lat[-1] * 1000 if lat else float("nan"),
            "cap": metric(port, "kvroute_http_max_connections"),
            "shed": metric(port, "kvroute_http_connections_shed_total"),
            "refused": metric(port, "kvroute_http_connections_refused_total"),
            "attacks": opened,
            # Only where every attacker holds a connection at once (the cap above the flood).
            "rss_per_conn": (rss_during - rss_before) / clients
            if clients and metric(port, "kvroute_http_max_connections") >= clients
            else None,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default="target/debug/kvroute-collector")
    p.add_argument("--clients", type=int, default=1100)
    p.add_argument("--queries", type=int, default=300)
    args = p.parse_args()
    patient = ["--body-stall-timeout-secs", "600", "--body-read-timeout-secs", "600",
               "--min-body-bytes-per-sec", "0"]
    rows = [
        run(args, "idle", ["--max-connections", "512"], 0),
        run(args, "cap512", ["--max-connections", "512"], args.clients),
        run(args, "cap512-patient", ["--max-connections", "512", *patient], args.clients),
        run(args, "derived", [], args.clients),
    ]
    out = [
        f"`python3 bench/scripts/bench-slow-clients.py --clients {args.clients} --queries {args.queries}`"
        f" (binary `{args.bin}`), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"load average {os.getloadavg()[0]:.1f}",
        "",
        "| scenario | collector flags | slow clients | cap | /query answered | failed | p50 | p99 | max | shed | refused | attacker connections | RSS per held connection |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rss = f"{r['rss_per_conn']:.1f} KiB" if r["rss_per_conn"] is not None else "—"
        out.append(
            f"| {r['name']} | `{r['args']}` | {r['clients']} | {r['cap']:.0f} | {r['answered']} | {r['failed']} "
            f"| {r['p50']:.1f} ms | {r['p99']:.1f} ms | {r['max']:.1f} ms | {r['shed']:.0f} | {r['refused']:.0f} "
            f"| {r['attacks']} | {rss} |"
        )
    text = "\n".join(out) + "\n"
    os.makedirs("bench-out", exist_ok=True)
    with open("bench-out/slow-clients.md", "w") as f:
        f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
