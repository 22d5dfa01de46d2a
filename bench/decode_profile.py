"""Where a decode step's time goes: bytes read per token, the speed they are read at, and the
share of CPU time in the matrix kernels, attention, the policy and the thread pool.

    python bench/decode_profile.py --model M.gguf --threads 2 --n-gen 256
    python bench/decode_profile.py --model M.gguf --depth 7680 --policy snapkv --budget 256 --perf
    python bench/decode_profile.py ... --reps 5 --json     # one line of JSON per run, then the medians
    # two builds of the library, alternating run by run:
    python bench/decode_profile.py --model M.gguf --reps 7 --libraries a=build-a/libpykv.so,b=build-b/libpykv.so

Each run is a fresh process (this script with --worker), like bench/compare_llamacpp.py's, at
raised priority; with --libraries the runs alternate between the named builds of libpykv.so
(PYKV_LIBRARY of each worker), so drift on a shared machine hits every build alike. The worker loads the model, evaluates --depth context tokens (untimed), then
times --n-gen single-token decode steps. Bytes per token are counted from the model's tensors
(every matrix a decode step multiplies by, the output head included, and one embedding row)
and the KV cache's resident entries before and after the timed steps (K and V of each entry
are read once per step); bytes / step time is the rate the step streams them at, to compare
with what bench/membw.c measures for the machine.

--perf samples the worker with `perf record -e cpu-clock` over the timed steps only (events
start disabled and the worker switches them on and off through perf's control FIFO), then
groups the self time of each symbol into the categories in CATEGORIES: CPU time of all the
process's threads, so with two threads a worker spinning for its next job shows up as
"thread pool". The shares need a library with symbols (any build of libpykv.so that is not
stripped: the default CMake builds keep them); PYKV_LIBRARY picks the library as usual.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from compare_llamacpp import raise_priority   # bench/ is the script's folder, first on sys.path

# (category, pattern over symbol names), first match wins; the rest is "other".
CATEGORIES = [
    ("matrix kernels", r"^(q8dot|vdot_|vec_dot|dot_blocks|matvec|matmul|quantize_row_q8_act|dequant|deq_)"),
    ("attention", r"^(attention|attend_|scores_\d|wsum_|weighted_sum|merged_|kv_key|kv_value|dot_f32|axpy_f32|"
                  r"softmax|kv_list|kv_cache|kv_compact|kv_drop|fp16_to_fp32|fp32_to_fp16)"),
    ("policy", r"(snapkv|adakv|pyramid|cake|lava|ems_|take|h2o|streaming|policy|^ws_|step_scores|track_new)"),
    ("norm, rope, swiglu", r"^(rmsnorm|swiglu|rope_|elementwise)"),
    ("thread pool", r"^(worker_main|run_slices|threadpool|spin_pause|cpu_relax|sched_yield|__sched_yield|"
                    r"do_sched_yield|schedule|__schedule|futex|__futex|pthread_cond|pthread_mutex|"
                    r"__lll_lock|syscall|entry_SYSCALL|do_syscall|__x64_sys_sched_yield|finish_task_switch|"
                    r"_raw_spin|yield_task)"),
    ("python and ffi", r"(^_?Py|^py|PyEval|_PyObject|cffi|^method_vectorcall|^call_function)"),
]


def token_ids(n, n_vocab, seed):
    import random
    rng = random.Random(seed)
    return [rng.randrange(100, n_vocab - 100) for _ in range(n)]


def weight_bytes_per_token(tensors):
    """Bytes of every tensor a decode step reads in full, and one row of the embedding."""
    names = {t["name"] for t in tensors}
    total = 0
    for t in tensors:
        if t["name"] == "token_embd.weight":
            rows = t["shape"][1] if len(t["shape"]) > 1 else 1
            # the output head reads it all when the model ties it to the embedding
            total += t["n_bytes"] if "output.weight" not in names else t["n_bytes"] // rows
        else:
            total += t["n_bytes"]
    return total


def perf_control(fifo, command):
    if fifo:
        with open(fifo, "w") as f:
            f.write(command + "\n")


def worker(args):
    import time
    from pykv import Llama
    budget = None if args.policy == "full" else args.budget
    n_ctx = max(args.depth, 1) + args.n_gen + 16
    llm = Llama(args.model, n_ctx=n_ctx, n_threads=args.threads, policy=args.policy, budget=budget,
                kv_type=args.cache_type, verbose=False)
    n_vocab = llm.n_vocab
    llm.eval(token_ids(8, n_vocab, 0))   # touch every weight page once
    llm.reset()
    llm.eval(token_ids(max(args.depth, 1), n_vocab, 2))
    tensors = list(llm.tensors)
    stats0 = llm.kv_stats()
    steps = token_ids(args.n_gen, n_vocab, 3)
    perf_control(args.perf_fifo, "enable")
    t0 = time.perf_counter()
    for t in steps:
        llm.eval([t])
    elapsed = time.perf_counter() - t0
    perf_control(args.perf_fifo, "disable")
    stats1 = llm.kv_stats()
    meta, arch = llm.metadata, llm.metadata["general.architecture"]
    head_dim = int(meta.get(f"{arch}.attention.key_length", 0)) or \
        int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"])
    kv_entry_bytes = 2 * head_dim * stats0["bytes_per_element"]   # K and V of one entry
    mean_entries = (stats0["entries"] + stats1["entries"]) / 2
    weights = weight_bytes_per_token(tensors)
    kv = mean_entries * kv_entry_bytes
    step_s = elapsed / args.n_gen
    print(json.dumps({
        "policy": args.policy, "depth": args.depth, "threads": args.threads, "n_gen": args.n_gen,
        "tg_tps": args.n_gen / elapsed, "step_ms": step_s * 1e3,
        "weight_mib": weights / 2**20, "kv_mib": kv / 2**20, "kv_entries": mean_entries,
        "gbps": (weights + kv) / step_s / 1e9
    }))


def categorise(report_lines):
    shares = {name: 0.0 for name, _ in CATEGORIES}
    shares["other"] = 0.0
    top = []
    for line in report_lines:
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(\S+)", line)
        if not m:
            continue
        pct, dso, sym = float(m.group(1)), m.group(2), m.group(3)
        for name, pattern in CATEGORIES:
            if re.search(pattern, sym):
                shares[name] += pct
                break
        else:
            shares["other"] += pct
        if len(top) < 15:
            top.append((pct, dso, sym))
    return shares, top


def run_worker(args, perf, library=None):
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--threads", str(args.threads),
           "--depth", str(args.depth), "--n-gen", str(args.n_gen), "--policy", args.policy,
           "--budget", str(args.budget), "--cache-type", args.cache_type]
    env = dict(os.environ, PYKV_LIBRARY=os.path.abspath(library)) if library else None
    if not perf:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        return json.loads(out.strip().splitlines()[-1]), None
    with tempfile.TemporaryDirectory() as tmp:
        ctl, ack, data = (os.path.join(tmp, n) for n in ("ctl", "ack", "perf.data"))
        os.mkfifo(ctl)
        os.mkfifo(ack)
        cmd += ["--perf-fifo", ctl]
        rec = ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(args.perf_freq), "-D", "-1",
               f"--control=fifo:{ctl},{ack}", "-o", data, "--"] + cmd
        # perf holds the FIFOs open; the worker's writes reach it, its acks go unread
        with open(ack, "r+b", buffering=0):
            out = subprocess.run(rec, check=True, capture_output=True, text=True, env=env).stdout
        report = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "--sort", "dso,sym"],
                                check=True, capture_output=True, text=True).stdout.splitlines()
    return json.loads(out.strip().splitlines()[-1]), categorise(report)


def compare_libraries(args):
    libs = [item.split("=", 1) for item in args.libraries.split(",") if item]
    if any(len(lib) != 2 for lib in libs):
        raise SystemExit("--libraries takes name=path pairs, comma separated")
    samples = {name: [] for name, _ in libs}
    for _ in range(args.reps):
        for name, path in libs:   # alternate, so drift hits every build alike
            samples[name].append(run_worker(args, False, path)[0]["tg_tps"])
    base = statistics.median(samples[libs[0][0]])
    rows = [{"library": name, "tg_tps": round(statistics.median(s), 2), "min": round(min(s), 2),
             "max": round(max(s), 2), f"vs {libs[0][0]}": round(statistics.median(s) / base, 3), "runs": s}
            for name, s in samples.items()]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"policy {args.policy}, depth {args.depth}, {args.threads} threads, {args.n_gen} steps, {args.reps} runs each")
    print(f"| library | t/s median (min..max) | vs {libs[0][0]} |\n|---|---|---:|")
    for r in rows:
        print(f"| {r['library']} | {r['tg_tps']} ({r['min']}..{r['max']}) | {r[f'vs {libs[0][0]}']} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--depth", type=int, default=0, help="context tokens before the timed steps")
    p.add_argument("--n-gen", type=int, default=256, help="timed decode steps")
    p.add_argument("--policy", default="full")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--cache-type", default="f16", choices=["f16", "f32", "q8_0"])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--perf", action="store_true", help="sample the timed steps with perf (cpu-clock)")
    p.add_argument("--perf-freq", type=int, default=4000)
    p.add_argument("--libraries", default="", help="name=path,... builds of libpykv.so to alternate")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--perf-fifo", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    raise_priority()
    if args.libraries:
        compare_libraries(args)
        return
    runs = []
    for _ in range(args.reps):
        result, profile = run_worker(args, args.perf)
        if profile:
            result["cpu_share_pct"] = {k: round(v, 1) for k, v in profile[0].items()}
            result["top_symbols"] = [f"{pct:.1f}% {sym} ({dso})" for pct, dso, sym in profile[1]]
        runs.append(result)
        if args.json:
            print(json.dumps(result), flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in ("tg_tps", "step_ms", "gbps")}
    spread = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in med}
    if args.json:
        print(json.dumps({"median": med, "min_max": spread}))
        return
    r = runs[0]
    print(f"policy {args.policy}, depth {args.depth}, {args.threads} threads, {args.n_gen} steps, {args.reps} runs")
    print(f"bytes per token: weights {r['weight_mib']:.1f} MiB + KV {r['kv_mib']:.1f} MiB "
          f"({r['kv_entries']:.0f} entries)")
    for k, unit in (("tg_tps", "t/s"), ("step_ms", "ms per step"), ("gbps", "GB/s streamed")):
        print(f"  {med[k]:.2f} {unit} ({spread[k][0]:.2f}..{spread[k][1]:.2f})")
    if args.perf:
        shares = {k: statistics.median(run["cpu_share_pct"][k] for run in runs) for k in runs[0]["cpu_share_pct"]}
        print("CPU time by category (median % of samples, all threads):")
        for k, v in sorted(shares.items(), key=lambda kv: -kv[1]):
            print(f"  {v:5.1f}%  {k}")
        print("top symbols of the first run:")
        for s in r["top_symbols"]:
            print(f"  {s}")


if __name__ == "__main__":
    main()
