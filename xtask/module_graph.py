#!/usr/bin/env python3
"""The module graph of a crate, from its `crate::` paths, and the circles in it.

    python3 xtask/module_graph.py [--crate crates/core] [--rooms tree/modify]
                                  [--allow tree/modify,transaction,space,extent]
                                  [--files] [--check]

A room is a top-level module of the crate (`src/inode/` or `src/engine.rs`), or a
module named in `--rooms`, which then stands apart from its parent (`tree/modify`: the
B-tree's COW changes, over the read side of `tree/` that `disk_io` uses); room A
points at room B when code of A names `crate::B` (in a `use` line, a grouped
`use crate::{B::x, C}` or a path inside code). Comments, string literals and
`#[cfg(test)]` modules are left out: tests may reach anywhere, the code may not.

It prints every room with its lines and the rooms it points at, then each circle
(a strongly connected set of rooms) with the file pairs that make it. With `--check`
it exits 1 when a circle holds a room outside `--allow` (btrfs's own COW loop:
the B-tree modifies blocks that the transaction allocates from space, whose
accounting lives in the extent tree, a B-tree) or when an allowed circle is joined by
any other room. `--files` prints the same at file level.
"""

import argparse
import os
import re
import sys
from collections import defaultdict


def strip_code(text):
    """The text with comments and string/char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F600}') or a lifetime ('a): only blank literals.
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:])
            if m:
                out.append("' '")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def drop_test_modules(code):
    """Remove `#[cfg(test)] mod NAME { ... }` blocks and `#[cfg(test)]` items on one line."""
    out = []
    pos = 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", code):
        if m.start() < pos:
            continue
        out.append(code[pos:m.start()])
        depth, j = 1, m.end()
        while j < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            j += 1
        out.append("\n" * code.count("\n", m.start(), j))
        pos = j
    out.append(code[pos:])
    code = "".join(out)
    # `#[cfg(test)] use crate::x;` and similar one-item forms.
    return re.sub(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?use\s[^;]*;", "", code)


def crate_paths(code):
    """Every `crate::a::b...` path the code names, as lists of segments (grouped uses expanded)."""
    paths = []
    i = 0
    for m in re.finditer(r"\bcrate::", code):
        i = m.end()
        paths.extend(expand(code, i))
    return paths


def expand(code, i):
    """Paths starting at code[i] (just after `crate::`): `a::b`, or `{a::b, c::{d, e}}`."""
    code_len = len(code)
    while i < code_len and code[i].isspace():
        i += 1
    if i < code_len and code[i] == "{":
        depth, j = 1, i + 1
        while j < code_len and depth:
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            j += 1
        inner = code[i + 1:j - 1]
        result = []
        for part in split_top(inner):
            part = part.strip()
            if part:
                result.extend(expand(part, 0))
        return result
    m = re.match(r"[A-Za-z_][A-Za-z0-9_]*(\s*::\s*[A-Za-z_][A-Za-z0-9_]*)*", code[i:])
    if not m:
        return []
    segs = [s.strip() for s in m.group(0).split("::")]
    rest = code[i + m.end():].lstrip()
    if rest.startswith("::"):
        tails = expand(rest[2:], 0)
        return [segs + t for t in tails] or [segs]
    return [segs]


def split_top(s):
    """Split on commas that are not inside braces."""
    parts, depth, cur = [], 0, []
    for c in s:
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def module_files(src, own_rooms=()):
    """(relative path, room) for each .rs file under src, lib.rs excluded: its top-level
    module, or the longest of `own_rooms` (module paths like `tree/modify`) it lies in."""
    files = []
    for dirpath, _, names in os.walk(src):
        for name in sorted(names):
            if not name.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), src)
            if rel in ("lib.rs", "main.rs"):
                continue
            top = rel.split(os.sep)[0]
            room = top[:-3] if top.endswith(".rs") else top
            mod = rel[:-3].replace(os.sep, "/")
            if mod.endswith("/mod"):
                mod = mod[:-4]
            for own in sorted(own_rooms, key=len):
                if mod == own or mod.startswith(own + "/"):
                    room = own
            files.append((rel, room))
    return sorted(files)


def resolve_file(src, segs):
    """The file a `crate::` path lands in: the longest module prefix that exists."""
    best = None
    for k in range(1, len(segs) + 1):
        base = os.path.join(src, *segs[:k])
        if os.path.isfile(base + ".rs"):
            best = os.path.relpath(base + ".rs", src)
        elif os.path.isfile(os.path.join(base, "mod.rs")):
            best = os.path.relpath(os.path.join(base, "mod.rs"), src)
        else:
            break
    return best


def tarjan(nodes, edges):
    """Strongly connected components with more than one member (or a self-loop)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--crate", default="crates/core")
    ap.add_argument("--rooms", default="tree/modify",
                    help="modules that are rooms of their own (comma list of paths like tree/modify)")
    ap.add_argument("--allow", default="tree/modify,transaction,space,extent",
                    help="rooms that may form one circle among themselves (comma list)")
    ap.add_argument("--files", action="store_true", help="also print file-level circles")
    ap.add_argument("--check", action="store_true", help="exit 1 on a circle outside --allow")
    args = ap.parse_args()
    src = os.path.join(args.crate, "src")
    files = module_files(src, [r for r in args.rooms.split(",") if r])
    room_of = dict(files)
    lines = defaultdict(int)
    file_edges = defaultdict(set)
    for rel, room in files:
        with open(os.path.join(src, rel), encoding="utf-8") as f:
            text = f.read()
        lines[room] += text.count("\n")
        code = drop_test_modules(strip_code(text))
        for segs in crate_paths(code):
            target = resolve_file(src, segs)
            if target and target != rel and target in room_of:
                file_edges[rel].add(target)
    room_edges = defaultdict(set)
    pairs = defaultdict(set)
    for a, targets in file_edges.items():
        for b in targets:
            ra, rb = room_of[a], room_of[b]
            if ra != rb:
                room_edges[ra].add(rb)
                pairs[(ra, rb)].add((a, b))
    rooms = sorted(set(room_of.values()))
    print(f"module graph of {args.crate} ({len(files)} files, {sum(lines.values())} lines)")
    for r in sorted(rooms, key=lambda r: (-lines[r], r)):
        print(f"  {r:<14} {lines[r]:>6} lines -> {', '.join(sorted(room_edges[r])) or '-'}")
    circles = tarjan(rooms, room_edges)
    allow = {a for a in args.allow.split(",") if a}
    bad = 0
    for comp in circles:
        outside = [r for r in comp if r not in allow]
        verdict = "allowed (btrfs's COW loop)" if not outside else "NOT ALLOWED: " + ", ".join(outside)
        bad += bool(outside)
        print(f"circle of {len(comp)} rooms: {', '.join(comp)}: {verdict}")
        members = set(comp)
        for (ra, rb), ps in sorted(pairs.items()):
            if ra in members and rb in members and (ra in outside or rb in outside):
                shown = sorted(ps)[:3]
                more = f" and {len(ps) - len(shown)} more" if len(ps) > len(shown) else ""
                names = ", ".join(f"{a} -> {b}" for a, b in shown)
                print(f"    {ra} -> {rb} ({len(ps)} file pairs): {names}{more}")
    if not circles:
        print("no circles")
    if args.files:
        for comp in tarjan([f for f, _ in files], file_edges):
            print(f"file circle of {len(comp)}: {', '.join(comp)}")
    if args.check and bad:
        print(f"{bad} circle(s) hold rooms outside {{{', '.join(sorted(allow))}}}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
