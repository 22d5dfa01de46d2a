"""One prompt under every KV cache policy: the cache's memory and the answer side by side.

usage: python examples/policy_sweep.py [MODEL]

MODEL is a .gguf path or a pykv model name (default: smollm2, fetched once into ~/.cache/pykv).
The evicting policies keep BUDGET entries per layer and KV head of the prompt's (about a sixth
of them); `full` keeps every token. docs/policies.md describes each policy.
"""
import sys

from pykv import Llama, list_policies

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
BUDGET = 64   # entries per layer and KV head, on average

# a document of about 400 tokens with one fact to recall in it, and a question about it
colours = ["blue", "green", "grey", "white", "yellow", "brown"]
rooms = [f"Room {n} is painted {colours[n % 6]} and holds {n + 2} chairs." for n in range(1, 25)]
rooms[19] += " The spare key is hidden under the red lamp in room 20."
messages = [{"role": "user", "content": " ".join(rooms) + "\n\nWhere is the spare key hidden?"}]

rows = []
for policy in list_policies():   # `full` and the evicting policies, from the C registry
    budget = None if policy == "full" else BUDGET
    with Llama(model, n_ctx=2048, policy=policy, budget=budget) as llm:
        response = llm.create_chat_completion(messages, temperature=0.0, max_tokens=16)
        answer = " ".join(response["choices"][0]["message"]["content"].split())   # on one line
        rows.append((policy, llm.kv_stats()["bytes"], answer))   # the bytes the cache holds now

full_bytes = dict((policy, size) for policy, size, _ in rows)["full"]
print(f"{'policy':<14}{'KV cache':>10}{'of full':>9}  answer")
for policy, size, answer in rows:
    print(f"{policy:<14}{size / 1024:>6.0f} KiB{size / full_bytes:>9.0%}  {answer}")
