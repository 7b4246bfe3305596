#!/bin/sh
# GPU suite, issue 18: no stall at start-up with the largest L1 this machine
# allows. kvside-bench startup --check starts the server, has 4 ranks
# register CUDA memory 1 s later and store, and fails unless every register
# was answered within 100 ms, no request waited more than 1 s and no session
# was lost. Exits 77 (skip) without a GPU. $1: the kvside-bench binary.
bench=${1:?kvside-bench}
out=$("$bench" startup --sizes "${KVS_STARTUP_SIZES:-max}" --check --ranks 4 2>&1)
rc=$?
printf '%s\n' "$out"
case $out in *"no GPU"*|*"without CUDA"*) exit 77 ;; esac
exit $rc
