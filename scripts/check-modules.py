#!/usr/bin/env python3
"""Module dependency check: no cycle between the crate's modules, none between its files, and
lib.rs's module map lists exactly the modules there are.

Reads every `crate::`, `super::` and `self::` path in src/ (in `use` trees and inline, outside
`#[cfg(test)]` blocks) and builds two graphs: the top-level modules (`config`, `informer`,
`pipeline`, ...), and every file at every depth, where a name is resolved to the file that
defines it, through a folder's `pub use` re-exports (a folder's `mod.rs` or `lib.rs` re-exporting
a name is no dependency of its own; code in it that uses a child's name is). It fails on a cycle
in either, except the file cycles listed in KNOWN_FILE_CYCLES (found when the file graph was
added; each one is to be broken, and one that is gone fails the check until it is taken off the
list). `--graph` prints the edges.

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
    if not file_cycles("--graph" in sys.argv):
        failed = True
    if not failed:
        print(f"modules: no cycle ({sum(len(v) for v in top.values())} edges between top-level modules; none between files)")
    return 1 if failed else 0


ITEM = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:async\s+|const\s+|unsafe\s+)*"
    r"(?:fn|struct|enum|trait|type|const|static|mod|union)\s+(\w+)",
    re.M,
)
MACRO = re.compile(r"macro_rules!\s*(\w+)")
USE_STMT = re.compile(r"^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]*);", re.M | re.S)
INLINE = re.compile(r"\b((?:crate|self|super)(?:::super)*(?:::\w+)+)")


def expand_use(tree: str) -> list[tuple[list[str], str]]:
    """`a::{b, c::{d, e}}` → ([a, b], b), ([a, c, d], d), ([a, c, e], e): each leaf path and its
    last segment (aliases are marked `x@y` by the caller, before the whitespace goes)."""
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix: list[str], t: str):
        # Split a group body at top-level commas.
        if t.startswith("{") and t.endswith("}"):
            depth, start, body = 0, 0, t[1:-1]
            for i, ch in enumerate(body + ","):
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                elif ch == "," and depth == 0:
                    part = body[start:i]
                    if part:
                        walk(prefix, part)
                    start = i + 1
            return
        head, sep, rest = t.partition("::{")
        if sep:
            walk(prefix + [s for s in head.split("::") if s], "{" + rest)
            return
        segs = [x for x in t.split("::") if x]
        out.append((prefix + segs, segs[-1] if segs else ""))

    walk([], tree)
    return out


class Files:
    def __init__(self):
        self.files: dict[tuple, pathlib.Path] = {}
        self.items: dict[tuple, set[str]] = {}
        self.reexports: dict[tuple, dict[str, list[str]]] = {}
        self.texts: dict[tuple, str] = {}
        for f in SRC.rglob("*.rs"):
            if f.name != "main.rs":
                self.files[() if f.name == "lib.rs" else tuple(module_of(f))] = f
        # Every file known first: a bare `use child::x` resolves only against known modules.
        for mod, f in self.files.items():
            text = strip_comments(strip_tests(f.read_text()))
            self.texts[mod] = text
            self.items[mod] = set(ITEM.findall(text)) | set(MACRO.findall(text))
            re_ = {}
            for m in USE_STMT.finditer(text):
                if not m.group(1):
                    continue
                for path, name in self.use_leaves(mod, m.group(2)):
                    re_[name] = path
            self.reexports[mod] = re_

    def use_leaves(self, mod: tuple, tree: str) -> list[tuple[list[str], str]]:
        """Leaves of a use tree as absolute module paths (crate-relative), with their bound name."""
        leaves = []
        # Aliases first: `a::b as c` → path a::b bound as c.
        aliased = re.sub(r"(\w+)\s+as\s+(\w+)", r"\1@\2", tree)
        for path, _ in expand_use(aliased):
            if path and path[-1] == "self":
                path = path[:-1]
            if not path:
                continue
            bound = path[-1]
            if "@" in bound:
                real, bound = bound.split("@")
                path = path[:-1] + [real]
            absolute = self.absolute(mod, path)
            if absolute is not None:
                leaves.append((absolute, bound))
        return leaves

    def absolute(self, mod: tuple, path: list[str]):
        """A path as seen from module `mod`, made crate-relative; None for an external crate."""
        if not path:
            return None
        if path[0] == "crate":
            return path[1:]
        if path[0] == "self":
            return list(mod) + path[1:]
        if path[0] == "super":
            base = list(mod)
            while path and path[0] == "super":
                base = base[:-1]
                path = path[1:]
            return base + path
        # A bare path: a child module of `mod` (2018 paths), else an external crate or a std path.
        if tuple(mod) + (path[0],) in self.files:
            return list(mod) + path
        return None

    def resolve(self, path: list[str], depth: int = 0):
        """The file defining what `path` (crate-relative) names, following re-exports."""
        n = len(path)
        while n >= 0 and tuple(path[:n]) not in self.files:
            n -= 1
        if n < 0:
            return None
        mod, rest = tuple(path[:n]), path[n:]
        if not rest or rest[0] in self.items[mod] or depth > 10:
            return mod
        target = self.reexports[mod].get(rest[0])
        if target is not None:
            return self.resolve(target + rest[1:], depth + 1)
        # A glob re-export, an enum variant, a derive: the module itself.
        return mod

    def graph(self) -> dict[str, set[str]]:
        edges: dict[str, set[str]] = {}
        for mod, text in self.texts.items():
            name = self.label(mod)
            edges.setdefault(name, set())
            paths = []
            is_mod_file = self.files[mod].name in ("mod.rs", "lib.rs")
            for m in USE_STMT.finditer(text):
                # A folder's re-exports are transparent: names resolve through them.
                if not (m.group(1) and is_mod_file):
                    paths += [p for p, _ in self.use_leaves(mod, m.group(2))]
            plain = USE_STMT.sub("", text)
            for m in INLINE.finditer(plain):
                a = self.absolute(mod, m.group(1).split("::"))
                if a is not None:
                    paths.append(a)
            for p in paths:
                target = self.resolve(p)
                if target is not None and target != mod and not self.is_ancestor_decl(mod, target):
                    edges[name].add(self.label(target))
        return edges

    @staticmethod
    def is_ancestor_decl(mod: tuple, target: tuple) -> bool:
        """The crate root: every module hangs from it (its `mod` lines are no dependency)."""
        return target == ()

    @staticmethod
    def label(mod: tuple) -> str:
        return "/".join(mod) or "lib"


# File cycles to be broken, each the set of files that reach each other (none now: the four
# found when the file graph came were broken with it). A new cycle, or a listed one that grew,
# fails the check.
KNOWN_FILE_CYCLES: list[set[str]] = []


def file_cycles(show: bool) -> bool:
    """Checks the graph of files; whether it passes."""
    graph = Files().graph()
    if show:
        print("# files")
        for a in sorted(graph):
            if graph[a]:
                print(f"  {a} -> {', '.join(sorted(graph[a]))}")
    ok = True
    seen = []
    for cycle in cycles(graph):
        members = set(re.search(r"\{(.*)\}", cycle[-1]).group(1).split(", "))
        seen.append(members)
        if members in KNOWN_FILE_CYCLES:
            print(f"known file cycle (to break): {' -> '.join(cycle[:-1])}")
            continue
        ok = False
        print(f"cycle between files: {' -> '.join(cycle[:-1])} {cycle[-1]}")
    for known in KNOWN_FILE_CYCLES:
        if known not in seen:
            ok = False
            print(f"KNOWN_FILE_CYCLES lists {sorted(known)}, which is no cycle now: take it off")
    return ok


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
