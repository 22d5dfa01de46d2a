#!/usr/bin/env bash
# bench.sh ARGS...: `pykv bench -ngl 99` with ARGS, its rows kept as JSON lines in
# $OUTDIR/bench-gpu.jsonl (a script, not a function, so that check's `timeout` can run it).
set -o pipefail
"${PYTHON:-python3}" -m pykv bench -ngl 99 -o jsonl "$@" | tee -a "${OUTDIR:?}/bench-gpu.jsonl"
