"""Stream a completion: print each piece of text as soon as the model produces it.

usage: python examples/stream.py [MODEL]

MODEL is a .gguf path or a pykv model name (default: smollm2, fetched once into ~/.cache/pykv).
"""
import sys

from pykv import Llama

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2"

with Llama(model, n_ctx=2048) as llm:
    # stream=True returns an iterator of chunks instead of one result; each chunk's text is
    # safe to show (a character split over two tokens comes whole, in the later chunk)
    for chunk in llm.generate("Once upon a time", max_tokens=48, temperature=0.0, stream=True):
        print(chunk.text, end="", flush=True)
    print()
    # the whole result, with its timings, is kept once the stream is done
    print(f"[{llm.last_result.finish_reason}: {len(llm.last_result.tokens)} tokens]", file=sys.stderr)
