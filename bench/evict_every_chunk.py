"""python bench/evict_every_chunk.py

evict_every_chunk against compressing at the end of the prompt, on SmolLM2-135M Q4_1:
prefill speed and peak KV memory of a 2048-token licence-text prompt (4 chunks of 512) at a
512-entry budget, mean KL(full || policy) over the next 128 teacher-forced tokens, and the
needle (bench/needle.py's task, question in the prompt) at 2048 tokens and 25%."""
import json
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from needle import Task, answer, haystack_text, kl_divergence, teacher_forced_distributions
from pykv import Llama
from pykv.pull import pull

model = str(pull("smollm2"))
N, FOLLOW, B, THREADS = 2048, 128, 512, 2
configs = [("full", False), ("snapkv", False), ("snapkv", True), ("adakv", False), ("adakv", True),
           ("h2o", False), ("h2o", True)]
out = {"kl": {}, "prefill_tok_s": {}, "peak_mib": {}, "needle": {}}
with Llama(model, n_ctx=N + FOLLOW + 8, vocab_only=True) as t:
    ids = t.tokenize(haystack_text(), add_bos=True)[:N + FOLLOW]
prefix, follow = ids[:N], ids[N:]
full_rows = None
for pol, every in configs:
    kw = {} if pol == "full" else {"budget": B, "evict_every_chunk": every}
    with Llama(model, n_ctx=N + FOLLOW + 8, n_threads=THREADS, policy=pol, **kw) as llm:
        t0 = time.perf_counter()
        llm.eval(prefix)
        dt = time.perf_counter() - t0
        peak = llm.kv_stats()["peak_bytes"] / 2**20
        rows = teacher_forced_distributions(llm, follow)
    key = f"{pol}{'+every' if every else ''}"
    if pol == "full":
        full_rows = rows
    else:
        out["kl"][key] = kl_divergence(full_rows, rows)
    out["prefill_tok_s"][key] = N / dt
    out["peak_mib"][key] = peak
    print(key, out["kl"].get(key), f"{N / dt:.0f} tok/s", f"{peak:.1f} MiB", flush=True)
with Llama(model, n_ctx=N + 64, n_threads=THREADS) as tok_llm:
    tasks = [Task(tok_llm, N, s) for s in range(3)]
for pol, every in configs[:5]:
    key = f"{pol}{'+every' if every else ''}"
    hits = []
    for s, task in enumerate(tasks):
        budget = None if pol == "full" else max(1, int(round(len(task.context) * 0.25)))
        kw = {} if pol == "full" else {"budget": budget, "evict_every_chunk": every}
        with Llama(model, n_ctx=N + 64, n_threads=THREADS, policy=pol, **kw) as llm:
            if task.hit(answer(llm, task, True)):
                hits.append(s)
    out["needle"][key] = hits
    print(key, "needle", hits, flush=True)
print(json.dumps(out, indent=1))
