"""python bench/evict_every_chunk.py

evict_every_chunk against compressing at the end of the prompt, on SmolLM2-135M Q4_1:
prefill speed and peak KV memory of a 2048-token prompt of the shipped haystack (4 chunks of 512) at a
512-entry budget, mean KL(full || policy) over the next 128 teacher-forced tokens, and the
needle (`pykv eval needle`'s samples, question in the prompt) at 2048 tokens and 25%."""
import json
import time

from pykv import Llama
from pykv.eval.kl import mean_kl, teacher_forced_log_probs
from pykv.eval.needle import answer
from pykv.eval.samples import depth_of, haystack_text, make_needle_sample
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
        rows = teacher_forced_log_probs(llm, follow)
    key = f"{pol}{'+every' if every else ''}"
    if pol == "full":
        full_rows = rows
    else:
        out["kl"][key] = mean_kl(full_rows, rows)
    out["prefill_tok_s"][key] = N / dt
    out["peak_mib"][key] = peak
    print(key, out["kl"].get(key), f"{N / dt:.0f} tok/s", f"{peak:.1f} MiB", flush=True)
with Llama(model, n_ctx=N + 64, vocab_only=True) as tok_llm:
    tasks = [make_needle_sample(tok_llm, N, s, depth_of(s, [0.1, 0.3, 0.5, 0.7, 0.9])) for s in range(3)]
for pol, every in configs[:5]:
    key = f"{pol}{'+every' if every else ''}"
    hits = []
    for s, task in enumerate(tasks):
        budget = None if pol == "full" else max(1, int(round(len(task.context) * 0.25)))
        kw = {} if pol == "full" else {"budget": budget, "evict_every_chunk": every}
        with Llama(model, n_ctx=N + 64, n_threads=THREADS, policy=pol, **kw) as llm:
            if task.hit(answer(llm, task, "aware", 24)[0]):
                hits.append(s)
    out["needle"][key] = hits
    print(key, "needle", hits, flush=True)
print(json.dumps(out, indent=1))
