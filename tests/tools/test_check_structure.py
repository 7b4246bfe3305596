#!/usr/bin/env python3
"""Self-test of tools/check-structure.py on small synthetic trees written to a
temporary directory: a circle through an include and a call is found (with
its reasons), a callback or a call through a pointer is no edge, a
structure-exception comment is honoured only where and as the rule says, and
a 151-line function or a 1,001-line file is caught while 150 and 1,000 pass.

Usage: test_check_structure.py [PATH/TO/check-structure.py]"""

import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(HERE, "..", "..", "tools", "check-structure.py")


def func_of(name, n_lines, static=False):
    assert n_lines >= 4
    lines = ["%sint %s(int x)" % ("static " if static else "", name), "{"]
    lines += ["\tx += %d;" % i for i in range(n_lines - 4)]
    lines += ["\treturn x;", "}"]
    return "\n".join(lines) + "\n"


class Tree:
    def __init__(self, files):
        self.tmp = tempfile.TemporaryDirectory(prefix="kvs-structure-")
        self.root = self.tmp.name
        for d in ("server", "common", "storage", "worker"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        for rel, text in files.items():
            path = os.path.join(self.root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)

    def run(self, *args):
        p = subprocess.run([sys.executable, CHECKER, "--root", self.root, *args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return p.returncode, p.stdout

    def close(self):
        self.tmp.cleanup()


class Checker(unittest.TestCase):
    def check(self, files, *args):
        t = Tree(files)
        try:
            return t.run(*args)
        finally:
            t.close()

    def test_clean_tree_passes(self):
        rc, out = self.check({
            "server/a.c": '#include "a.h"\n#include "b.h"\nint a_fn(void) { return b_fn(); }\n',
            "server/a.h": "int a_fn(void);\n",
            "server/b.c": '#include "b.h"\nint b_fn(void) { return 1; }\n',
            "server/b.h": "int b_fn(void);\n",
        })
        self.assertEqual(rc, 0, out)
        self.assertIn("no cycle", out)

    def test_cycle_found_with_reasons(self):
        # a -> b by include, b -> c by a call, c -> a by a call: one circle of
        # three; d hangs off it and is not part of it
        rc, out = self.check({
            "server/a.c": '#include "b.h"\nint a_fn(int x)\n{\n\treturn b_fn(x);\n}\n',
            "server/b.h": "int b_fn(int x);\n",
            "server/b.c": "int c_fn(int);\nint b_fn(int x)\n{\n\treturn c_fn(x) + 1;\n}\n",
            "server/c.c": "int a_fn(int);\nint c_fn(int x)\n{\n\treturn x ? a_fn(x - 1) : 0;\n}\n",
            "server/d.c": "int a_fn(int);\nint d_fn(void)\n{\n\treturn a_fn(3);\n}\n",
        })
        self.assertEqual(rc, 1, out)
        self.assertIn("cycle: 3 server files depend on each other: a.c, b.c, c.c", out)
        self.assertIn('a.c -> b.c: #include "b.h" (a.c:1); calls b_fn (a.c:4)', out)
        self.assertIn("b.c -> c.c: calls c_fn (b.c:4)", out)
        self.assertIn("c.c -> a.c: calls a_fn (c.c:4)", out)
        self.assertNotIn("d.c ->", out.split("\n", 1)[1])  # not inside the circle

    def test_header_only_include_cycle(self):
        # a.h includes b.h and b.c includes a.h: include edges both ways
        rc, out = self.check({
            "server/a.h": '#include "b.h"\n',
            "server/a.c": '#include "a.h"\n',
            "server/b.h": "\n",
            "server/b.c": '#include "a.h"\n',
        })
        self.assertEqual(rc, 1, out)
        self.assertIn("cycle: 2 server files depend on each other: a.c, b.c", out)

    def test_multi_file_module_is_one_node(self):
        # copy_cuda.c, copy_cuda_wait.c and their private header call each
        # other: one module (MULTI_FILE_MODULES), no circle; a file of
        # another name doing the same is one
        parts = {
            "server/copy_cuda.h": "int copy_submit(int x);\n",
            "server/copy_cuda_impl.h": '#include "copy_cuda.h"\nint copy_wait(int x);\n',
            "server/copy_cuda.c": '#include "copy_cuda_impl.h"\nint copy_submit(int x)\n{\n\treturn copy_wait(x);\n}\n',
            "server/copy_cuda_wait.c": '#include "copy_cuda_impl.h"\nint copy_wait(int x)\n{\n\treturn x ? copy_submit(x - 1) : 0;\n}\n',
        }
        rc, out = self.check(parts)
        self.assertEqual(rc, 0, out)
        other = dict(parts)
        other["server/waiter.c"] = other.pop("server/copy_cuda_wait.c")
        rc, out = self.check(other)
        self.assertEqual(rc, 1, out)
        self.assertIn("copy_cuda.c", out)
        self.assertIn("waiter.c", out)

    def test_callbacks_are_not_edges(self):
        # b calls into a only through a function pointer (argument, struct
        # member, table entry); a's prototype in b.c, a comment and a string
        # naming a's function, and a static function of the same name in b
        # are no calls either
        rc, out = self.check({
            "server/a.c": '#include "b.h"\nvoid a_cb(void *p) { (void)p; }\n'
                          "int helper(void) { return 0; }\n"
                          "void a_start(void) { b_run(a_cb, 0); }\n",
            "server/b.h": "typedef void (*b_fn)(void *);\nvoid b_run(b_fn cb, void *arg);\n",
            "server/b.c": '#include "b.h"\n#include <stdio.h>\n'
                          "void a_cb(void *p);\n"
                          "struct ops { void (*a_cb)(void *); };\n"
                          "static const struct ops table = {.a_cb = a_cb};\n"
                          "static int helper(void) { return 1; }\n"
                          "void b_run(b_fn cb, void *arg)\n{\n"
                          "\t/* a_cb(arg) would be a back edge; */\n"
                          "\t// a_cb(arg) too\n"
                          '\tputs("a_cb(arg)");\n'
                          "\tcb(arg);\n\ttable.a_cb(arg);\n\tconst struct ops *o = &table;\n"
                          "\to->a_cb(arg);\n\t(void)helper();\n}\n",
        })
        self.assertEqual(rc, 0, out)
        t = Tree({
            "server/a.c": '#include "b.h"\nvoid a_cb(void *p) { (void)p; }\n',
            "server/b.h": "void b_run(void);\n",
            "server/b.c": "void a_cb(void *p);\nvoid b_run(void) { a_cb(0); }\n",
        })
        try:
            rc, out = t.run()  # the same name called directly is an edge
            self.assertEqual(rc, 1, out)
            self.assertIn("b.c -> a.c: calls a_cb", out)
        finally:
            t.close()

    def test_function_length(self):
        rc, out = self.check({"common/f.c": func_of("ok150", 150) + "\n" + func_of("big151", 151, static=True)})
        self.assertEqual(rc, 1, out)
        self.assertIn("common/f.c:152: function big151 has 151 lines (limit 150)", out)
        self.assertNotIn("ok150", out)

    def test_exception_honoured(self):
        rc, out = self.check({
            "worker/g.c": "/* role of the file */\n\n"
                          "/* structure-exception: one table-driven switch, splitting it hides the table */\n"
                          "\n" + func_of("allowed", 200) + "\n"
                          # a marker 4 lines up is too far; one without a reason is ignored
                          "/* structure-exception: too far */\n\n\n\n" + func_of("far", 160) + "\n"
                          "/* structure-exception: */\n" + func_of("no_reason", 160),
        })
        self.assertEqual(rc, 1, out)
        self.assertNotIn("allowed", out)
        self.assertIn("function far has 160 lines", out)
        self.assertIn("function no_reason has 160 lines", out)

    def test_file_length(self):
        filler = "".join("int v%d;\n" % i for i in range(1000))
        rc, out = self.check({
            "storage/ok.c": filler,                                   # exactly 1,000
            "storage/long.h": filler + "int last;\n",                 # 1,001
            "server/excused.c": "/* big on purpose\n * structure-exception: generated-like table */\n"
                                + filler,
            "storage/late.c": "\n" * 10 + "/* structure-exception: too late */\n" + filler,
            "tests/huge.c": filler * 2,                               # not product code
        })
        self.assertEqual(rc, 1, out)
        self.assertIn("storage/long.h:1: file has 1001 lines (limit 1000)", out)
        self.assertIn("storage/late.c:1: file has 1011 lines", out)
        self.assertNotIn("ok.c", out)
        self.assertNotIn("excused.c", out)
        self.assertNotIn("huge.c", out)

    def test_report(self):
        rc, out = self.check({
            "server/a.c": '#include "b.h"\nint a_fn(void) { return b_fn(); }\n',
            "server/b.h": "int b_fn(void);\n",
            "server/b.c": "int a_fn(void);\nint b_fn(void) { return a_fn(); }\n",
            "server/s.h": "struct s { int x; };\n",
        }, "--report", "--near", "1")
        self.assertEqual(rc, 0, out)  # --report documents; it does not fail
        self.assertIn("## nodes (3)", out)
        self.assertIn('a.c -> b.c: #include "b.h"; calls b_fn', out)
        self.assertIn("b.c -> a.c: calls a_fn", out)
        self.assertIn("a.c, b.c  <-- CYCLE", out)
        self.assertIn("  s.h\n", out)
        self.assertIn("server/a.c:2-2 a_fn", out)


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        CHECKER = sys.argv.pop(1)
    unittest.main(verbosity=2)
