"""Stream a greedy completion from the default model (fetched once by `pykv pull smollm2`)."""
from pykv import Llama
from pykv.pull import pull

with Llama(pull("smollm2"), n_ctx=2048) as llm:
    for chunk in llm.generate("The capital of France is", max_tokens=32, temperature=0, stream=True):
        print(chunk.text, end="", flush=True)
    print()
    print(llm.last_result.timings)
