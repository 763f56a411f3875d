#!/usr/bin/env python3
"""Self-test of tools/layout_check.py (run by `make layout`): a crate root that names a child
module by a bare path while the child imports the root must be reported, and so must a loop
through `crate::` paths; the same files without the back edge must pass."""

import subprocess
import sys
import tempfile
from pathlib import Path

CHECK = Path(__file__).resolve().parent / "layout_check.py"


def run(files: dict) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src"
        for name, text in files.items():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_text(text)
        return subprocess.run([sys.executable, str(CHECK), str(src)], capture_output=True, text=True)


def main() -> int:
    cases = [
        ("bare root path and crate:: back edge", {
            "lib.rs": "mod a;\npub struct State;\nfn f() { a::run(); }\n",
            "a.rs": "use crate::State;\npub fn run() {}\n",
        }, True),
        ("grouped bare use", {
            "lib.rs": "mod a;\nmod b;\nuse a::{X, Y};\npub struct State;\n",
            "a.rs": "pub struct X; pub struct Y;\nuse crate::b::Z;\n",
            "b.rs": "pub struct Z;\nuse crate::State;\n",
        }, True),
        ("no back edge", {
            "lib.rs": "mod a;\nmod state;\nfn f() { a::run(); }\n",
            "a.rs": "use crate::state::State;\npub fn run() {}\n",
            "state.rs": "pub struct State;\n",
        }, False),
        ("main.rs beside lib.rs is another crate", {
            "lib.rs": "pub mod a;\n",
            "a.rs": "pub fn run() {}\n",
            "main.rs": "fn main() { kvroute::a::run(); }\nuse crate::a;\n",
        }, False),
    ]
    bad = 0
    for name, files, cycle in cases:
        p = run(files)
        found = p.returncode != 0 and "import cycle" in p.stdout
        if found != cycle:
            bad += 1
            print(f"layout_check self-test FAILED: {name}: expected cycle={cycle}\n{p.stdout}{p.stderr}")
    if not bad:
        print(f"layout_check self-test: {len(cases)} cases ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
