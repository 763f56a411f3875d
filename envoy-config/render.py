#!/usr/bin/env python3
"""Render envoy-config/envoy.yaml (or any template) by filling ${NAME} / ${NAME:-default}.

Usage:
    render.py TEMPLATE OUT NAME=VALUE ...        values on the command line
    render.py TEMPLATE OUT                       values from the environment

A placeholder with no value and no default is an error (naming it), never an empty string:
Envoy would otherwise start with a config that means something else. Comments are rendered
too (harmless). Python 3 standard library only.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Mapping

_PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)(?::-([^}]*))?\}")


class RenderError(Exception):
    pass


def render(template: str, values: Mapping[str, object]) -> str:
    missing: list[str] = []

    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in values and values[name] is not None:
            return str(values[name])
        if default is not None:
            return default
        missing.append(name)
        return m.group(0)

    out = _PLACEHOLDER.sub(sub, template)
    if missing:
        raise RenderError("no value for placeholder(s): " + ", ".join(sorted(set(missing))))
    return out


def lb_endpoints(addresses: list[str]) -> str:
    """`["127.0.0.1:8001", ...]` -> the JSON (= YAML flow) list of lb_endpoints."""
    eps = []
    for a in addresses:
        host, _, port = a.rpartition(":")
        eps.append({"endpoint": {"address": {"socket_address": {
            "address": host.strip("[]"), "port_value": int(port)}}}})
    return json.dumps(eps)


def filter_extra(keys: Mapping[str, object]) -> str:
    """Top-level filter config keys -> the FILTER_EXTRA value (`, "load": {...}`)."""
    return "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in keys.items())


def render_file(template_path: str, out_path: str, values: Mapping[str, object]) -> None:
    with open(template_path, encoding="utf-8") as f:
        text = render(f.read(), values)
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out_path)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    values: dict[str, object] = dict(os.environ)
    for kv in argv[3:]:
        k, sep, v = kv.partition("=")
        if not sep:
            print(f"render.py: expected NAME=VALUE, got {kv!r}", file=sys.stderr)
            return 2
        values[k] = v
    # Convenience: ENGINES=127.0.0.1:8001,127.0.0.1:8002 -> ENGINE_LB_ENDPOINTS.
    if "ENGINE_LB_ENDPOINTS" not in values and values.get("ENGINES"):
        values["ENGINE_LB_ENDPOINTS"] = lb_endpoints(str(values["ENGINES"]).split(","))
    try:
        render_file(argv[1], argv[2], values)
    except RenderError as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
