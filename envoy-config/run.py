#!/usr/bin/env python3
"""kvroute runner: a collector, N simulated engines and a real Envoy on loopback.

  run.py serve  [--engines N]            start everything, print the URLs, run until Ctrl-C
  run.py demo   [--engines N] [--limit N] [--speed X] [--out demo-results.json]
                                         `make demo`: replay a slice of the Mooncake trace
                                         through Envoy + kvroute, then through plain
                                         round-robin (same Envoy, same engines, caches reset
                                         in between), print the comparison, write JSON
  run.py demo --ha                       `make demo-ha`: the control plane past one collector
                                         (nats-server, 2 ingest + 3 index collectors, 2 Envoys
                                         failing over between them) while collectors are
                                         killed -9, engines restarted and NATS paused
  run.py render OUT [NAME=VALUE ...]     render envoy.yaml with free ports (for inspection)

Processes are started in their own process groups and all stopped on exit, on error and on
Ctrl-C. Binaries come from $CARGO_TARGET_DIR or <repo>/target, profile `native`
(KVROUTE_PROFILE to change); the filter from target/wasm32-wasip1/release/kvroute_filter.wasm.
Python 3.11 standard library only (plus the Envoy venv made by install-envoy.sh).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvstack as K  # noqa: E402


def build(skip: bool) -> None:
    """What the demo needs, built the way the Makefile does (cheap when up to date)."""
    if skip:
        return
    jobs = os.environ.get("JOBS", "2")
    K.log("building the filter (make wasm) and the native binaries (profile native)")
    subprocess.run(["make", "-C", str(K.REPO), "wasm"], check=True)
    subprocess.run(["cargo", "build", f"-j{jobs}", "--profile", "native",
                    "-p", "kvroute-collector", "-p", "kvroute-sim"], cwd=K.REPO, check=True)
    K.envoy_bin()


# --------------------------------------------------------------------------------------------
# serve
# --------------------------------------------------------------------------------------------

def cmd_serve(args) -> int:
    build(args.no_build)
    stack = K.Stack(K.StackConfig(engines=args.engines, envoy_concurrency=args.concurrency,
                                  workdir=Path(args.workdir) if args.workdir else None,
                                  keep_workdir=True))
    with stack:
        print(json.dumps({
            "kvroute": stack.kvroute_url, "round_robin": stack.baseline_url,
            "collector": stack.collector_url, "envoy_admin": stack.admin_url,
            "engines": {e.name: e.url for e in stack.engines},
            "logs": str(stack.workdir),
        }, indent=2), flush=True)
        K.log("serving; Ctrl-C to stop")
        try:
            while True:
                time.sleep(1)
                for p in [stack.envoy, stack.collector] + [e.proc for e in stack.engines]:
                    if p is not None and not p.alive():
                        K.log(f"{p.name} exited:\n{p.tail()}")
                        return 1
        except KeyboardInterrupt:
            pass
    return 0


# --------------------------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def _num(rec: dict, *keys: str) -> float | None:
    for k in keys:
        v = rec.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def summarize(out_file: Path, engines: list[K.Engine]) -> dict:
    """Summary of one replay's per-request records (kvroute-sim replay --out, JSON lines)."""
    recs = []
    with open(out_file, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass
    ttfts, model_ttfts, cached, prompt, per_engine, errors = [], [], 0.0, 0.0, {}, 0
    for r in recs:
        ok = r.get("ok", True) and (r.get("error") in (None, "")) and \
            int(_num(r, "status") or 200) < 400
        if not ok:
            errors += 1
            continue
        t = _num(r, "ttft_ms")
        if t is None and _num(r, "ttft_s") is not None:
            t = _num(r, "ttft_s") * 1000
        if t is not None:
            ttfts.append(t)
        mt = _num(r, "model_ttft_s")
        if mt is not None:
            model_ttfts.append(mt * 1000)
        cached += _num(r, "cached_tokens") or 0
        prompt += _num(r, "input_tokens", "input_length", "prompt_tokens") or 0
        eng = r.get("engine") or "?"
        per_engine[eng] = per_engine.get(eng, 0) + 1
    for e in engines:
        per_engine.setdefault(e.name, 0)
    return {
        "requests": len(recs) - errors,
        "errors": errors,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "ttft_p50_ms": _round(percentile(ttfts, 50)),
        "ttft_p90_ms": _round(percentile(ttfts, 90)),
        "ttft_p99_ms": _round(percentile(ttfts, 99)),
        # The engines' own model of TTFT (queueing + prefill of uncached tokens), without the
        # host's overheads, which the speed-up multiplies into the measured TTFT above.
        "model_ttft_p50_ms": _round(percentile(model_ttfts, 50)),
        "model_ttft_p90_ms": _round(percentile(model_ttfts, 90)),
        "per_engine": dict(sorted(per_engine.items())),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def filter_outcomes(stack: K.Stack) -> dict[str, int]:
    out: dict[str, int] = {}
    for k, v in stack.envoy_stats("kvroute.requests.").items():
        name = k.rsplit("kvroute.requests.", 1)[-1]
        out[name] = out.get(name, 0) + v
    return out


def reset_caches(stack: K.Stack) -> None:
    """Empty every engine's prefix cache (vLLM's /reset_prefix_cache); restart on refusal."""
    for e in stack.engines:
        try:
            K.wait_until(lambda: K.http("POST", e.url + "/reset_prefix_cache", timeout=5)
                         .status == 200, 10, f"{e.name} /reset_prefix_cache")
        except TimeoutError:
            K.log(f"{e.name} refused the reset: restarting it")
            e.proc.stop()
            stack.start_engine(e)


def replay(stack: K.Stack, target: str, args, out_file: Path) -> None:
    argv = [str(stack.bin / "kvroute-sim"), "replay", "--trace", str(args.trace),
            "--target", target, "--speed", str(args.speed), "--limit", str(args.limit),
            "--out", str(out_file)]
    K.log("replay:", " ".join(argv))
    p = K.Proc("replay", argv, stack.workdir / f"{out_file.stem}.log")
    # Bounded: the slice is about a minute; give it generous room, then give up.
    try:
        p.p.wait(timeout=args.replay_timeout)
    except Exception:
        p.stop()
        raise RuntimeError(f"replay did not finish in {args.replay_timeout}s")
    rc = p.p.returncode
    p.stop()
    if rc != 0:
        raise RuntimeError(f"replay exited {rc}:\n{p.tail()}")


def print_table(results: dict) -> None:
    pols = list(results)
    engines = sorted({e for r in results.values() for e in r["per_engine"]})
    rows = [("requests", "requests"), ("prefix hit rate", "hit_rate"),
            ("TTFT p50 (ms)", "ttft_p50_ms"), ("TTFT p90 (ms)", "ttft_p90_ms"),
            ("engine-model p50", "model_ttft_p50_ms"), ("engine-model p90", "model_ttft_p90_ms")]
    w0 = max(18, max(len(e) for e in engines) + 2 if engines else 0)
    line = f"{'':<{w0}}" + "".join(f"{p:>14}" for p in pols)
    print(line)
    print("-" * len(line))
    for label, key in rows:
        cells = []
        for p in pols:
            v = results[p].get(key)
            if v is None:
                cells.append("-")
            elif key == "hit_rate":
                cells.append(f"{100 * v:.1f}%")
            else:
                cells.append(f"{v:g}")
        print(f"{label:<{w0}}" + "".join(f"{c:>14}" for c in cells))
    print(f"{'requests per engine':<{w0}}")
    for e in engines:
        print(f"{'  ' + e:<{w0}}" + "".join(f"{results[p]['per_engine'].get(e, 0):>14}"
                                            for p in pols))
    if all(results[p].get("ttft_p90_ms") for p in pols) and len(pols) == 2:
        a, b = results[pols[0]], results[pols[1]]
        print(f"\nTTFT p90: {pols[1]} / {pols[0]} = {b['ttft_p90_ms'] / a['ttft_p90_ms']:.2f}x; "
              f"hit rate {100 * (a['hit_rate'] or 0):.1f}% vs {100 * (b['hit_rate'] or 0):.1f}%")


def cmd_demo_ha(args) -> int:
    """`demo --ha`: the control plane past one collector, under fire. nats-server (JetStream),
    2 ingest and 3 index collectors, 16 engines and 2 Envoys whose filters fail over between
    the index replicas; the trace replayed while collectors are killed -9, engines restarted,
    a gateway restarted and NATS paused: the short chaos soak, which prints what held."""
    subprocess.run(["bash", str(K.REPO / "tools" / "install-nats-server.sh")], check=True,
                   stdout=subprocess.DEVNULL)
    argv = [sys.executable, str(K.HERE / "soak_ha.py"), "--short"]
    K.log("demo --ha:", " ".join(argv[1:]))
    return subprocess.run(argv).returncode


def cmd_demo(args) -> int:
    build(args.no_build)
    if args.ha:
        return cmd_demo_ha(args)
    if not Path(args.trace).exists():
        K.log(f"trace {args.trace} not found")
        return 1
    engine_args = ["--speed", str(args.speed)] + (args.engine_arg or [])
    stack = K.Stack(K.StackConfig(engines=args.engines, engine_args=engine_args,
                                  envoy_concurrency=args.concurrency,
                                  workdir=Path(args.workdir) if args.workdir else None,
                                  keep_workdir=bool(args.workdir)))
    results: dict[str, dict] = {}
    with stack:
        K.log(f"stack up: kvroute {stack.kvroute_url}, round-robin {stack.baseline_url}, "
              f"{len(stack.engines)} engines, logs in {stack.workdir}")
        for policy, url in (("kvroute", stack.kvroute_url), ("round_robin", stack.baseline_url)):
            reset_caches(stack)
            out_file = stack.workdir / f"replay-{policy}.jsonl"
            t0 = time.monotonic()
            before = filter_outcomes(stack)
            replay(stack, url, args, out_file)
            results[policy] = summarize(out_file, stack.engines)
            results[policy]["wall_s"] = round(time.monotonic() - t0, 1)
            after = filter_outcomes(stack)
            # What the filter decided per request during this run (Envoy stats of the wasm
            # filter's kvroute.requests.<outcome> counters).
            results[policy]["filter_outcomes"] = {
                k: after[k] - before.get(k, 0) for k in sorted(after)
                if after[k] - before.get(k, 0)}
            K.log(f"{policy}: {json.dumps(results[policy])}")
    doc = {
        "trace": str(args.trace), "limit": args.limit, "speed": args.speed,
        "engines": args.engines,
        "note": "TTFT in simulated ms: measured through Envoy and multiplied by the speed "
                "(ttft_*), and the engines' own model of it without host overheads "
                "(model_ttft_*)",
        "policies": results,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print()
    print(f"kvroute vs round-robin: {args.limit} requests of {Path(args.trace).name} at "
          f"{args.speed}x, {args.engines} simulated engines, through Envoy 1.40")
    print_table(results)
    fo = results.get("kvroute", {}).get("filter_outcomes")
    if fo:
        print("\nkvroute filter decisions: " + ", ".join(f"{k} {v}" for k, v in fo.items()))
    print(f"\nwrote {args.out}")
    return 0


def cmd_render(args) -> int:
    stack = K.Stack(K.StackConfig(engines=args.engines, with_envoy=False))
    values = stack.envoy_values()
    for kv in args.values:
        k, _, v = kv.partition("=")
        values[k] = v
    K.render.render_file(str(K.HERE / "envoy.yaml"), args.out, values)
    print(args.out)
    stack.stop()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--engines", type=int, default=4, help="simulated engines (default 4)")
        p.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
        p.add_argument("--workdir", help="keep configs and logs here (default: a temp dir)")
        p.add_argument("--no-build", action="store_true", help="skip make wasm / cargo build")

    p = sub.add_parser("serve", help="start everything and keep running")
    common(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("demo", help="kvroute vs round-robin on a slice of the trace")
    common(p)
    p.add_argument("--trace", default=str(K.demo_trace_path()))
    # The whole synthetic trace (3,993 requests, 17 minutes) at 16x: ~64 s per policy. Its
    # first minutes have little prefix reuse (5 % of blocks in the first 400 requests, 64 %
    # over the whole trace), so a short slice at 1x would show little.
    p.add_argument("--limit", type=int, default=3993, help="requests replayed per policy")
    p.add_argument("--speed", type=float, default=16.0,
                   help="trace and engine time dilation (default 16: ~1 minute per policy)")
    p.add_argument("--engine-arg", action="append", help="extra kvroute-sim engine argument")
    p.add_argument("--replay-timeout", type=float, default=600)
    p.add_argument("--out", default="demo-results.json")
    p.add_argument("--ha", action="store_true",
                   help="the HA control plane instead (NATS, ingest and index collectors, two "
                        "gateways) under 2.5 minutes of chaos; results in bench-out/soak-ha-short/")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("render", help="render envoy.yaml with free ports")
    p.add_argument("out")
    p.add_argument("values", nargs="*")
    p.add_argument("--engines", type=int, default=3)
    p.set_defaults(fn=cmd_render)

    args = ap.parse_args()
    K.install_cleanup()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
