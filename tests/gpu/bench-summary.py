"""The GPU scripts' summary of a `pykv bench -o jsonl` file: one line per row, then (with
--markdown) the rows as BENCHMARKS.md's GPU tables take them, each beside llama.cpp's CUDA
figure for the same shape and test and, for a policy, pykv's own full cache: a prefill's time
against full's on the same prompt, a decode at depth against full's decode at depth 0 (tg128).

    python tests/gpu/bench-summary.py bench-gpu.jsonl
    python tests/gpu/bench-summary.py --markdown bench-gpu.jsonl gpu-long.jsonl
"""
import argparse
import json
import shutil
import subprocess

# llama.cpp's CUDA backend on an NVIDIA H100 80GB HBM3 (llama-bench -ngl 99 -fa 1, n_ubatch
# 512, f16 KV cache, full cache; mean t/s of -r 3, -r 2 for the 8B deep rows), on random-weight
# files of the same shapes and types as bench/gpu_models.py writes. An absolute speed holds on
# the same card only.
LLAMA_CPP_H100 = {
    ("smollm2", "pp512"): 49169, ("smollm2", "pp2048"): 51864, ("smollm2", "tg128"): 858,
    ("smollm2", "tg32 @ d4096"): 805, ("smollm2", "tg32 @ d8192"): 748, ("smollm2", "tg32 @ d16384"): 699,
    ("smollm2", "tg32 @ d32768"): 606,
    ("llama8b", "pp512"): 10899, ("llama8b", "pp2048"): 11476, ("llama8b", "tg128"): 322,
    ("llama8b", "tg32 @ d4096"): 298, ("llama8b", "tg32 @ d8192"): 278, ("llama8b", "tg32 @ d32768"): 192,
    ("llama8b", "tg32 @ d65536"): 137,
}


def shape(model):
    return model.split("-shape")[0]


def card():
    if not shutil.which("nvidia-smi"):
        return ""
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def lines(rows):
    for r in rows:
        print(f"bench {r['model']:>26} {r['test']:>16} {r['policy']:>28} {r['budget'] or '-':>5}: {r['t_s']:10.1f} "
              f"± {r['t_s_sd']:.1f} t/s (median {r['t_s_median']:.1f}), KV {r['kv_MiB']:.1f} MiB, "
              f"peak {r['kv_peak_MiB']:.1f}")


def markdown(rows, gpu):
    on_h100 = "H100" in gpu
    full = {(shape(r["model"]), r["test"]): r["t_s"] for r in rows if r["policy"] == "full"}
    print(f"GPU: {gpu or 'unknown'}; llama.cpp's column: its H100 figure"
          + ("" if on_h100 else " (another card: compare with care)"))
    print()
    print("| model | test | policy | budget | pykv t/s | llama.cpp t/s | pykv / llama.cpp | vs pykv full | "
          "KV MiB | KV peak MiB |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        m, test = shape(r["model"]), r["test"]
        ref = LLAMA_CPP_H100.get((m, test))
        # a policy's prefill against full's time on the same prompt, its decode at depth
        # against pykv's own decode at depth 0
        own = None if r["policy"] == "full" else full.get((m, test if test.startswith("pp") else "tg128"))
        ratio = f"{r['t_s'] / ref:.2f}x" if ref else "-"
        vs_own = ""
        if own:
            vs_own = f"{own / r['t_s']:.2f}x time" if test.startswith("pp") else f"{r['t_s'] / own:.2f}x of d0"
        print(f"| {m} | {test} | {r['policy']} | {r['budget'] or '-'} | {r['t_s']:.1f} ± {r['t_s_sd']:.1f} | "
              f"{ref or '-'} | {ratio} | {vs_own or '-'} | "
              f"{r['kv_MiB']:.1f} | {r['kv_peak_MiB']:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--markdown", action="store_true", help="also print the rows as a table for BENCHMARKS.md")
    args = ap.parse_args()
    rows = [json.loads(line) for f in args.files for line in open(f) if line.strip()]
    lines(rows)
    if args.markdown:
        print()
        markdown(rows, card())


if __name__ == "__main__":
    main()
