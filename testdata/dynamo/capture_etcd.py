#!/usr/bin/env python3
"""Captures a Dynamo worker's etcd discovery record through etcd v3's JSON gateway
(`etcd_discovery_1.6.1.txt`; README.md). Run beside a mocker started with
DYN_DISCOVERY_BACKEND=etcd ETCD_ENDPOINTS=<url>: `python capture_etcd.py <url> <out> <date>`.
Standard library only."""
import base64
import json
import sys
import urllib.request
from pathlib import Path


def post(url, path, body):
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return data, r.read()


def b64(s):
    return base64.b64encode(s.encode()).decode()


def main():
    url, out, date = sys.argv[1].rstrip("/"), Path(sys.argv[2]), sys.argv[3]
    # Every key under v1/ (keys only): the layout.
    _, listing = post(url, "/v3/kv/range", {"key": b64("v1/"), "range_end": b64("v10"), "keys_only": True})
    keys = sorted(base64.b64decode(kv["key"]).decode() for kv in json.loads(listing).get("kvs", []))
    key = next(k for k in keys if k.startswith("v1/instances/") and "/worker_kv_query_source_" in k)
    request, answer = post(url, "/v3/kv/range", {"key": b64(key)})
    missing_request, missing = post(url, "/v3/kv/range", {"key": b64(key + "0")})
    version = urllib.request.urlopen(url + "/version", timeout=5).read().decode()
    value = base64.b64decode(json.loads(answer)["kvs"][0]["value"]).decode()
    lines = [f"# ai-dynamo 1.6.1 mocker, etcd discovery, TCP request plane, captured {date} (README.md)",
             "", "### etcd", f"version: {version}", "", "### keys"]
    lines += [f"key: {k}" for k in keys]
    lines += ["", "### record", f"key: {key}", f"request: {request.decode()}",
              f"answer: {answer.decode()}", f"value: {value}",
              "", "### missing", f"request: {missing_request.decode()}", f"answer: {missing.decode()}", ""]
    (out / "etcd_discovery_1.6.1.txt").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
