#!/usr/bin/env bash
# bench.sh ARGS...: `pykv bench -ngl 99` with ARGS, its rows kept as JSON lines in
# $OUTDIR/bench-gpu.jsonl (a script, not a function, so that check's `timeout` can run it).
set -o pipefail
# unbuffered, each row as it is measured and each run on stderr: a check cut short at its
# limit keeps what it printed before
"${PYTHON:-python3}" -u -m pykv bench -ngl 99 --progress -o jsonl "$@" | tee -a "${OUTDIR:?}/bench-gpu.jsonl"
