#!/usr/bin/env python3
"""The layout rules `make lint` holds the code to, read from the sources as text:

1. No import cycle between the files of a crate: file A naming `crate::b::…` (or `super::…`
   resolving to B, or a bare `b::…` where `b` is a module A itself declares, as the crate
   root names its modules) while B names A, directly or through others, is an error. Declaring a
   module (`mod b;`) is not an import; test modules (`#[cfg(test)] mod tests { … }` at the end
   of a file) are left out, since they may reach anywhere.
2. No production source file over 800 lines (a trailing test module not counted) unless its opening comment says why it is one
   concern: a line starting `//! One concern:`.

Usage: tools/layout_check.py [crate source dirs…] (default: every crate of the workspace).
Exit 1 with the offending cycles or files listed.
"""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 800
CRATE_SRC_DIRS = [
    "src",
    "collector/src",
    "filter/src",
    "host-test/src",
    "sim/src",
    "text/src",
    "bench/src",
    "js/src",
]

PATH_RE = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP_RE = re.compile(r"\buse\s+(crate|super)::\{([^;]*)\};", re.S)


def show(path: Path) -> str:
    """`path` relative to the repository when it is inside it (the self-test's are not)."""
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def module_of(src: Path, file: Path) -> tuple:
    rel = file.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip_tests(text: str) -> str:
    """Cuts a trailing `#[cfg(test)] mod … {` block and comments, keeping line structure."""
    m = re.search(r"^#\[cfg\(test\)\]\s*\n\s*(pub\s+)?mod\s+\w+\s*\{", text, re.M)
    if m:
        text = text[: m.start()]
    text = re.sub(r"//[^\n]*", "", text)
    return text


CHILD_RE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;", re.M)


def imports(text: str, here: tuple, is_dir_module: bool):
    """Module paths (tuples) named by `crate::`/`super::` paths in `text`, and by bare paths
    starting with a module this file declares (`mod b;` then `b::…` or `use b::…`)."""
    base_for_super = here[:-1] if not is_dir_module else here[:-1]
    found = []
    children = set(CHILD_RE.findall(text))
    if children:
        names = "|".join(sorted(children))
        bare_group = re.compile(r"\buse\s+(" + names + r")::\{([^;]*)\};", re.S)
        for m in bare_group.finditer(text):
            for item in re.split(r",", m.group(2)):
                name = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)", item)
                if name:
                    found.append(here + (m.group(1), name.group(1)))
        bare = re.compile(r"(?<![\w:])(" + names + r")((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
        for m in bare.finditer(bare_group.sub("", text)):
            found.append(here + (m.group(1),) + tuple(s for s in m.group(2).split("::") if s))

    def resolve(kind, rest):
        segs = [s for s in rest.split("::") if s]
        if kind == "crate":
            return tuple(segs)
        # `super` is the parent of the module this file is.
        parent = list(base_for_super)
        while segs and segs[0] == "super":
            segs = segs[1:]
            parent = parent[:-1]
        return tuple(parent) + tuple(segs)

    for m in USE_GROUP_RE.finditer(text):
        kind, body = m.group(1), m.group(2)
        for item in re.split(r",", body):
            item = item.strip()
            name = re.match(r"([A-Za-z_][A-Za-z0-9_]*)", item)
            if name:
                found.append(resolve(kind, "::" + name.group(1)))
    text = USE_GROUP_RE.sub("", text)
    for m in PATH_RE.finditer(text):
        found.append(resolve(m.group(1), m.group(2)))
    return found


def check_crate(src: Path):
    errors = []
    files = sorted(p for p in src.rglob("*.rs") if "bin" not in p.relative_to(src).parts[:1])
    # main.rs beside lib.rs is another crate (the binary, using the library by its name):
    # both would be module `()`, and the binary's root would hide the library's.
    if (src / "lib.rs").exists():
        files = [p for p in files if p != src / "main.rs"]
    mods = {}
    for f in files:
        mods[module_of(src, f)] = f
    edges = {m: set() for m in mods}
    for mod, f in mods.items():
        raw = f.read_text()
        text = strip_tests(raw)
        lines = text.count("\n")
        if lines > MAX_LINES and not re.search(r"^//! One concern:", raw, re.M):
            errors.append(
                f"{show(f)}: {lines} lines and no `//! One concern:` line saying why"
            )
        is_dir = f.name in ("mod.rs", "lib.rs", "main.rs")
        for target in imports(text, mod, is_dir):
            # The longest known module that prefixes the path is the file it names.
            best = None
            for i in range(len(target), -1, -1):
                if target[:i] in mods:
                    best = target[:i]
                    break
            if best is not None and best != mod:
                edges[mod].add(best)
    # Cycles: strongly connected components of more than one file.
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in mods:
        if v not in index:
            strong(v)
    for comp in out:
        names = sorted((show(mods[m])) for m in comp)
        pairs = sorted(
            f"{show(mods[a])} -> {show(mods[b])}"
            for a in comp
            for b in edges[a]
            if b in comp
        )
        errors.append("import cycle between " + ", ".join(names) + ":\n    " + "\n    ".join(pairs))
    return errors


def main():
    dirs = sys.argv[1:] or [d for d in CRATE_SRC_DIRS if (REPO / d).is_dir()]
    errors = []
    for d in dirs:
        errors += check_crate((REPO / d).resolve())
    for e in errors:
        print(e)
    if errors:
        print(f"layout: {len(errors)} problem(s)")
        sys.exit(1)
    print(f"layout: {len(dirs)} crates, no import cycle, no oversized file")


if __name__ == "__main__":
    main()
