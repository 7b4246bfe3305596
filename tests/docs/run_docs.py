"""Runs the runnable code blocks of README.md and docs/*.md against a real
kvside-server, as doctest runs a docstring's examples (suite `docs`).

The marker: a line `<!-- runnable -->` (an HTML comment: Markdown shows
nothing) directly before a fenced block marks it runnable:

    <!-- runnable -->
    ```sh
    kvside-ctl --broker-dir "$KVSIDE_BROKER_DIR" stats
    ```

Fences ```sh / ```bash / ```shell run with `bash -euo pipefail`, ```python
with this interpreter (Debian's python3). A marker before a fence of another
language, or before anything but a fence, fails the test; so does finding no
runnable block at all.

Each block runs on its own, in a fresh server (a block is what a reader
pastes: it may not lean on an earlier one), with the working directory the
source tree's root (README's paths are the checkout's) and this environment,
which the docs tell the reader how to set:
- KVSIDE_BROKER_DIR: the server's broker directory (a temporary one here;
  /run/kvside under the systemd unit);
- KVSIDE_METRICS: HOST:PORT of its metrics endpoint (127.0.0.1:9464 by
  default; here a free port: metrics-listen 127.0.0.1:0);
- PATH starts with the build's server/ and worker/ directories, so
  `kvside-server` and `kvside-ctl` are this build's (after `meson install`
  they are on PATH), and with a directory whose `python3` is the interpreter
  running this test (Debian's, with python3-zmq), not whatever else PATH
  would find first (a pyenv shim);
- KVSIDE_LIB (this build's libkvside.so) and PYTHONPATH (worker/python):
  `import kvside` finds the binding, as with the wheel installed;
- HOME and TMPDIR: a scratch directory, removed afterwards.
Nothing in a block is rewritten. The server is the Python tests' own
(tests/python/kvt_server.py): L2 in its temporary directory, a 256 MiB L1,
not prefaulted, metrics on a free port.

A block fails when it exits non-zero, runs longer than 20 s, or its server
dies; the failure names FILE:LINE of the block's opening fence and shows the
end of its output (`-v`: every block's output). Environment: KVS_SOURCE_ROOT, KVS_SERVER, KVS_CTL,
KVSIDE_LIB, PYTHONPATH (tests/docs/meson.build)."""

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.environ["KVS_SOURCE_ROOT"], "tests", "python"))
from kvt_server import Server  # noqa: E402  (the Python tests' server, kvside-ctl's checks)

MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^( *)(`{3,}|~{3,})\s*([A-Za-z0-9_+-]*)\s*$")
RUNNERS = {"sh": "bash", "bash": "bash", "shell": "bash", "python": "python"}
BLOCK_TIMEOUT_S = 20
VERBOSE = "-v" in sys.argv[1:]  # print every block's output

SRC = os.environ["KVS_SOURCE_ROOT"]
SERVER = os.environ["KVS_SERVER"]
CTL = os.environ["KVS_CTL"]


def doc_files():
    files = [os.path.join(SRC, "README.md")] + sorted(glob.glob(os.path.join(SRC, "docs", "*.md")))
    return [f for f in files if os.path.exists(f)]


def blocks_of(path):
    """[(line of the opening fence, language, code)] of the marked blocks and
    [(line, problem)] of markers that mark nothing runnable."""
    lines = open(path, encoding="utf-8").read().split("\n")
    found, problems = [], []
    i = 0
    while i < len(lines):
        if lines[i].strip() != MARKER:
            i += 1
            continue
        m = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not m:
            problems.append((i + 1, "%s not directly before a fenced block" % MARKER))
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        start = i + 2  # 1-based line of the fence
        j = i + 2
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if j >= len(lines):
            problems.append((start, "unterminated fenced block"))
            break
        if lang not in RUNNERS:
            problems.append((start, "runnable block of language %r (runnable: %s)"
                             % (lang, ", ".join(sorted(RUNNERS)))))
        else:
            # a block inside a list item: its lines lose the fence's indentation
            code = [l[indent:] if l[:indent].strip() == "" else l for l in lines[i + 2:j]]
            found.append((start, RUNNERS[lang], "\n".join(code) + "\n"))
        i = j + 1
    return found, problems


def start_server():
    """A fresh server for one block (the Python tests' kvt_server): L2, and
    metrics on a free port, whose number it returns with the server."""
    srv = Server("--metrics-listen", "127.0.0.1:0", l1_size="256M", l2=True, l2_size="64M", l2_sync=None,
                 prefix="kvt-docs-srv-")
    srv.start(timeout=10)
    return srv, srv.stats()["metrics_port"]


def python_dir(scratch):
    """A directory holding `python3` -> this interpreter."""
    d = os.path.join(scratch, "bin")
    os.makedirs(d, exist_ok=True)
    link = os.path.join(d, "python3")
    if not os.path.lexists(link):
        os.symlink(sys.executable, link)
    return d


def run_block(scratch, path, line, runner, code):
    """None, or the failure's text."""
    where = "%s:%d" % (os.path.relpath(path, SRC), line)
    home = tempfile.mkdtemp(prefix="home-", dir=scratch)
    srv, metrics_port = start_server()
    env = dict(os.environ)
    env.update({
        "KVSIDE_BROKER_DIR": srv.run,
        "KVSIDE_METRICS": "127.0.0.1:%d" % metrics_port,
        "PATH": os.pathsep.join([os.path.dirname(SERVER), os.path.dirname(CTL), python_dir(scratch),
                                 env.get("PATH", "")]),
        "HOME": home,
        "TMPDIR": home,
        "PYTHONDONTWRITEBYTECODE": "1",
    })
    script = os.path.join(home, "block.py" if runner == "python" else "block.sh")
    with open(script, "w") as f:
        f.write(code)
    argv = [sys.executable, script] if runner == "python" else ["bash", "-euo", "pipefail", script]
    t0 = time.time()
    try:
        r = subprocess.run(argv, cwd=SRC, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=BLOCK_TIMEOUT_S)
        out, rc = r.stdout.decode(errors="replace"), r.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace"), "timeout after %d s" % BLOCK_TIMEOUT_S
    dt = time.time() - t0
    alive = srv.proc.poll() is None
    src = srv.stop()
    tail = srv.log_tail()
    srv.cleanup()
    problem = None
    if rc != 0:
        problem = "exit status %s" % rc
    elif not alive:
        problem = "the server died during the block (status %s)" % src
    elif src != 0:
        problem = "the server's exit status after the block: %s" % src
    print("%-4s %s (%s, %d lines, %.2f s)" % ("ok" if not problem else "FAIL", where, runner,
                                            code.count("\n"), dt), flush=True)
    if VERBOSE:
        print("    " + out.rstrip().replace("\n", "\n    "), flush=True)
    if not problem:
        return None
    return "%s: %s block: %s\n--- output (end) ---\n%s\n--- server log (end) ---\n%s" % (
        where, runner, problem, out[-3000:], tail)


def main():
    scratch = tempfile.mkdtemp(prefix="kvt-docs-")
    failures, total = [], 0
    t0 = time.time()
    try:
        for path in doc_files():
            found, problems = blocks_of(path)
            for line, what in problems:
                failures.append("%s:%d: %s" % (os.path.relpath(path, SRC), line, what))
            for line, runner, code in found:
                total += 1
                f = run_block(scratch, path, line, runner, code)
                if f:
                    failures.append(f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if total == 0:
        failures.append("no block marked %s in README.md or docs/*.md" % MARKER)
    print("%d runnable blocks in %.1f s, %d failed" % (total, time.time() - t0, len(failures)))
    for f in failures:
        print("\n" + f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
