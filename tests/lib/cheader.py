"""Just enough of a C header reader for the library tests: the function
prototypes (with or without KVS_EXPORT), the struct typedefs with their
member names in order, and the enum constants. It reads kvside's public
headers, which keep to one declaration style; it is not a C parser."""

import re

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def _strip(text):
    text = _COMMENT.sub(" ", text)
    # what a C compiler skips: the C++ guards (extern "C" { ... })
    text = re.sub(r"^\s*#\s*ifdef\s+__cplusplus\b.*?^\s*#\s*endif[^\n]*", " ", text, flags=re.M | re.S)
    # preprocessor lines (with continuations)
    return re.sub(r"^\s*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)


def _flatten(text):
    """Replaces every top-level {...} block by ' {} ;' so that top-level
    statements split on ';' (a static inline body ends its statement)."""
    out, depth = [], 0
    for ch in text:
        if ch == "{":
            if depth == 0:
                out.append(" {} ;")
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def functions(path):
    """{name: exported?} for every function prototype declared at file scope
    (not typedefs, not static inline definitions)."""
    text = _flatten(_strip(open(path).read()))
    found = {}
    for stmt in text.split(";"):
        s = " ".join(stmt.split())
        if not s or "(" not in s or s.startswith(("typedef", "static", "extern \"C\"")) or "{}" in s:
            continue
        m = re.match(r"^(.*?)\b([A-Za-z_]\w*)\s*\(", s)
        if not m:
            continue
        found[m.group(2)] = "KVS_EXPORT" in m.group(1).split()
    return found


def structs(path):
    """{typedef name: [member names in order]} for `typedef struct X {...} X;`."""
    text = _strip(open(path).read())
    out = {}
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        names = []
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            for part in decl.split(","):
                n = re.search(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*$", part.strip())
                if not n:
                    raise ValueError("%s: cannot read member '%s' of %s" % (path, decl, m.group(3)))
                names.append(n.group(1))
        out[m.group(3)] = names
    return out
