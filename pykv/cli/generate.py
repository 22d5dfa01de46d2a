"""``pykv generate``: stream a completion to stdout, timings (llama.cpp perf style) to stderr."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from .main import EXIT_INTERRUPTED, EXIT_OK, UsageError, model_path_arg


def read_prompt(args) -> str:
    if args.prompt is not None and args.file is not None:
        raise UsageError("give the prompt with -p or -f, not both")
    # Bytes that are not UTF-8 are kept (as surrogate escapes, like the -p text Python hands
    # over) and reach the tokenizer as they are: see model_prompt.
    if args.file is not None:
        data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
        return data.decode("utf-8", "surrogateescape")
    if args.prompt is not None:
        return args.prompt
    raise UsageError("no prompt: give -p TEXT or -f FILE")


def model_prompt(prompt: str):
    """What the model reads: the text, or its bytes when the input was not valid UTF-8 (the
    tokenizer spells such bytes with byte tokens, as Llama.tokenize does for bytes)."""
    try:
        prompt.encode("utf-8")
        return prompt
    except UnicodeEncodeError as exc:
        data = prompt.encode("utf-8", "surrogateescape")
        offset = len(prompt[:exc.start].encode("utf-8", "surrogateescape"))
        print(f"pykv: warning: the prompt is not valid UTF-8 (byte 0x{data[offset]:02x} at offset {offset}); "
              "its bytes go to the tokenizer as they are", file=sys.stderr)
        return data


def parse_policy_args(items) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--policy-arg expects K=V, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def check_model_flags(args) -> None:
    """Range checks that need no model, so mistakes are reported before a slow load."""
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"-t/--threads must be at least 1, got {args.threads}")
    if args.ctx_size < 0:
        raise UsageError(f"-c/--ctx-size must be >= 0 (0 = the model's), got {args.ctx_size}")
    if args.batch_size < 1:
        raise UsageError(f"-b/--batch-size must be at least 1, got {args.batch_size}")
    if args.ubatch_size is not None and args.ubatch_size < 1:
        raise UsageError(f"-ub/--ubatch-size must be at least 1, got {args.ubatch_size}")
    for flag, value in (("--window", args.window), ("--sink", args.sink)):
        if value is not None and value < 0:
            raise UsageError(f"{flag} must be >= 0, got {value}")
    if args.n_predict < -1:
        raise UsageError(f"-n/--n-predict must be -1 (until the end), 0 (the prompt only) or more, got {args.n_predict}")
    from .._sampling import make_sampler   # its range checks, before the model is loaded
    make_sampler(**sampler_kwargs(args))


def parse_logit_bias(items) -> dict:
    """llama.cpp's -l TOKEN_ID(+/-)BIAS: 15043+1, 15043-0.5, 15043-inf."""
    out = {}
    for item in items:
        match = re.fullmatch(r"\s*(\d+)\s*([+-]\s*(?:inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+))\s*", item, re.I)
        if not match:
            raise UsageError(f"-l/--logit-bias expects TOKEN_ID(+/-)BIAS such as 15043+1 or 15043-inf, got {item!r}")
        out[int(match.group(1))] = float(match.group(2).replace(" ", ""))
    return out


def grammar_arg(args):
    """The LlamaGrammar of --grammar, --grammar-file, --json-schema or --json-schema-file; None."""
    from ..grammar.gbnf import LlamaGrammar
    if args.grammar is not None:
        return LlamaGrammar.from_string(args.grammar)
    if args.grammar_file is not None:
        return LlamaGrammar.from_file(args.grammar_file)
    schema = args.json_schema
    if args.json_schema_file is not None:
        schema = read_flag_file("--json-schema-file", args.json_schema_file)
    return None if schema is None else LlamaGrammar.from_json_schema(schema)


def read_flag_file(flag: str, path) -> str:
    """The UTF-8 text of a file a flag names; UsageError when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {flag} {path}: {e}") from None


def sampler_kwargs(args) -> dict:
    """The sampler chain's arguments from the shared flags (make_sampler's and generate's names)."""
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, typical_p=args.typical,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                logit_bias=parse_logit_bias(args.logit_bias) or None, mirostat_mode=args.mirostat,
                mirostat_tau=args.mirostat_ent, mirostat_eta=args.mirostat_lr)


def sampling_kwargs(args) -> dict:
    """Llama.generate's length, sampling, grammar and stop arguments from the shared flags."""
    return dict(sampler_kwargs(args), grammar=grammar_arg(args),
                max_tokens=args.n_predict if args.n_predict > 0 else None,
                seed=args.seed if args.seed >= 0 else None, stop=args.stop or None)


def chat_template_arg(args):
    """--chat-template's text, or --chat-template-file's; None for the GGUF's template."""
    if getattr(args, "chat_template_file", None) is None:
        return getattr(args, "chat_template", None)
    return read_flag_file("--chat-template-file", args.chat_template_file)


def cache_types_arg(args):
    """The keys' and the values' KV cache types: -ctk and -ctv, each side defaulting to
    --cache-type, then to f16 (llama.cpp's default for both)."""
    both = getattr(args, "cache_type", None) or "f16"
    return getattr(args, "cache_type_k", None) or both, getattr(args, "cache_type_v", None) or both


def load_model(args, path, **extra):
    """A Llama from the shared model, context, policy and chat template flags (extra: more
    Llama arguments)."""
    from .. import Llama
    kv_type, kv_type_v = cache_types_arg(args)
    return Llama(str(path), chat_template=chat_template_arg(args), n_ctx=args.ctx_size, n_threads=args.threads,
                 n_batch=args.batch_size, n_ubatch=args.ubatch_size, seed=args.seed, verbose=args.verbose,
                 use_mmap=not args.no_mmap, n_gpu_layers=args.n_gpu_layers, main_gpu=args.main_gpu,
                 policy=args.policy, budget=args.budget,
                 window=args.window, sink=args.sink, exact_matmul=args.exact_matmul, kv_type=kv_type,
                 kv_type_v=kv_type_v, policy_kwargs=parse_policy_args(args.policy_arg) or None,
                 evict_every_chunk=getattr(args, "evict_every_chunk", False), **extra)


_written = {"last": ""}   # the last character written to stdout by _write


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
    if text:
        _written["last"] = text[-1]


def _end_line() -> None:
    """A newline after the output unless it is empty or already ends with one (llama.cpp's
    main ends its output so, and the shell prompt then starts on a line of its own)."""
    if _written["last"] not in ("", "\n"):
        _write("\n")


def run_generate(args) -> int:

    prompt = read_prompt(args)
    check_model_flags(args)
    if args.prompt_cache_ro and not args.prompt_cache:
        raise UsageError("--prompt-cache-ro needs --prompt-cache FILE")
    parse_policy_args(args.policy_arg)
    sampling = sampling_kwargs(args)   # a bad grammar or bias is refused before the model loads
    path = model_path_arg(args)

    t0 = time.perf_counter()
    llm = load_model(args, path)
    load_ms = (time.perf_counter() - t0) * 1e3
    try:
        return _generate(args, llm, prompt, path, load_ms, sampling)
    finally:
        llm.close()


def _generate(args, llm, prompt, path, load_ms, sampling) -> int:
    text_in = model_prompt(prompt)
    _written["last"] = ""
    streaming = not (args.no_stream or args.json)
    show_prompt = not args.no_display_prompt and not args.json
    try:
        sys.stdout.reconfigure(errors="replace")
    except (AttributeError, ValueError):
        pass

    kwargs = dict(sampling, ignore_eos=args.ignore_eos)
    if args.prompt_cache:
        _load_prompt_cache(llm, args.prompt_cache, path)
        if not args.prompt_cache_ro:
            llm._after_prompt = lambda: _save_prompt_cache(llm, args.prompt_cache, path)

    # On a terminal a long prompt shows its progress on stderr; the prompt's text is then
    # echoed once it has been evaluated, so that the progress line does not overwrite it.
    progress = PromptProgress.for_stderr()
    echo = show_prompt and streaming
    interrupted = False
    steps = None
    t_start = time.perf_counter()
    try:
        if streaming and args.n_predict != 0:
            # generate() checks the prompt (empty, longer than the context) before it returns
            # the stream, so an error is not printed after the prompt's text
            steps = llm.generate(text_in, stream=True, prompt_progress=progress, **kwargs)
        if echo and progress is None:
            _write(prompt)
            echo = False
        if args.n_predict == 0:
            result = _prefill_only(llm, text_in, progress)
        elif streaming:
            for chunk in steps:
                if echo:
                    _write(prompt)
                    echo = False
                _write(chunk.text)
            result = llm.last_result
        else:
            result = llm.generate(text_in, stream=False, prompt_progress=progress, **kwargs)
        if echo:   # the prompt alone (-n 0, or nothing generated)
            _write(prompt)
    except KeyboardInterrupt:
        interrupted = True
        if progress is not None:
            progress.clear()
        if steps is not None:
            steps.close()  # the generator records what it had as llm.last_result
        result = getattr(llm, "last_result", None)
    total_ms = (time.perf_counter() - t_start) * 1e3

    if result is None:
        print("\npykv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(_json_result(result, path, load_ms, total_ms), ensure_ascii=False))
    elif streaming:
        _end_line()
    else:
        _write((prompt if show_prompt else "") + result.text)
        _end_line()

    if args.prompt_cache:
        print(f"pykv: prompt cache: {result.cached_tokens} of {result.prompt_tokens} prompt tokens reused",
              file=sys.stderr)
    print_perf(result, load_ms, total_ms)
    if args.kv_stats or args.verbose:
        print_kv_stats(result.kv_stats)
    if interrupted:
        print("pykv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


class _PrefillResult:
    """What -n 0 reports: the prompt was evaluated, nothing generated."""

    def __init__(self, llm, n_prompt, n_cached):
        self.text, self.tokens, self.finish_reason = "", [], "length"
        self.prompt_tokens = n_prompt
        self.cached_tokens = n_cached
        self.timings = llm.timings()
        self.kv_stats = llm.kv_stats()


class PromptProgress:
    """'pykv: prompt 1024/8192 tokens (12%)' after each chunk of a prompt of several chunks,
    redrawn in place, erased when the prompt is done."""

    def __init__(self, stream):
        self.stream = stream
        self.shown = False

    @classmethod
    def for_stderr(cls):
        """On a terminal only: a log keeps no progress lines."""
        return cls(sys.stderr) if sys.stderr.isatty() else None

    def __call__(self, n_done: int, n_total: int) -> None:
        if n_done >= n_total:
            self.clear()
            return
        self.stream.write(f"\rpykv: prompt {n_done}/{n_total} tokens ({100 * n_done // n_total}%)")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


def _prefill_only(llm, prompt, progress=None):
    tokens = llm._prompt_tokens(prompt)
    cached = llm._start_from(tokens)
    llm._reset_timings()
    llm._eval_prompt(tokens[cached:], progress=progress)
    if llm._after_prompt is not None:
        llm._after_prompt()
    return _PrefillResult(llm, len(tokens), cached)


def _load_prompt_cache(llm, cache_path, model_path) -> None:
    """Start from the saved prompt (generate() then keeps its longest common prefix with this
    one); a cache that cannot be used is reported and left for the run to overwrite."""
    from .._state import read_state_file
    from ..errors import PykvError
    if not Path(cache_path).exists():
        return
    try:
        llm.load_state(read_state_file(cache_path, model_path))
    except (OSError, ValueError, PykvError) as exc:
        print(f"pykv: warning: prompt cache {cache_path} not used: {exc}", file=sys.stderr)


def _save_prompt_cache(llm, cache_path, model_path) -> None:
    """The evaluated prompt, logits included, into the cache file (before any generation, as
    llama.cpp does): the same prompt next time evaluates nothing and continues identically."""
    from .._state import write_state_file
    write_state_file(cache_path, llm.save_state(), model_path)


def _json_result(result, path, load_ms, total_ms) -> dict:
    return {
        "model": str(path),
        "text": result.text,
        "tokens": list(result.tokens),
        "finish_reason": result.finish_reason,
        "prompt_tokens": getattr(result, "prompt_tokens", None),
        "cached_tokens": getattr(result, "cached_tokens", 0),
        "timings": dict(result.timings, load_ms=load_ms, total_ms=total_ms),
        "kv_stats": result.kv_stats,
    }


def _rate_line(label, ms, n, unit):
    per_token = ms / n if n else 0.0
    per_second = n / ms * 1e3 if ms > 0 else 0.0
    return (f"pykv: {label:>16} = {ms:10.2f} ms / {n:5d} {unit:6} "
            f"({per_token:8.2f} ms per token, {per_second:8.2f} tokens per second)")


def _rate(n: int, ms: float) -> str:
    """tokens per second, or "-" when no token was evaluated (a prompt taken whole from the cache)."""
    return f"{n / ms * 1e3:.2f} tok/s" if n > 0 and ms > 0 else "- tok/s"


def print_perf(result, load_ms, total_ms) -> None:
    t = result.timings or {}
    p_n, p_ms = int(t.get("prompt_n", 0)), float(t.get("prompt_ms", 0.0))
    d_n, d_ms = int(t.get("predicted_n", 0)), float(t.get("predicted_ms", 0.0))
    err = sys.stderr
    print(f"pykv: {'load time':>16} = {load_ms:10.2f} ms", file=err)
    print(_rate_line("prompt eval time", p_ms, p_n, "tokens"), file=err)
    print(_rate_line("eval time", d_ms, d_n, "runs"), file=err)
    print(f"pykv: {'total time':>16} = {total_ms:10.2f} ms / {p_n + d_n:5d} tokens", file=err)
    print(f"pykv: prefill {_rate(p_n, p_ms)}, decode {_rate(d_n, d_ms)}, "
          f"{len(result.tokens)} tokens generated (finish: {result.finish_reason})", file=err)
    err.flush()


def print_kv_stats(stats) -> None:
    if not stats:
        return
    per_head = stats.get("entries_per_head") or []
    flat = [n for layer in per_head for n in layer]
    shape = f" over {len(per_head)} layers x {len(per_head[0])} KV heads" if per_head and per_head[0] else ""
    spread = f", per head min {min(flat)} / max {max(flat)}" if flat else ""
    k, v = stats.get("kv_type", "f16"), stats.get("kv_type_v", stats.get("kv_type", "f16"))
    types = k if k == v else f"K {k}, V {v}"
    print(f"pykv: kv cache: policy {stats.get('policy')}, {stats.get('entries')} entries{shape}{spread}, "
          f"{stats.get('bytes', 0) / 2**20:.2f} MiB now ({types}), {stats.get('peak_bytes', 0) / 2**20:.2f} MiB peak, "
          f"{stats.get('evicted', 0)} evicted, {stats.get('merged', 0)} merged", file=sys.stderr)
