#!/usr/bin/env python3
"""Structure checker for kvside (python3, standard library only).

Two rules, both failing the run (exit 1):

1. The server's files form no dependency circle. Nodes are server/*.c and
   server/*.h, a .c and its .h merged into one node (server.h, with no .c, is
   a node of its own; a module listed in MULTI_FILE_MODULES is one node with
   all its <module>_<part> files). An edge A -> B exists when A.c or A.h #includes B.h, or
   when A.c (or a static inline function of A.h) calls by name a non-static
   function that B.c defines. Calls through function pointers (x->fn(...),
   a callback passed as an argument, a table of handlers) are not edges: they
   are the intended way to break a circle. Strongly connected components
   (Tarjan) of more than one node are printed with the edges inside them and
   their reasons.

2. No product file (server/, common/, storage/, worker/: *.c, *.h) is over
   1,000 lines and no function over 150 lines, unless a comment containing
   `structure-exception: <reason>` appears in the 3 lines before the function
   (or in the first 10 lines of the file, for the file rule).

Usage: check-structure.py [--root DIR] [--report] [--near N]
  --root DIR  the source tree (default: the parent of this script's folder)
  --report    print the graph (nodes, edges with reasons, components) and the
              sizes (every product file, functions of N lines or more) for the
              docs, then the violations; exits 0 whatever they are
"""

import argparse
import os
import re
import sys

MAX_FILE_LINES = 1000
MAX_FUNC_LINES = 150
EXC_BEFORE_FUNC = 3
EXC_FILE_HEAD = 10
PRODUCT_DIRS = ("server", "common", "storage", "worker")
MARKER = "structure-exception:"
GENERATED = re.compile(r"generated|do not edit", re.I)

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NUMBER = re.compile(r"\.?[0-9](?:[eEpP][+-]|[A-Za-z0-9_.])*")


class Tok:
    __slots__ = ("kind", "text", "line", "pp")

    def __init__(self, kind, text, line, pp):
        self.kind = kind  # 'id', 'num', 'str', 'chr', 'punct'
        self.text = text
        self.line = line
        self.pp = pp  # inside a preprocessor directive

    def __repr__(self):
        return "%s:%r@%d%s" % (self.kind, self.text, self.line, "pp" if self.pp else "")


def lex(src):
    """Tokens of a C file (comments dropped) and its comments as
    (first line, last line, text). Strings and character literals are single
    tokens, so nothing inside them is taken for a call or a brace."""
    toks, comments = [], []
    i, n, line = 0, len(src), 1
    pp = False
    at_line_start = True
    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
            pp = False
            at_line_start = True
            continue
        if c == "\\" and i + 1 < n and src[i + 1] == "\n":  # line continuation
            line += 1
            i += 2
            continue
        if c in " \t\r\f\v":
            i += 1
            continue
        if src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            text = src[i:j]
            comments.append((line, line + text.count("\n"), text))
            line += text.count("\n")
            i = j
            continue
        if src.startswith("//", i):
            j = i
            while j < n and src[j] != "\n":  # a // comment continues over a backslash-newline
                if src[j] == "\\" and j + 1 < n and src[j + 1] == "\n":
                    j += 2
                    continue
                j += 1
            text = src[i:j]
            comments.append((line, line + text.count("\n"), text))
            line += text.count("\n")
            i = j
            continue
        if c == "#" and at_line_start:
            pp = True
            at_line_start = False
            toks.append(Tok("punct", "#", line, True))
            i += 1
            continue
        at_line_start = False
        if c == '"' or c == "'":
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            text = src[i : j + 1]
            toks.append(Tok("str" if c == '"' else "chr", text, line, pp))
            i = j + 1
            continue
        if pp and toks and toks[-1].text == "include" and c == "<":
            j = src.find(">", i)
            j = n if j < 0 else j
            toks.append(Tok("str", src[i : j + 1], line, pp))
            i = j + 1
            continue
        m = IDENT.match(src, i)
        if m:
            # string prefixes: u8"..", L'..'
            toks.append(Tok("id", m.group(), line, pp))
            i = m.end()
            continue
        m = NUMBER.match(src, i)
        if m:
            toks.append(Tok("num", m.group(), line, pp))
            i = m.end()
            continue
        if src.startswith("->", i):
            toks.append(Tok("punct", "->", line, pp))
            i += 2
            continue
        toks.append(Tok("punct", c, line, pp))
        i += 1
    return toks, comments


class Func:
    __slots__ = ("name", "static", "start", "end", "body")

    def __init__(self, name, static, start, end, body):
        self.name, self.static, self.start, self.end = name, static, start, end
        self.body = body  # (first, last) token indices of the body, braces included

    @property
    def lines(self):
        return self.end - self.start + 1


def skip_attributes_back(code, k):
    """Index of the token before any trailing __attribute__((..)) groups
    ending at code[k], or k itself."""
    while k >= 0 and code[k].text == ")":
        depth, j = 0, k
        while j >= 0:
            if code[j].text == ")":
                depth += 1
            elif code[j].text == "(":
                depth -= 1
                if depth == 0:
                    break
            j -= 1
        if j >= 1 and code[j - 1].text in ("__attribute__", "__attribute", "__declspec"):
            k = j - 2
        else:
            return k
    return k


def functions(toks):
    """Function definitions: name, static or not, first line of the
    declaration, line of the closing brace. Preprocessor tokens are left out,
    so both branches of an #if are read as written."""
    code = [t for t in toks if not t.pp]
    found = []
    depth = 0
    decl_start = 0
    body_open = None  # (Func under construction, index of its '{')
    i = 0
    while i < len(code):
        t = code[i]
        if t.text == "{":
            if depth == 0:
                f = func_head(code, decl_start, i)
                body_open = (f, i) if f else None
            depth += 1
        elif t.text == "}":
            depth -= 1
            if depth == 0:
                if body_open:
                    f, first = body_open
                    f.end = t.line
                    f.body = (first, i)
                    found.append(f)
                    body_open = None
                    decl_start = i + 1
                # a struct/enum/initializer: the declaration continues to ';'
            elif depth < 0:
                depth = 0
        elif t.text == ";" and depth == 0:
            decl_start = i + 1
        i += 1
    return found, code


def func_head(code, start, brace):
    """The Func whose body opens at code[brace], or None when that brace
    opens a struct, union, enum or initializer."""
    decl = code[start:brace]
    if not decl:
        return None
    depth = 0
    for t in decl:
        if t.text == "(":
            depth += 1
        elif t.text == ")":
            depth -= 1
        elif t.text == "=" and depth == 0:
            return None
    k = skip_attributes_back(code, brace - 1)
    if k < start or code[k].text != ")":
        return None
    # the parameter list's '(' and the name before it
    depth, j = 0, k
    while j >= start:
        if code[j].text == ")":
            depth += 1
        elif code[j].text == "(":
            depth -= 1
            if depth == 0:
                break
        j -= 1
    if j <= start or code[j - 1].kind != "id":
        return None
    name = code[j - 1].text
    if name in ("if", "while", "for", "switch", "return", "sizeof"):
        return None
    static = any(t.text == "static" for t in code[start : j - 1])
    return Func(name, static, code[start].line, 0, None)


def call_sites(toks):
    """Names followed by '(' inside braces or in a #define body, not after
    '.' or '->' (a call through a pointer), with their lines."""
    calls = []
    depth = 0
    prev = None
    define_name = None
    for idx, t in enumerate(toks):
        if t.pp:
            if prev is not None and prev.text == "define" and t.kind == "id":
                define_name = idx
        if not t.pp:
            if t.text == "{":
                depth += 1
            elif t.text == "}":
                depth = max(0, depth - 1)
        if (t.kind == "id" and idx + 1 < len(toks) and toks[idx + 1].text == "("
                and (depth > 0 or t.pp) and idx != define_name
                and (prev is None or prev.text not in (".", "->"))):
            if not t.pp or _in_define(toks, idx):
                calls.append((t.text, t.line))
        prev = t
    return calls


def _in_define(toks, idx):
    """Whether the preprocessor token toks[idx] belongs to a #define body."""
    j = idx
    while j > 0 and toks[j - 1].pp and toks[j].text != "#":
        j -= 1
    return j + 1 < len(toks) and toks[j].text == "#" and toks[j + 1].text == "define"


def includes(toks):
    out = []
    for i, t in enumerate(toks):
        if (t.pp and t.text == "#" and i + 2 < len(toks) and toks[i + 1].text == "include"
                and toks[i + 2].kind == "str" and toks[i + 2].text.startswith('"')):
            out.append((toks[i + 2].text.strip('"'), t.line))
    return out


class Source:
    def __init__(self, root, rel):
        self.rel = rel
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            self.text = f.read()
        self.n_lines = self.text.count("\n") + (0 if self.text.endswith("\n") or not self.text else 1)
        self.toks, self.comments = lex(self.text)
        self.funcs, _ = functions(self.toks)

    def exception_lines(self):
        """Lines that carry the structure-exception marker with a reason."""
        out = {}
        for first, _, text in self.comments:
            for off, ln in enumerate(text.split("\n")):
                k = ln.find(MARKER)
                if k >= 0:
                    reason = ln[k + len(MARKER):].replace("*/", "").strip()
                    out[first + off] = reason
        return out


# ---- the server's graph -----------------------------------------------------------


# Modules spread over several files for size, sharing a private header: every
# server file named <module>.c/.h or <module>_<part>.c/.h is one node. The
# CUDA copy engine is one (copy_cuda.c, copy_cuda_map.c, copy_cuda_wait.c,
# copy_cuda_impl.h), and so is its stand-in without CUDA headers
# (copy_cuda_none.c, built instead of the others).
MULTI_FILE_MODULES = ("copy_cuda",)


def node_of(fname):
    stem = os.path.splitext(fname)[0]
    for m in MULTI_FILE_MODULES:
        if stem.startswith(m + "_"):
            return m
    return stem


def build_graph(root):
    sdir = os.path.join(root, "server")
    files = sorted(f for f in os.listdir(sdir) if f.endswith((".c", ".h"))
                   and os.path.isfile(os.path.join(sdir, f)))
    srcs = {f: Source(root, os.path.join("server", f)) for f in files}
    nodes = {}
    for f in files:
        nodes.setdefault(node_of(f), []).append(f)
    # non-static functions defined in each .c
    defined = {}
    for f, s in srcs.items():
        if f.endswith(".c"):
            for fn in s.funcs:
                if not fn.static:
                    defined.setdefault(fn.name, set()).add(node_of(f))
    edges = {}  # (a, b) -> {'include': [...], 'call': {name: [file:line]}}

    def edge(a, b):
        return edges.setdefault((a, b), {"include": [], "call": {}})

    # a call resolves to the caller's own definition (a static helper of the
    # same name as another file's function shadows it)
    local = {}
    for f, s in srcs.items():
        local.setdefault(node_of(f), set()).update(fn.name for fn in s.funcs)
    for f, s in srcs.items():
        a = node_of(f)
        for inc, line in includes(s.toks):
            b = node_of(os.path.basename(inc))
            if inc.endswith(".h") and b in nodes and b != a and (b + ".h") in files:
                edge(a, b)["include"].append("%s:%d #include \"%s\"" % (f, line, inc))
        for name, line in call_sites(s.toks):
            if name in local[a]:
                continue
            for b in defined.get(name, ()):
                if b != a:
                    edge(a, b)["call"].setdefault(name, []).append("%s:%d" % (f, line))
    return nodes, edges, srcs


def tarjan(nodes, succ):
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def strong(v):  # recursion depth is bounded by the number of files
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(succ.get(v, ())):
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
            out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return out


def shortest_cycle(comp, succ):
    """One shortest cycle through the component's first node (BFS), as a
    list of nodes starting and ending there."""
    members = set(comp)
    start = comp[0]
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(succ.get(v, ())):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return [start]


def label(node, nodes):
    fs = nodes[node]
    c = [f for f in fs if f.endswith(".c")]
    return c[0] if c else fs[0]


def reason_text(r, where=False):
    """An edge's reasons: its includes, then the names it calls (with the
    first call site and how many more when where is set)."""
    parts = []
    for inc in r["include"]:
        loc, _, what = inc.partition(" ")
        parts.append("%s (%s)" % (what, loc) if where else what)
    if r["call"]:
        names = []
        for name in sorted(r["call"]):
            sites = r["call"][name]
            more = " +%d" % (len(sites) - 1) if len(sites) > 1 else ""
            names.append("%s (%s%s)" % (name, sites[0], more) if where else name)
        parts.append("calls " + ", ".join(names))
    return "; ".join(parts)


# ---- sizes ------------------------------------------------------------------------


def product_files(root):
    out = []
    for d in PRODUCT_DIRS:
        top = os.path.join(root, d)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(x for x in dirnames if not x.startswith("."))
            for f in sorted(filenames):
                if not f.endswith((".c", ".h")):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), root)
                with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
                    head = "".join(fh.readline() for _ in range(5))
                if GENERATED.search(head):
                    continue
                out.append(rel)
    return out


def size_violations(root, srcs_cache=None):
    files, viols = [], []
    for rel in product_files(root):
        s = (srcs_cache or {}).get(rel) or Source(root, rel)
        files.append(s)
        exc = s.exception_lines()
        if s.n_lines > MAX_FILE_LINES:
            ok = [ln for ln, why in exc.items() if ln <= EXC_FILE_HEAD and why]
            if not ok:
                viols.append("%s:1: file has %d lines (limit %d)" % (rel, s.n_lines, MAX_FILE_LINES))
        for fn in s.funcs:
            if fn.lines > MAX_FUNC_LINES:
                ok = [ln for ln, why in exc.items()
                      if fn.start - EXC_BEFORE_FUNC <= ln < fn.start and why]
                if not ok:
                    viols.append("%s:%d: function %s has %d lines (limit %d)"
                                 % (rel, fn.start, fn.name, fn.lines, MAX_FUNC_LINES))
    return files, viols


# ---- main ---------------------------------------------------------------------------


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--near", type=int, default=100, help="--report: list functions of this many lines or more")
    a = ap.parse_args(argv)
    root = a.root

    nodes, edges, srcs = build_graph(root)
    succ = {}
    for (x, y) in edges:
        succ.setdefault(x, set()).add(y)
    sccs = tarjan(nodes, succ)
    cycles = [c for c in sccs if len(c) > 1]
    cache = {os.path.join("server", f): s for f, s in srcs.items()}
    files, size_viols = size_violations(root, cache)

    if a.report:
        print("# server dependency graph")
        print("\n## nodes (%d)" % len(nodes))
        for v in sorted(nodes):
            lines = sum(srcs[f].n_lines for f in nodes[v])
            print("  %-14s %s (%d lines)" % (v, " + ".join(nodes[v]), lines))
        print("\n## edges (%d)" % len(edges))
        for (x, y) in sorted(edges):
            print("  %s -> %s: %s" % (label(x, nodes), label(y, nodes), reason_text(edges[(x, y)])))
        print("\n## strongly connected components")
        for c in sccs:
            print("  " + (", ".join(label(v, nodes) for v in c)) + ("  <-- CYCLE" if len(c) > 1 else ""))
        print("\n# sizes (limits: file %d lines, function %d lines)" % (MAX_FILE_LINES, MAX_FUNC_LINES))
        print("\n## product files")
        for s in sorted(files, key=lambda s: -s.n_lines):
            print("  %5d  %s" % (s.n_lines, s.rel))
        print("\n## functions of %d lines or more" % a.near)
        big = [(fn.lines, s.rel, fn) for s in files for fn in s.funcs if fn.lines >= a.near]
        for n, rel, fn in sorted(big, key=lambda x: (-x[0], x[1])):
            print("  %5d  %s:%d-%d %s" % (n, rel, fn.start, fn.end, fn.name))
        print()

    status = 0
    for c in cycles:
        status = 1
        members = set(c)
        print("cycle: %d server files depend on each other: %s"
              % (len(c), ", ".join(label(v, nodes) for v in c)))
        path = shortest_cycle(c, succ)
        print("  e.g. " + " -> ".join(label(v, nodes) for v in path))
        for (x, y) in sorted(edges):
            if x in members and y in members:
                print("  %s -> %s: %s" % (label(x, nodes), label(y, nodes), reason_text(edges[(x, y)], True)))
    for v in size_viols:
        status = 1
        print(v)
    if status == 0:
        print("structure ok: %d server nodes, %d edges, no cycle; %d product files within the size limits"
              % (len(nodes), len(edges), len(files)))
    return 0 if a.report else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
