"""llama-cpp-python's OpenAI-shaped results: text completions and chat completions, whole or
as a stream of chunk dicts, on top of Llama.generate."""
from __future__ import annotations

import os
import time
from pathlib import Path


def _usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.tokens),
            "total_tokens": result.prompt_tokens + len(result.tokens),
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


class _Envelope:
    """What every body of one completion shares: id, object kind, creation time, model name."""

    def __init__(self, llm, prefix: str, kind: str):
        self.head = {"id": f"{prefix}-{os.urandom(8).hex()}", "object": kind, "created": int(time.time()),
                     "model": Path(llm.model_path).name}

    def body(self, choice: dict, result=None) -> dict:
        out = dict(self.head, choices=[dict({"index": 0}, **choice, logprobs=None)])
        if result is not None:
            out["usage"] = _usage(result)
        return out


def completion(llm, prompt, stream: bool, **kwargs):
    """create_completion: {"choices": [{"text", "finish_reason"}], "usage"}; chunks when streaming."""
    env = _Envelope(llm, "cmpl", "text_completion")
    if stream:
        steps = llm.generate(prompt, stream=True, **kwargs)   # checks the prompt now, not at first next()

        def chunks():
            for chunk in steps:
                yield env.body({"text": chunk.text, "finish_reason": None})
            yield env.body({"text": "", "finish_reason": llm.last_result.finish_reason})
        return chunks()
    result = llm.generate(prompt, **kwargs)
    return env.body({"text": result.text, "finish_reason": result.finish_reason}, result)


def chat_completion(llm, prompt_tokens, stream: bool, **kwargs):
    """create_chat_completion on an already rendered prompt: {"choices": [{"message": {"role":
    "assistant", "content"}, "finish_reason"}], "usage"}; streamed as "delta" chunks, the first
    carrying the role and the last the finish reason."""
    env = _Envelope(llm, "chatcmpl", "chat.completion.chunk" if stream else "chat.completion")
    if stream:
        steps = llm.generate(prompt_tokens, stream=True, **kwargs)

        def chunks():
            yield env.body({"delta": {"role": "assistant"}, "finish_reason": None})
            for chunk in steps:
                yield env.body({"delta": {"content": chunk.text}, "finish_reason": None})
            yield env.body({"delta": {}, "finish_reason": llm.last_result.finish_reason})
        return chunks()
    result = llm.generate(prompt_tokens, **kwargs)
    return env.body({"message": {"role": "assistant", "content": result.text},
                     "finish_reason": result.finish_reason}, result)
