"""Complete a prompt: the smallest use of the Python API.

usage: python examples/generate.py [MODEL]

MODEL is a .gguf path or a pykv model name (default: smollm2, fetched once into ~/.cache/pykv).
"""
import sys

from pykv import Llama

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2"

with Llama(model, n_ctx=2048) as llm:
    # temperature 0 is greedy decoding: the most likely token at each step, the same text on
    # every run; max_tokens bounds the length (the model may end sooner)
    result = llm.generate("The capital of France is", max_tokens=32, temperature=0.0)
    print(result.text)
    # why it stopped ("stop": the model ended it, "length": max_tokens) and how fast it went
    print(f"[{result.finish_reason}: {len(result.tokens)} tokens, "
          f"{result.timings['predicted_per_second']:.1f} tokens/s]", file=sys.stderr)
