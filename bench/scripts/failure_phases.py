#!/usr/bin/env python3
"""TTFT of the failure scenario split by phase of the replay, against the same requests in
the no-fault (trace) run of the same invocation: where the failure costs, and whether a
router uses the returned engine again.

    python3 bench/scripts/failure_phases.py [bench-out]

Phases (fractions of the replay's send times): before the cut (0-0.3), the outage (0.3-0.6),
just after the return (0.6-0.8), the rest. Reads <out>/failure/<policy>.jsonl and
<out>/trace/<policy>.jsonl as `make bench-routing-scenarios` writes them."""

import json
import sys
from pathlib import Path

PHASES = [("before", 0.0, 0.3), ("outage", 0.3, 0.6), ("returned", 0.6, 0.8), ("rest", 0.8, 1.01)]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
    print("| policy | phase | requests | TTFT p50 failure / no-fault (s) | p90 failure / no-fault (s) | to engine-0 |")
    print("|---|---|---|---|---|---|")
    for f in sorted((out / "failure").glob("*.jsonl")):
        policy = f.stem
        trace = out / "trace" / f.name
        if not trace.exists():
            continue
        fault = rows(f)
        base = {r["index"]: r for r in rows(trace)}
        end = max(r["sent_at_s"] for r in fault) or 1.0
        for name, lo, hi in PHASES:
            sel = [r for r in fault if lo * end <= r["sent_at_s"] < hi * end and r["ttft_s"]]
            ttft = [r["ttft_s"] for r in sel]
            ref = [base[r["index"]]["ttft_s"] for r in sel
                   if r["index"] in base and base[r["index"]]["ttft_s"]]
            to0 = sum(r["engine"] == "engine-0" for r in sel)
            print(f"| {policy} | {name} | {len(sel)} | {pct(ttft, .5):.2f} / {pct(ref, .5):.2f} "
                  f"| {pct(ttft, .9):.2f} / {pct(ref, .9):.2f} | {to0} |")


if __name__ == "__main__":
    main()
