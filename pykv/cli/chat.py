"""``pykv chat``: a conversation on stdin/stdout through the model's chat template.

Each turn renders the whole conversation. With the `full` policy the context keeps what it
holds of the earlier turns (Llama.generate's prefix match), so a turn evaluates only its new
tokens; an evicting policy compresses the conversation as it stands, from a fresh context.
Ctrl-C during a reply (or during a long turn's evaluation, at the next chunk) cuts the reply
short and keeps the conversation; at the prompt it ends the session (exit 130).
-f FILE starts from a document: its text, then a blank line, then the first message make the
first user message (again after /reset).
"""
from __future__ import annotations

import sys

from .main import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, model_path_arg
from .generate import (PromptProgress, _write, check_model_flags, load_model, print_kv_stats, read_flag_file,
                            sampling_kwargs)
from ..errors import ContextOverflowError, PykvError

COMMANDS = "/reset starts over, /exit ends"


def read_message(interactive: bool):
    """One user message: a line, or several joined where a line ends with a backslash.
    None at the end of input."""
    lines = []
    while True:
        if interactive:
            _write("> " if not lines else ". ")
        line = sys.stdin.readline()
        if not line:
            return "\n".join(lines) if lines else None
        line = line.rstrip("\r\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


class Totals:
    """Token counts and times over the session, for the closing timings line."""

    def __init__(self):
        self.turns = self.prompt_n = self.predicted_n = 0
        self.prompt_ms = self.predicted_ms = 0.0

    def add(self, timings: dict) -> None:
        self.turns += 1
        self.prompt_n += timings.get("prompt_n", 0)
        self.prompt_ms += timings.get("prompt_ms", 0.0)
        self.predicted_n += timings.get("predicted_n", 0)
        self.predicted_ms += timings.get("predicted_ms", 0.0)

    def line(self) -> str:
        def rate(n, ms):
            return n / ms * 1e3 if ms > 0 else 0.0
        return (f"pykv: {self.turns} replies; prompts {self.prompt_n} tokens at {rate(self.prompt_n, self.prompt_ms):.2f} "
                f"tok/s, replies {self.predicted_n} tokens at {rate(self.predicted_n, self.predicted_ms):.2f} tok/s")


def run_chat(args) -> int:

    check_model_flags(args)
    sampling = sampling_kwargs(args)   # a bad grammar or bias is refused before the model loads
    sampling["ignore_eos"] = bool(getattr(args, "ignore_eos", False))
    document = read_flag_file("-f/--file", args.file) if getattr(args, "file", None) is not None else None
    path = model_path_arg(args)
    llm = load_model(args, path)
    try:
        return converse(args, llm, sampling, document)
    finally:
        llm.close()


def with_document(document, message: str) -> str:
    """The first user message of a conversation about a document (-f): the document's text,
    a blank line, the message."""
    return message if document is None else f"{document.rstrip()}\n\n{message}"


def converse(args, llm, sampling, document=None) -> int:
    interactive = sys.stdin.isatty()
    opening = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    history = list(opening)
    totals, failed = Totals(), False
    if interactive:
        print(f"pykv: chatting with {llm.model_path} ({COMMANDS}; end a line with \\ to go on)", file=sys.stderr)
        if document is not None:
            print(f"pykv: {args.file} ({len(document)} characters) goes before your first message", file=sys.stderr)
    code = EXIT_OK
    while True:
        try:
            message = read_message(interactive)
        except KeyboardInterrupt:
            _write("\n")
            code = EXIT_INTERRUPTED
            break
        if message is None or message.strip() in ("/exit", "/quit"):
            break
        if message.strip() == "/reset":
            history = list(opening)
            continue
        if not message.strip():
            continue
        first = len(history) == len(opening)
        turn = history + [{"role": "user", "content": with_document(document, message) if first else message}]
        try:
            reply = _reply(llm, turn, sampling)
        except PykvError as exc:   # this turn cannot run (say, the conversation outgrew the context)
            print(f"pykv: error: {exc} ({COMMANDS})", file=sys.stderr)
            failed = True
            continue
        history = turn + [{"role": "assistant", "content": reply.text}]
        totals.add(reply.timings)
        if args.verbose:
            t = reply.timings
            print(f"pykv: prompt {reply.prompt_tokens} tokens ({reply.cached_tokens} kept from the last turn), "
                  f"{t['prompt_per_second']:.2f} tok/s; reply "
                  f"{len(reply.tokens)} tokens, {t['predicted_per_second']:.2f} tok/s ({reply.finish_reason})",
                  file=sys.stderr)
    if totals.turns:
        print(totals.line(), file=sys.stderr)
        if args.kv_stats:
            print_kv_stats(llm.kv_stats())
    return code if code != EXIT_OK else EXIT_RUNTIME if failed else EXIT_OK


def _reply(llm, messages, sampling):
    """Stream the assistant's reply to stdout; Ctrl-C ends it early. Returns the result."""
    prompt = llm.chat_prompt(messages)
    if len(prompt) >= llm.n_ctx and not llm.cache_bounded:   # take / evict_every_chunk read past n_ctx
        raise ContextOverflowError(f"the conversation has {len(prompt)} tokens and leaves no room for a reply "
                                   f"in n_ctx={llm.n_ctx}")
    progress = PromptProgress.for_stderr()   # a long turn (a pasted document) shows its progress
    steps = llm.generate(prompt, stream=True, prompt_progress=progress, **sampling)
    try:
        for chunk in steps:
            _write(chunk.text)
    except KeyboardInterrupt:
        if progress is not None:
            progress.clear()
        steps.close()   # the generator records the reply so far as llm.last_result
    _write("\n")
    return llm.last_result
