# setup.sh - what the GPU scripts (run.sh, bench-long.sh) share, sourced from the repository
# root with LOG_NAME set: the log in $OUT (or build-gpu), check(), the carried wheels on the
# Python path, the library (built here for this card, or $PREBUILT) as PYKV_LIBRARY, and
# summary(). check runs a command under `timeout`: a script or program, not a shell function.
ROOT=$PWD
export OUTDIR=${OUT:-$ROOT/build-gpu}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/$LOG_NAME
exec > >(tee "$LOG") 2>&1
export PYTHONUNBUFFERED=1
export PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
failures=0
skipped=0
results=()

# GPU_END (optional): the epoch second by which the script must have printed its summary (a
# device call's limit: GPU_END=$(( $(date +%s) + 540 )) for one of 560 s, for instance). A
# check's limit is cut to the time left before it, less SUMMARY_S; one that would get under
# MIN_CHECK_S is not started ("SKIP name (no time left)"), so the summary always comes.
SUMMARY_S=${SUMMARY_S:-15}
MIN_CHECK_S=${MIN_CHECK_S:-20}
time_left() { [ -n "${GPU_END:-}" ] && echo $((GPU_END - $(date +%s) - SUMMARY_S)) || echo 1000000; }

check() {   # check NAME TIMEOUT_S COMMAND...: run it, record PASS/FAIL (or SKIP: no time left)
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS left
    left=$(time_left)
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt "$MIN_CHECK_S" ]; then
        echo "SKIP $name (no time left)"
        results+=("SKIP $name (no time left)")
        skipped=$((skipped + 1))
        return
    fi
    echo "==> $name"
    timeout "$limit" "$@"
    local rc=$?
    local line
    if [ $rc -eq 0 ]; then line="PASS $name ($((SECONDS - t0)) s)"
    elif [ $rc -eq 124 ]; then line="FAIL $name (over its ${limit} s limit)"; failures=$((failures + 1))
    else line="FAIL $name (exit $rc)"; failures=$((failures + 1)); fi
    echo "$line"
    results+=("$line")
}

# check_bg NAME TIMEOUT_S COMMAND...: check in the background, at most BG_JOBS at a time, its
# output kept in $OUTDIR/checks/ until check_wait prints it (whole, in the order started)
# and records its line. For checks that may share the GPU: none that measures its free memory.
BG_JOBS=${BG_JOBS:-4}
bg_names=()
bg_pids=()
check_bg() {
    while [ "$(jobs -rp | wc -l)" -ge "$BG_JOBS" ]; do wait -n; done
    mkdir -p "$OUTDIR/checks"
    local i=${#bg_names[@]}
    bg_names+=("$1")
    (check "$@") > "$OUTDIR/checks/$i.log" 2>&1 &
    bg_pids+=($!)
}
check_wait() {
    local i line
    for i in "${!bg_pids[@]}"; do
        wait "${bg_pids[$i]}"
        cat "$OUTDIR/checks/$i.log"
        line=$(grep -E "^(PASS|FAIL|SKIP) " "$OUTDIR/checks/$i.log" | tail -1)
        [ -n "$line" ] || line="FAIL ${bg_names[$i]} (no result)"
        case $line in FAIL*) failures=$((failures + 1)) ;; SKIP*) skipped=$((skipped + 1)) ;; esac
        results+=("$line")
    done
    bg_names=()
    bg_pids=()
}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pykv-site .whl/*.whl
    export PYTHONPATH=/tmp/pykv-site:$ROOT
else
    export PYTHONPATH=$ROOT
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

BUILD=${PREBUILT:-build-gpu/build}
if [ -z "${PREBUILT:-}" ]; then
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
    check "build (sm_${arch:-90})" 400 bash -c "cmake -S . -B $BUILD -DPYKV_CUDA=ON -DPYKV_BUILD_TESTS=ON \
        -DCMAKE_CUDA_ARCHITECTURES=${arch:-90} -DCMAKE_CUDA_COMPILER=\$(bash tests/cuda-toolchain.sh) >/dev/null \
        && cmake --build $BUILD -j $JOBS"
fi
case $BUILD in /*) export PYKV_LIBRARY=$BUILD/libpykv.so ;; *) export PYKV_LIBRARY=$ROOT/$BUILD/libpykv.so ;; esac
head=$(git rev-parse HEAD 2>/dev/null || true)
if [ -f "$BUILD/commit" ] && [ -n "$head" ] && [ "$(cat "$BUILD/commit")" != "$head" ]; then
    echo "warning: $BUILD was built from commit $(cat "$BUILD/commit"), not from this checkout's HEAD ($head)"
fi
"$PYTHON" -c "import pykv; print(pykv.system_info())"


summary() {   # the benchmark rows, then one line per check; exits 1 when one failed or was not run
    [ -f "$OUTDIR/bench-gpu.jsonl" ] && "$PYTHON" tests/gpu/bench-summary.py --markdown "$OUTDIR/bench-gpu.jsonl"
    echo
    echo "==> summary"
    printf '%s\n' "${results[@]}"
    echo "$failures failed, $skipped not run (no time left)"
    exit $((failures > 0 || skipped > 0))
}
