"""llama-cpp-python's OpenAI-shaped results: text completions and chat completions, whole or
as a stream of chunk dicts, on top of Llama.generate."""
from __future__ import annotations

import os
import time
from pathlib import Path

from .._sampling import TokenLogprob
from .tools import CallStream, bound_call, new_call_id, parse_calls


def _usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.tokens),
            "total_tokens": result.prompt_tokens + len(result.tokens),
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


class _Envelope:
    """What every body of one completion shares: id, object kind, creation time, model name."""

    def __init__(self, llm, prefix: str, kind: str):
        self.head = {"id": f"{prefix}-{os.urandom(8).hex()}", "object": kind, "created": int(time.time()),
                     "model": Path(llm.model_path).name}

    def body(self, choice: dict, result=None, logprobs=None) -> dict:
        out = dict(self.head, choices=[dict({"index": 0}, **choice, logprobs=logprobs)])
        if result is not None:
            out["usage"] = _usage(result)
        return out


class _Pieces:
    """Token text for the logprobs dicts: each token's bytes (decoded, broken UTF-8 left out, as
    llama-cpp-python does) and the character offset at which it starts in prompt + completion."""

    def __init__(self, llm, prompt_chars: int = 0):
        self.llm = llm
        self.start = prompt_chars
        self.seen = b""

    def piece(self, token: int) -> bytes:
        return self.llm.token_to_piece(token, special=True)

    def text(self, token: int) -> str:
        return self.piece(token).decode("utf-8", "ignore")

    def offset_then_advance(self, token: int) -> int:
        offset = self.start + len(self.seen.decode("utf-8", "ignore"))
        self.seen += self.llm.token_to_piece(token)   # as in the completion's text
        return offset


def _completion_logprobs(entries, pieces: _Pieces):
    """The text completion form: tokens, text_offset, token_logprobs, top_logprobs (the top
    alternatives and the chosen token, keyed by their text)."""
    if entries is None:
        return None
    out = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    for e in entries:
        text = pieces.text(e.token)
        out["tokens"].append(text)
        out["text_offset"].append(pieces.offset_then_advance(e.token))
        out["token_logprobs"].append(e.logprob)
        top = None
        if e.logprob is not None:
            top = {pieces.text(t): lp for t, lp in e.top}
            top[text] = e.logprob
        out["top_logprobs"].append(top)
    return out


def _echo_entries(llm, prompt_logprobs):
    """The echoed prompt's logprob entries, as llama-cpp-python gives them: a leading BOS left
    out, and no log-probability for the first token that remains (OpenAI's form)."""
    ids = llm.input_ids[:len(prompt_logprobs)]
    start = 1 if ids and ids[0] == llm.token_bos() else 0
    if start >= len(ids):
        return []
    return [TokenLogprob(ids[start], None)] + prompt_logprobs[start + 1:]


def _chat_logprobs(entries, pieces: _Pieces):
    """The chat form: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""
    if entries is None:
        return None

    def item(token, logprob):
        return {"token": pieces.text(token), "logprob": logprob, "bytes": list(pieces.piece(token))}
    return {"content": [dict(item(e.token, e.logprob), top_logprobs=[item(t, lp) for t, lp in e.top])
                        for e in entries], "refusal": None}


def _prompt_text(llm, prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    data = prompt if isinstance(prompt, bytes) else llm.detokenize(prompt)
    return data.decode("utf-8", "ignore")


def completion(llm, prompt, stream: bool, echo: bool = False, **kwargs):
    """create_completion: {"choices": [{"text", "finish_reason", "logprobs"}], "usage"}; chunks
    when streaming, each with the logprobs of its tokens. echo puts the prompt before the
    completion (the first chunk when streaming), with its tokens' logprobs when asked."""
    env = _Envelope(llm, "cmpl", "text_completion")
    prompt_text = _prompt_text(llm, prompt)
    pieces = None
    if kwargs.get("logprobs") is not None:
        pieces = _Pieces(llm, 0 if echo else len(prompt_text))
        if echo:
            kwargs["prompt_logprobs"] = kwargs["logprobs"]

    def with_prompt(text, logprobs, prompt_logprobs):
        if pieces is None:
            return prompt_text + text, None
        return prompt_text + text, _completion_logprobs(_echo_entries(llm, prompt_logprobs) + (logprobs or []),
                                                        pieces)
    if stream:
        steps = llm.generate(prompt, stream=True, **kwargs)   # checks the prompt now, not at first next()

        def chunks():
            i = -1
            for i, chunk in enumerate(steps):
                text, logprobs = chunk.text, chunk.logprobs
                if echo and i == 0:
                    text, logprobs = with_prompt(text, logprobs, chunk.prompt_logprobs)
                else:
                    logprobs = _completion_logprobs(logprobs, pieces)
                yield env.body({"text": text, "finish_reason": None}, logprobs=logprobs)
            if echo and i < 0:   # no chunk (nothing generated, no logprobs): the prompt alone
                yield env.body({"text": prompt_text, "finish_reason": None})
            yield env.body({"text": "", "finish_reason": llm.last_result.finish_reason})
        return chunks()
    result = llm.generate(prompt, **kwargs)
    if echo:
        text, logprobs = with_prompt(result.text, result.logprobs, result.prompt_logprobs)
    else:
        text, logprobs = result.text, _completion_logprobs(result.logprobs, pieces)
    return env.body({"text": text, "finish_reason": result.finish_reason}, result, logprobs=logprobs)


def chat_completion(llm, prompt_tokens, stream: bool, tools=None, tool_mode: str = "none",
                    legacy: bool = False, **kwargs):
    """create_chat_completion on an already rendered prompt: {"choices": [{"message": {"role":
    "assistant", "content"}, "finish_reason", "logprobs"}], "usage"}; streamed as "delta"
    chunks, the first carrying the role and the last the finish reason. With tool_mode "call"
    (the reply is grammar-bound to one call) or "auto", calls come back as "tool_calls"
    (pykv.server.tools); legacy (the request used "functions") adds the older "function_call"."""
    env = _Envelope(llm, "chatcmpl", "chat.completion.chunk" if stream else "chat.completion")
    pieces = _Pieces(llm)
    if stream:
        steps = llm.generate(prompt_tokens, stream=True, **kwargs)
        if tool_mode != "none":
            def logprobs(entries):
                return _chat_logprobs(entries, pieces) if kwargs.get("logprobs") is not None else None
            return _tool_chunks(llm, env, logprobs, steps, tools, tool_mode, legacy)

        def chunks():
            yield env.body({"delta": {"role": "assistant"}, "finish_reason": None})
            for chunk in steps:
                yield env.body({"delta": {"content": chunk.text}, "finish_reason": None},
                               logprobs=_chat_logprobs(chunk.logprobs, pieces))
            yield env.body({"delta": {}, "finish_reason": llm.last_result.finish_reason})
        return chunks()
    result = llm.generate(prompt_tokens, **kwargs)
    message, finish = {"role": "assistant", "content": result.text}, result.finish_reason
    calls = _calls_in(result.text, finish, tools, tool_mode)
    if calls:
        message = _call_message(calls, legacy)
        finish = _call_finish(finish, legacy)
    return env.body({"message": message, "finish_reason": finish}, result,
                    logprobs=_chat_logprobs(result.logprobs, pieces))


def _calls_in(text: str, finish: str, tools, tool_mode: str):
    """[(name, arguments text)] of the reply's calls; None when it is text."""
    if tool_mode == "call":   # a call cut short comes back as text (pykv.server.tools)
        call = bound_call(text, finish)
        return [call] if call is not None else None
    if tool_mode == "auto" and finish == "stop":
        return parse_calls(text, tools)
    return None


def _call_message(calls, legacy: bool) -> dict:
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": new_call_id(), "type": "function", "function": {"name": n, "arguments": a}}
                              for n, a in calls]}
    if legacy:
        message["function_call"] = message["tool_calls"][0]["function"]
    return message


def _call_finish(finish: str, legacy: bool) -> str:
    return ("function_call" if legacy else "tool_calls") if finish == "stop" else finish


def _call_delta(index: int, name=None, args: str = "", legacy: bool = False) -> dict:
    """A stream delta of call index: its id, type and name first (name given), then arguments."""
    fn = {"arguments": args} if name is None else {"name": name, "arguments": args}
    call = {"index": index, "function": fn}
    if name is not None:
        call.update(id=new_call_id(), type="function")
    delta = {"tool_calls": [call]}
    if legacy and index == 0:
        delta["function_call"] = fn
    return delta


def _tool_chunks(llm, env, logprobs, steps, tools, tool_mode: str, legacy: bool):
    """The stream of a chat completion that may call tools. A bound call ("call") streams its
    arguments as they come; under "auto" a reply that may be a call (it starts with "{", "[" or
    <tool_call>) is held to the end and sent as calls or as text, any other streams as text."""
    yield env.body({"delta": {"role": "assistant", "content": None}, "finish_reason": None})
    held, pending, decided = "", [], None   # decided: "text", "call" or None while unsure
    bound = CallStream() if tool_mode == "call" else None
    for chunk in steps:
        pending += chunk.logprobs or []
        if bound is not None:
            named = bound.name is not None
            args = bound.push(chunk.text)
            if bound.name is not None and (args or not named):
                yield env.body({"delta": _call_delta(0, None if named else bound.name, args, legacy),
                                "finish_reason": None}, logprobs=logprobs(pending))
                pending = []
            continue
        held += chunk.text
        if decided is None:
            decided = _may_be_call(held.lstrip())
        if decided == "text":
            yield env.body({"delta": {"content": held}, "finish_reason": None},
                           logprobs=logprobs(pending))
            held, pending = "", []
    finish = llm.last_result.finish_reason
    deltas = []
    if bound is not None:
        rest = bound.finish(finish == "stop")
        if bound.name is None:
            deltas.append({"content": bound.text})
        elif rest:
            deltas.append(_call_delta(0, None, rest, legacy))
        calls = bound_call(bound.text, finish) is not None   # cut short: its finish_reason, not "tool_calls"
    else:
        calls = _calls_in(held, finish, tools, tool_mode) if held else None
        if calls:
            deltas += [_call_delta(i, name, args, legacy) for i, (name, args) in enumerate(calls)]
        elif held:
            deltas.append({"content": held})
    for delta in deltas:
        yield env.body({"delta": delta, "finish_reason": None}, logprobs=logprobs(pending))
        pending = []
    yield env.body({"delta": {}, "finish_reason": _call_finish(finish, legacy) if calls else finish},
                   logprobs=logprobs(pending) if pending else None)


def _may_be_call(text: str):
    """"call" when a reply starting with text may be a call, "text" when not, None when unsure."""
    if text.startswith(("{", "[", "<tool_call>")):
        return "call"
    return None if "<tool_call>".startswith(text) else "text"
