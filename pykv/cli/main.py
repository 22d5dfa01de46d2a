"""The ``pykv`` command: ``pykv generate|chat|perplexity|embed|serve|info|pull|convert|bench|eval ...``
(llama.cpp flag spellings).

Exit codes: 0 ok, 1 usage error, 2 model or IO error, 3 runtime error, 130 interrupted.
Errors print one line ``pykv: error: <message>`` on stderr (``-v`` adds the traceback).
The subcommands live in generate.py, chat.py, perplexity.py, embed.py, serve.py, info.py,
bench.py and eval.py beside this file, pull and convert here; this file builds the parser and turns
exceptions into exit codes.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path

EXIT_OK, EXIT_USAGE, EXIT_MODEL, EXIT_RUNTIME, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


KV_CACHE_TYPES = ("f16", "f32", "q8_0")   # Llama(kv_type=...); f16 is the default


class UsageError(Exception):
    """A bad command line (exit 1)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit status 1 (argparse uses 2)."""

    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _add_model_flags(p):
    g = p.add_argument_group("model and context")
    g.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="GGUF path, model name (smollm2) or hf://owner/repo/file.gguf "
                        "(default: smollm2, fetched on first use)")
    g.add_argument("-m", "--model", help="same as MODEL")
    g.add_argument("-c", "--ctx-size", type=int, default=4096, metavar="N",
                   help="context size in tokens (default 4096; 0 = the model's training context); with "
                        "--policy take or --evict-every-chunk it bounds the KV cache, not the prompt")
    g.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="threads (default: number of physical cores)")
    g.add_argument("-b", "--batch-size", type=int, default=512, metavar="N",
                   help="prefill chunk in tokens (default 512)")
    g.add_argument("-ub", "--ubatch-size", type=int, default=None, metavar="N",
                   help="physical prefill chunk; overrides -b when given")
    g.add_argument("--no-mmap", action="store_true", help="read the model into memory instead of mapping it")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=0, metavar="N",
                   help="layers on the GPU, as llama.cpp: the last N layers and their KV cache; more than the "
                        "model has (99) or -1 puts all of it there (default 0; needs a CUDA build)")
    g.add_argument("-mg", "--main-gpu", type=int, default=0, metavar="I", help="the CUDA device to use (default 0)")
    g.add_argument("--exact-matmul", action="store_true",
                   help="float activations in every matrix product (slower; by default decode steps and "
                        "prefill chunks quantise them to 8 bits, as llama.cpp does)")

    k = p.add_argument_group("KV cache policy")
    k.add_argument("--policy", default="full", help="eviction policy (default full; see 'pykv info --policies')")
    k.add_argument("--budget", default=None,
                   help="entries kept per (layer, KV head) on average, or a share of the prompt like 3%% "
                        "(raised to the policy's floor, 64 entries or its window, with a warning); default for "
                        "an evicting policy: 25%% of the prompt, at least 256 entries")
    k.add_argument("--evict-every-chunk", action="store_true",
                   help="cut the cache back to the budget after every prefill chunk (any evicting policy; take "
                        "always does), so the cache never holds the whole prompt and a prompt longer than -c "
                        "goes through")
    k.add_argument("--window", type=int, default=None, metavar="N", help="recent tokens always kept")
    k.add_argument("--sink", type=int, default=None, metavar="N", help="first tokens always kept")
    k.add_argument("--policy-arg", action="append", default=[], metavar="K=V",
                   help="a policy-specific option (repeatable)")
    k.add_argument("--cache-type", choices=KV_CACHE_TYPES, default=None,
                   help="how keys and values are stored (default f16, as llama.cpp; f32 is exact; q8_0 takes "
                        "about half the memory of f16, as llama.cpp's -ctk q8_0 -ctv q8_0)")
    k.add_argument("--cache-type-k", "-ctk", choices=KV_CACHE_TYPES, default=None,
                   help="how keys are stored, as llama.cpp's -ctk (default: --cache-type, else f16)")
    k.add_argument("--cache-type-v", "-ctv", choices=KV_CACHE_TYPES, default=None,
                   help="how values are stored, as llama.cpp's -ctv (default: --cache-type, else f16)")
    k.add_argument("--kv-stats", action="store_true", help="print KV cache statistics on stderr at the end")


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate text after a prompt; tokens stream to stdout, "
                                   "timings go to stderr.")
    _add_model_flags(p)
    g = p.add_argument_group("prompt and length")
    g.add_argument("-p", "--prompt", help="the prompt text")
    g.add_argument("-f", "--file", help="read the prompt from a file ('-' = stdin)")
    g.add_argument("-n", "--n-predict", type=int, default=128, metavar="N",
                   help="tokens to generate (default 128; -1 = until end of generation or a full "
                        "context; 0 = evaluate the prompt only)")
    g.add_argument("--no-display-prompt", action="store_true", help="do not echo the prompt")
    _add_sampling_flags(p)

    c = p.add_argument_group("generation control and output")
    c.add_argument("--stop", "-r", "--reverse-prompt", action="append", default=[], metavar="STR",
                   help="stop when this text appears (repeatable)")
    c.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    c.add_argument("--prompt-cache", metavar="FILE",
                   help="keep the evaluated prompt in FILE and reuse its longest common prefix with the next "
                        "run's prompt (an evicting policy: the compressed cache, reused for the same prompt only)")
    c.add_argument("--prompt-cache-ro", action="store_true", help="use --prompt-cache FILE but do not update it")
    c.add_argument("--no-stream", action="store_true", help="print the text once, at the end")
    c.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, timings) at the end")
    c.add_argument("-v", "--verbose", action="store_true", help="log from the runtime; tracebacks on errors")
    p.set_defaults(run="generate")


def _add_sampling_flags(p):
    s = p.add_argument_group("sampling")
    s.add_argument("--temp", type=float, default=0.8, help="temperature (default 0.8; 0 = greedy)")
    s.add_argument("--top-k", type=int, default=40, help="top-k (default 40; 0 = off)")
    s.add_argument("--top-p", type=float, default=0.95, help="top-p (default 0.95; 1 = off)")
    s.add_argument("--min-p", type=float, default=0.05, help="min-p (default 0.05; 0 = off)")
    s.add_argument("--typical", type=float, default=1.0, metavar="P",
                   help="locally typical sampling after top-k, parameter P (default 1.0 = off)")
    s.add_argument("--repeat-penalty", type=float, default=1.0, help="repeat penalty (default 1.0 = off)")
    s.add_argument("--repeat-last-n", type=int, default=64,
                   help="tokens the penalties look back over (default 64; -1 = all)")
    s.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted from a token's logit per occurrence in those tokens (default 0 = off)")
    s.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted once from the logit of a token that occurs there (default 0 = off)")
    s.add_argument("-l", "--logit-bias", action="append", default=[], metavar="TOKEN_ID(+/-)BIAS",
                   help="add BIAS to a token's logit, e.g. 15043+1 or 15043-inf to ban it (repeatable)")
    s.add_argument("-s", "--seed", type=int, default=-1, help="sampling seed (default -1 = random)")
    s.add_argument("--mirostat", type=int, default=0, metavar="N",
                   help="Mirostat sampling instead of top-k, top-p and min-p: 1 or 2 (2.0); default 0 = off")
    s.add_argument("--mirostat-lr", type=float, default=0.1, metavar="ETA", help="Mirostat learning rate (0.1)")
    s.add_argument("--mirostat-ent", type=float, default=5.0, metavar="TAU",
                   help="Mirostat target entropy, in bits (5.0)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--grammar", metavar="GBNF", help="constrain the output to this GBNF grammar (llama.cpp's)")
    g.add_argument("--grammar-file", metavar="FILE", help="read the GBNF grammar from FILE")
    g.add_argument("-j", "--json-schema", metavar="SCHEMA",
                   help="constrain the output to JSON that this JSON Schema allows ('{}' for any JSON)")
    g.add_argument("-jf", "--json-schema-file", metavar="FILE", help="read the JSON Schema from FILE")


def add_chat_template_flags(p):
    g = p.add_argument_group("chat template").add_mutually_exclusive_group()
    g.add_argument("--chat-template", default=None, metavar="JINJA",
                   help="use this chat template (Jinja2 text, or chatml) instead of the GGUF's")
    g.add_argument("--chat-template-file", default=None, metavar="FILE", help="the same, read from FILE")


def _add_chat(sub):
    p = sub.add_parser("chat", help="talk with a model, one message per line",
                       description="A conversation with the model's chat template: each line read from stdin "
                                   "is a user message (end a line with \\ to continue it on the next), the "
                                   "reply streams to stdout. /reset starts over, /exit or end of input stops.")
    _add_model_flags(p)
    g = p.add_argument_group("conversation")
    g.add_argument("-sys", "--system-prompt", default=None, metavar="TEXT", help="a system message first")
    g.add_argument("-n", "--n-predict", type=int, default=-1, metavar="N",
                   help="at most N tokens per reply (default -1: until the model ends its turn or the context is full)")
    g.add_argument("--stop", "-r", "--reverse-prompt", action="append", default=[], metavar="STR",
                   help="also end a reply when this text appears (repeatable)")
    g.add_argument("-f", "--file", default=None, metavar="FILE",
                   help="a document to talk about: its text goes before the first message (and the first "
                        "after /reset)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-generation tokens (a reply then ends at -n or a full context)")
    g.add_argument("-v", "--verbose", action="store_true", help="log from the runtime; timings per reply; tracebacks")
    add_chat_template_flags(p)
    _add_sampling_flags(p)
    p.set_defaults(run="chat")


def _add_info(sub):
    p = sub.add_parser("info", help="show a model's metadata, tensors and KV memory estimate",
                       description="Show a GGUF model's header, metadata, hyperparameters, tensors, "
                                   "chat template and KV cache memory estimates.")
    p.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="GGUF path, model name or hf:// address (default: smollm2)")
    p.add_argument("-m", "--model", help="same as MODEL")
    p.add_argument("--system", action="store_true", help="print the native library's system info")
    p.add_argument("--policies", action="store_true", help="list the KV eviction policies")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, metavar="N",
                   help="also load the weights and show what -ngl N puts on the GPU")
    p.add_argument("-mg", "--main-gpu", type=int, default=0, metavar="I", help="the CUDA device (default 0)")
    p.add_argument("--json", action="store_true", help="print the model information as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    p.set_defaults(run="info")


def _add_pull(sub):
    p = sub.add_parser("pull", help="download a model into the cache",
                       description="Fetch a model into the pykv cache and print its path.")
    p.add_argument("name", metavar="NAME", help="a model name (smollm2, smollm2-135m) or hf://owner/repo/file.gguf")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    p.set_defaults(run="pull")


def _add_convert(sub):
    p = sub.add_parser("convert", help="convert a Hugging Face Llama/Mistral folder to GGUF",
                       description="Write a GGUF file from a Hugging Face model folder (config.json, "
                                   "*.safetensors, tokenizer.json) and print its path. Needs the gguf "
                                   "package (pip install gguf, or pip install '.[hf]' in a pykv checkout).")
    p.add_argument("model_dir", metavar="DIR", help="the Hugging Face model folder")
    p.add_argument("-o", "--outfile", default=None, metavar="PATH",
                   help="the GGUF to write (default: DIR/<name>-<OUTTYPE>.gguf)")
    p.add_argument("--outtype", default="f16", choices=["f32", "f16", "q8_0", "q4_0", "q4_1"],
                   help="type of the weight matrices (default f16; norms stay f32)")
    p.add_argument("--pre", default=None, metavar="NAME",
                   help="the tokenizer's pre-tokenizer when tokenizer.json does not tell (gpt2, llama-bpe, "
                        "qwen2, smollm, default)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    p.set_defaults(run="convert")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pykv", description="pykv: a llama.cpp-style GGUF runtime with KV-cache "
                                              "eviction policies.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_generate(sub)
    _add_chat(sub)
    from .perplexity import add_perplexity_parser
    add_perplexity_parser(sub, _add_model_flags)
    from .embed import add_embed_parser
    add_embed_parser(sub, _add_model_flags)
    from .serve import add_serve_parser
    add_serve_parser(sub, _add_model_flags)
    _add_info(sub)
    _add_pull(sub)
    _add_convert(sub)
    from .bench import add_bench_parser
    add_bench_parser(sub)
    from .eval import add_eval_parser
    add_eval_parser(sub, _Parser)
    return parser


def resolve_model_arg(args) -> str | None:
    """The model from MODEL or -m (not both); None when neither was given."""
    if args.model_pos and args.model and args.model_pos != args.model:
        raise UsageError(f"two models given: {args.model_pos!r} and -m {args.model!r}")
    return args.model or args.model_pos


def model_path_arg(args):
    """The model file MODEL or -m names (a name or hf:// address fetched on first use); the
    default model (smollm2) when neither is given."""
    from ..pull import default_model_path, pull
    model = resolve_model_arg(args)
    return pull(model) if model else default_model_path()


def _run_pull(args) -> int:
    from ..pull import pull
    print(pull(args.name, quiet=args.quiet))
    return EXIT_OK


def _dispatch(args) -> int:
    if args.run == "generate":
        from .generate import run_generate
        return run_generate(args)
    if args.run == "convert":
        from ..convert import convert   # the repository's convert/, shipped as pykv/convert
        model_dir = Path(args.model_dir)
        out = args.outfile or model_dir / f"{model_dir.resolve().name}-{args.outtype.upper()}.gguf"
        print(convert(model_dir, out, args.outtype, args.pre, progress=None if args.quiet else sys.stderr))
        return EXIT_OK
    if args.run == "chat":
        from .chat import run_chat
        return run_chat(args)
    if args.run == "serve":
        from .serve import run_serve
        return run_serve(args)
    if args.run == "embed":
        from .embed import run_embed
        return run_embed(args)
    if args.run == "perplexity":
        from .perplexity import run_perplexity
        return run_perplexity(args)
    if args.run == "eval":
        from .eval import run_eval
        return run_eval(args)
    if args.run == "info":
        from .info import run_info
        return run_info(args)
    if args.run == "bench":
        from .bench import run_bench
        from ..llama import _resolve_model_path
        return run_bench(args, _resolve_model_path(resolve_model_arg(args) or "smollm2"))
    return _run_pull(args)


def _exit_code_for(exc: BaseException) -> int:
    """Map an exception to the documented exit code."""
    try:
        from .. import errors
    except Exception:  # noqa: BLE001 - the package itself failed to import
        errors = None
    from ..pull import PullError

    if isinstance(exc, UsageError):
        return EXIT_USAGE
    if errors is not None:
        if isinstance(exc, errors.InvalidArgumentError):
            return EXIT_USAGE
        if isinstance(exc, errors.ModelLoadError):
            return EXIT_MODEL
        if isinstance(exc, errors.PykvError):
            return EXIT_RUNTIME
    if isinstance(exc, (PullError, OSError, ValueError)):
        return EXIT_MODEL  # files, downloads, unknown model names
    return EXIT_RUNTIME


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, ImportError) and "libpykv" not in text:
        text = f"cannot load pykv: {text}"
    return " ".join(text.split("\n"))  # one line


def _print_warning(message, category, filename, lineno, file=None, line=None):
    print(f"pykv: warning: {message}", file=sys.stderr)


def main(argv=None) -> int:
    """Entry point of the ``pykv`` command; returns the exit code (also raised as SystemExit
    when run as a script). Python warnings print as one line, `pykv: warning: ...`."""
    with warnings.catch_warnings():
        warnings.showwarning = _print_warning
        return _main(argv)


def _main(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "-v" in argv or "--verbose" in argv
    try:
        args = build_parser().parse_args(argv)
        if args.version:
            from importlib.metadata import PackageNotFoundError, version
            try:
                print(f"pykv {version('pykv')}")
            except PackageNotFoundError:
                print("pykv (not installed)")
            return EXIT_OK
        if not args.command:
            raise UsageError("a command is required: generate, chat, perplexity, embed, serve, info, pull, convert "
                             "or bench (see 'pykv --help')")
        return _dispatch(args)
    except KeyboardInterrupt:
        print("\npykv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (pykv ... | head); stop quietly like other Unix tools
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        if verbose:
            traceback.print_exc()
        print(f"pykv: error: {_error_text(exc)}", file=sys.stderr)
        return _exit_code_for(exc)
