"""One line per row of a `pykv bench -o jsonl` file: the GPU scripts' summary of what they ran.

    python tests/gpu/bench-summary.py bench-gpu.jsonl
"""
import json
import sys

for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"bench {r['model']:>26} {r['test']:>16} {r['policy']:>28} {r['budget'] or '-':>5}: {r['t_s']:10.1f} "
          f"± {r['t_s_sd']:.1f} t/s (median {r['t_s_median']:.1f}), KV {r['kv_MiB']:.1f} MiB, peak {r['kv_peak_MiB']:.1f}")
