#!/usr/bin/env python3
"""Module dependency check: no cycle between the crate's modules, and lib.rs's module map
lists exactly the modules there are.

Reads every `crate::a::b` path in src/ (outside `#[cfg(test)]` blocks), builds the graph of
top-level modules (`config`, `informer`, `pipeline`, ...) and, inside each folder module, the
graph of its files, and fails if either has a cycle. `--graph` prints the edges.

Usage: python3 scripts/check-modules.py [--graph]
"""
import pathlib
import re
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
PATH = re.compile(r"\bcrate::((?:\w+::)*\w+)")
USE_GROUP = re.compile(r"\buse\s+crate::\{(.*?)\};", re.S)
SUPER_GROUP = re.compile(r"\buse\s+super::\{(.*?)\};", re.S)


def strip_tests(text: str) -> str:
    """Drop `#[cfg(test)]` items: test modules may reach anywhere."""
    out, skip, depth = [], False, 0
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("#[cfg(test)]"):
            # Skip the next item: up to its matching closing brace (or `;`).
            i += 1
            depth, started = 0, False
            while i < len(lines):
                l = lines[i]
                depth += l.count("{") - l.count("}")
                started = started or "{" in l
                i += 1
                if (started and depth <= 0) or (not started and l.rstrip().endswith(";")):
                    break
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def strip_comments(text: str) -> str:
    return "\n".join(l.split("//", 1)[0] for l in text.splitlines())


def module_of(path: pathlib.Path) -> list[str]:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "mod":
        parts = parts[:-1]
    return parts


def group_paths(body: str) -> list[str]:
    """`a::{b, c::d}, e` → `a`, `e`: the paths of a use group, nested groups cut to their prefix."""
    while True:
        cut = re.sub(r"\{[^{}]*\}", "", body)
        if cut == body:
            break
        body = cut
    return [p.strip().rstrip(":") for p in body.split(",") if p.strip()]


def module_map_is_exact() -> bool:
    """Every module of src/ appears in lib.rs's module map (`x.rs` or `x/`), and nothing else."""
    doc = (SRC / "lib.rs").read_text()
    mapped = set(re.findall(r"^//! (\w+(?:\.rs|/))\s", doc, re.M))
    actual = {f"{p.name}/" if p.is_dir() else p.name for p in SRC.iterdir()} - {"lib.rs", "main.rs"}
    for missing in sorted(actual - mapped):
        print(f"module map in src/lib.rs: {missing} is missing")
    for extra in sorted(mapped - actual):
        print(f"module map in src/lib.rs: {extra} does not exist")
    # Inside folders, each file or sub-folder is named on its folder's lines of the map.
    entries = re.split(r"^//! (?=\w+(?:\.rs|/)\s)", doc, flags=re.M)
    by_folder = {e.split()[0]: e for e in entries[1:]}
    unnamed = []
    for folder in sorted(p for p in SRC.iterdir() if p.is_dir()):
        text = by_folder.get(f"{folder.name}/", "")
        for child in sorted(folder.iterdir()):
            if child.name == "mod.rs":
                continue
            if not re.search(rf"\b{re.escape(child.stem)}\b", text):
                unnamed.append(f"{folder.name}/{child.name}")
    for u in unnamed:
        print(f"module map in src/lib.rs: {u} is not named on its folder's line")
    return mapped == actual and not unnamed


def is_module(folder: str, name: str) -> bool:
    """Whether `crate::{folder}::{name}` is a file or folder module (not an item)."""
    return (SRC / folder / f"{name}.rs").exists() or (SRC / folder / name).is_dir()


def main() -> int:
    files = [p for p in SRC.rglob("*.rs") if p.name not in ("main.rs", "lib.rs")]
    top: dict[str, set[str]] = {}
    inner: dict[str, dict[str, set[str]]] = {}
    for f in files:
        mod = module_of(f)
        text = strip_comments(strip_tests(f.read_text()))
        targets = [m.group(1).split("::") for m in PATH.finditer(text)]
        for g in USE_GROUP.finditer(text):
            targets += [p.split("::") for p in group_paths(g.group(1))]
        src_top = mod[0]
        top.setdefault(src_top, set())
        for t in targets:
            if t[0] in ("self", "super"):
                continue
            if t[0] != src_top:
                top[src_top].add(t[0])
            elif len(mod) >= 2 and len(t) >= 2 and t[1] != mod[1] and is_module(src_top, t[1]):
                inner.setdefault(src_top, {}).setdefault(mod[1], set()).add(t[1])
        # `super::x` inside a folder module's file.
        if len(mod) == 2:
            supers = [m.group(1).split("::") for m in re.finditer(r"\bsuper::((?:\w+::)*\w+)", text)]
            for g in SUPER_GROUP.finditer(text):
                supers += [p.split("::") for p in group_paths(g.group(1))]
            for s in supers:
                if is_module(mod[0], s[0]):
                    if s[0] != mod[1]:
                        inner.setdefault(src_top, {}).setdefault(mod[1], set()).add(s[0])
    failed = not module_map_is_exact()
    graphs = [("crate", top)] + [(f"crate::{k}", v) for k, v in sorted(inner.items())]
    for name, graph in graphs:
        if "--graph" in sys.argv:
            print(f"# {name}")
            for a in sorted(graph):
                if graph[a]:
                    print(f"  {a} -> {', '.join(sorted(graph[a]))}")
        for cycle in cycles(graph):
            failed = True
            print(f"cycle in {name}: {' -> '.join(cycle[:-1])} {cycle[-1]}")
    if not failed:
        print(f"modules: no cycle ({sum(len(v) for v in top.values())} edges between top-level modules)")
    return 1 if failed else 0


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
                out.append(path_through(graph, sorted(comp)) + [f"(all of {{{', '.join(sorted(comp))}}} reach each other)"])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def path_through(graph, comp):
    """A concrete cycle inside a strongly connected component, for the message."""
    start = comp[0]
    members = set(comp)
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in members and w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


if __name__ == "__main__":
    sys.exit(main())
