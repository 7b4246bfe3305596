#!/usr/bin/env bash
# `meson install` of this build directory into a temporary DESTDIR (no root,
# nothing outside it touched), then the staged tree used the way a packager
# or a user would:
#   * a small C program (<kvside/kvside.h>) builds against the staged tree
#     with `pkg-config --cflags --libs kvside` alone and runs from it
#     (LD_LIBRARY_PATH): the ABI version, error names, kvs_client_open failing
#     on a broker directory that does not exist; the same program links
#     libkvside.a with exactly what kvside.pc declares for static links
#     (Libs.private, Requires.private);
#   * headers only under include/kvside/, the library's SONAME link;
#   * the systemd unit, with this build's bindir and docdir substituted,
#     naming binaries and a manual the install put there, and the sysusers.d
#     entry that creates its User= (systemd-sysusers into a scratch root);
#   * every docs/*.md in the doc directory;
#   * the example config, which the installed server reads (--print-config);
#   * the Python package, every .py file of worker/python/kvside, imported by
#     /usr/bin/python3 from the staged site directory with the staged library.
# Environment (tests/lib/meson.build): KVT_BUILD_ROOT, KVT_SOURCE_ROOT, KVT_CC,
# KVT_BINDIR, KVT_LIBDIR, KVT_INCLUDEDIR, KVT_UNIT, KVT_SYSUSERS, KVT_DOCDIR, KVT_PYSITE
# (absolute install paths; KVT_PYSITE empty when no Python package is installed).
set -euo pipefail
: "${KVT_BUILD_ROOT:?}" "${KVT_SOURCE_ROOT:?}" "${KVT_CC:?}" "${KVT_BINDIR:?}" "${KVT_LIBDIR:?}"
: "${KVT_INCLUDEDIR:?}" "${KVT_UNIT:?}" "${KVT_SYSUSERS:?}" "${KVT_DOCDIR:?}" "${KVT_PYSITE?}"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvt-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
stage=$tmp/stage
fail() { echo "FAIL: $*" >&2; exit 1; }

meson install -C "$KVT_BUILD_ROOT" --destdir "$stage" --no-rebuild --quiet
echo "installed into $stage:"
(cd "$stage" && find . -type f -o -type l | sort | sed 's/^\./  /')

# ---- headers, library, pkg-config
inc=$stage$KVT_INCLUDEDIR
libdir=$stage$KVT_LIBDIR
for h in kvside.h kvs_error.h kvs_types.h; do
  [ -f "$inc/kvside/$h" ] || fail "$KVT_INCLUDEDIR/kvside/$h not installed"
  [ ! -e "$inc/$h" ] || fail "$KVT_INCLUDEDIR/$h installed flat (belongs in kvside/)"
done
[ -f "$libdir/libkvside.so.0" ] || fail "$KVT_LIBDIR/libkvside.so.0 not installed"
[ -f "$libdir/pkgconfig/kvside.pc" ] || fail "$KVT_LIBDIR/pkgconfig/kvside.pc not installed"
pc() {
  PKG_CONFIG_SYSROOT_DIR=$stage PKG_CONFIG_PATH=$libdir/pkgconfig PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 \
    PKG_CONFIG_ALLOW_SYSTEM_LIBS=1 pkg-config "$@"
}
flags=$(pc --cflags --libs kvside)
echo "pkg-config --cflags --libs kvside: $flags"
cat >"$tmp/prog.c" <<'CEOF'
#include <kvside/kvside.h>
#include <stdio.h>
#include <string.h>

int main(void)
{
	if (kvs_abi_version() != KVS_ABI_VERSION) {
		printf("kvs_abi_version %u, header %d\n", kvs_abi_version(), KVS_ABI_VERSION);
		return 1;
	}
	if (strcmp(kvs_error_name(KVS_E_MISS), "E_MISS") != 0 ||
	    kvs_error_from_name("E_BUSY", 6) != KVS_E_BUSY || strcmp(kvs_strerror(0), "success") != 0) {
		printf("error names and texts wrong\n");
		return 1;
	}
	kvs_client_config cfg = {.broker_dir = "/nonexistent/kvside-install-test", .engine = "install-test",
				 .ns = "install-test", .role = KVS_ROLE_SCHEDULER, .world = 1, .timeout_ms = 300};
	kvs_client *c = NULL;
	int r = kvs_client_open(&cfg, &c);
	if (r == 0 || c) {
		printf("kvs_client_open succeeded without a server\n");
		return 1;
	}
	printf("kvs_client_open without a server: %s (%s)\n", kvs_strerror(r), kvs_error_name(r));
	return 0;
}
CEOF
# shellcheck disable=SC2086 # word splitting of the compiler command and the flags is wanted
$KVT_CC -std=c11 -Wall -Wextra -Werror -o "$tmp/prog" "$tmp/prog.c" $flags ||
  fail "the program does not build with pkg-config's flags alone"
ldd_out=$(LD_LIBRARY_PATH=$libdir ldd "$tmp/prog")
grep -q "libkvside.so.0 => $libdir/libkvside.so.0" <<<"$ldd_out" ||
  fail "prog does not resolve libkvside.so.0 from the staged tree: $ldd_out"
LD_LIBRARY_PATH=$libdir "$tmp/prog" || fail "prog against the staged libkvside.so failed"

# static: libkvside.a plus what kvside.pc declares for it, nothing else
libs_private=$(sed -n 's/^Libs.private: *//p' "$libdir/pkgconfig/kvside.pc")
requires_private=$(pc --print-requires-private kvside | awk '{print $1}' | tr '\n' ' ')
echo "static: Libs.private: $libs_private; Requires.private: $requires_private"
# shellcheck disable=SC2086
$KVT_CC -std=c11 -o "$tmp/prog-static" "$tmp/prog.c" $(pc --cflags kvside) "$libdir/libkvside.a" \
  $libs_private $(pc --libs $requires_private) ||
  fail "libkvside.a does not link with kvside.pc's Libs.private and Requires.private"
! ldd "$tmp/prog-static" | grep -q libkvside || fail "prog-static still needs libkvside.so"
"$tmp/prog-static" || fail "prog-static failed"

# ---- binaries, the systemd unit, docs and the example config
bindir=$stage$KVT_BINDIR
for b in kvside-server kvside-ctl; do
  [ -x "$bindir/$b" ] || fail "$KVT_BINDIR/$b not installed"
done
"$bindir/kvside-ctl" --version
unit=$stage$KVT_UNIT
[ -f "$unit" ] || fail "$KVT_UNIT not installed"
grep -qx "ExecStart=$KVT_BINDIR/kvside-server --config /etc/kvside/kvside.yaml --broker-dir /run/kvside" "$unit" ||
  fail "ExecStart= of $KVT_UNIT does not run $KVT_BINDIR/kvside-server: $(grep ExecStart= "$unit")"
grep -q "^ExecStop=-$KVT_BINDIR/kvside-ctl " "$unit" || fail "ExecStop= of $KVT_UNIT does not run $KVT_BINDIR/kvside-ctl"
doc=$(sed -n 's/^Documentation=file://p' "$unit")
[ "$doc" = "$KVT_DOCDIR/deploy.md" ] || fail "Documentation= is '$doc', want $KVT_DOCDIR/deploy.md"
[ -f "$stage$doc" ] || fail "Documentation= names $doc, which the install did not put there"
! grep -n '@[A-Za-z_]*@' "$unit" || fail "unsubstituted @...@ left in $KVT_UNIT"
for d in "$KVT_SOURCE_ROOT"/docs/*.md; do
  [ -f "$stage$KVT_DOCDIR/${d##*/}" ] || fail "$KVT_DOCDIR/${d##*/} not installed (docs/meson.build)"
done
# the account of User=/Group=: a sysusers.d entry creates it
sysusers=$stage$KVT_SYSUSERS
[ -f "$sysusers" ] || fail "$KVT_SYSUSERS not installed"
user=$(sed -n 's/^User=//p' "$unit"); group=$(sed -n 's/^Group=//p' "$unit")
grep -q "^u $user " "$sysusers" || fail "$KVT_SYSUSERS does not create User=$user"
[ "$group" = "$user" ] || fail "Group=$group is not the group sysusers makes for $user"
if command -v systemd-sysusers >/dev/null; then
  mkdir -p "$tmp/root/etc"
  systemd-sysusers --root="$tmp/root" "$sysusers" || fail "systemd-sysusers refuses $KVT_SYSUSERS"
  grep -q "^$user:" "$tmp/root/etc/passwd" || fail "systemd-sysusers made no user $user"
fi
cfg=$stage$KVT_DOCDIR/kvside.yaml
cmp "$cfg" "$KVT_SOURCE_ROOT/configs/kvside.yaml" || fail "$KVT_DOCDIR/kvside.yaml is not configs/kvside.yaml"
"$bindir/kvside-server" --config "$cfg" --print-config >"$tmp/print-config" ||
  fail "the installed server does not read the installed example config"
grep -q '^l1-size:' "$tmp/print-config" || fail "--print-config printed no l1-size"
echo "unit $KVT_UNIT: $(grep -c . "$unit") lines, ExecStart=$KVT_BINDIR/kvside-server; config and docs in $KVT_DOCDIR"

# ---- the Python package, imported from the staged tree
if [ -z "$KVT_PYSITE" ]; then
  echo "no Python package installed by this build (no interpreter): skipping that part"
  exit 0
fi
site=$stage$KVT_PYSITE
want=$(cd "$KVT_SOURCE_ROOT/worker/python" && find kvside -name '*.py' | sort)
have=$(cd "$site" 2>/dev/null && find kvside -name '*.py' | sort)
[ "$want" = "$have" ] || fail "Python files installed under $KVT_PYSITE differ from worker/python:
$(diff <(echo "$want") <(echo "$have"))"
(cd "$tmp" && env -u KVSIDE_LIB -u PYTHONHOME PYTHONPATH="$site" LD_LIBRARY_PATH="$libdir" \
  PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -s - "$stage" <<'PYEOF'
import sys
import kvside
stage = sys.argv[1]
assert kvside.__file__.startswith(stage), "kvside imported from %s, not the staged tree" % kvside.__file__
with open("/proc/self/maps") as f:
    libs = {line.split()[-1] for line in f if "libkvside" in line}
assert libs and all(p.startswith(stage) for p in libs), "libkvside loaded from %s" % libs
keys = kvside.chunk_keys("install-test", list(range(64)), 16)
assert len(keys) == 4 and all(len(k) == kvside.KEY_BYTES for k in keys), keys
print("python3 imported %s with %s (ABI %d): %d chunk keys" % (kvside.__file__, sorted(libs)[0],
                                                              kvside.ABI_VERSION, len(keys)))
PYEOF
) || fail "the staged Python package does not work"
echo "install test: ok"
