"""``pykv perplexity``: llama-perplexity's measurement of a text file, under a KV cache policy."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .main import EXIT_OK, UsageError, model_path_arg


def add_perplexity_parser(sub, add_model_flags):
    p = sub.add_parser("perplexity", help="measure a model's perplexity on a text (llama-perplexity)",
                       description="Perplexity of a text file, as llama.cpp's llama-perplexity measures it: "
                                   "the tokens are cut into chunks of -c tokens, each chunk is run from an "
                                   "empty context and its second half is scored. Under an evicting --policy "
                                   "the first half is compressed as a prompt would be, so the figure shows "
                                   "what the compression costs. The final estimate goes to stdout, progress "
                                   "to stderr.")
    add_model_flags(p)
    p.set_defaults(ctx_size=512, seed=-1)
    for action in p._actions:
        if action.dest == "ctx_size":
            action.help = "chunk size, and the context's (default 512)"
        elif action.dest == "kv_stats":
            action.help = "print the KV cache statistics of the last chunk on stderr"
    g = p.add_argument_group("text and scoring")
    g.add_argument("-f", "--file", required=True, help="the text file ('-' = stdin)")
    g.add_argument("--chunks", type=int, default=None, metavar="N", help="score at most N chunks (default: all)")
    g.add_argument("--decode", action="store_true",
                   help="score the second half token by token as decode steps (slower; what a policy that "
                        "evicts while generating acts on) instead of as one more prefill")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    g.add_argument("-v", "--verbose", action="store_true", help="runtime logging; tracebacks on errors")
    p.set_defaults(run="perplexity")


def run_perplexity(args) -> int:
    from .generate import load_model, parse_policy_args
    from ..errors import InvalidArgumentError
    from ..perplexity import perplexity

    if args.ctx_size < 4:
        raise UsageError(f"-c/--ctx-size is the chunk size here and must be at least 4, got {args.ctx_size}")
    if args.chunks is not None and args.chunks < 1:
        raise UsageError(f"--chunks must be at least 1, got {args.chunks}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"-t/--threads must be at least 1, got {args.threads}")
    parse_policy_args(args.policy_arg)
    text = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    path = model_path_arg(args)
    llm = load_model(args, path)
    try:
        tokens = llm.tokenize(text, add_bos=True)   # as perplexity() would: once, here
        n_tokens = len(tokens)
        n_chunks = min(n_tokens // args.ctx_size, args.chunks or n_tokens)
        if n_chunks == 0:
            raise UsageError(f"the text has {n_tokens} tokens, fewer than one chunk of -c {args.ctx_size}: "
                             "give a longer text or a smaller -c")
        print(f"pykv: perplexity: {n_tokens} tokens, {n_chunks} chunks of {args.ctx_size}, policy {args.policy}"
              + (f", budget {args.budget}" if args.budget else "") + (", decode steps" if args.decode else ""),
              file=sys.stderr)
        t0 = time.perf_counter()

        def progress(i, n, ppl):
            end = "\n" if i == n else ""
            print(f"[{i}]{ppl:.4f}," if i < n else f"[{i}]{ppl:.4f}", end=end, file=sys.stderr, flush=True)
        try:
            result = perplexity(llm, tokens, chunk_size=args.ctx_size, max_chunks=args.chunks, decode=args.decode,
                                progress=progress)
        except InvalidArgumentError as exc:
            raise UsageError(str(exc)) from None
        seconds = time.perf_counter() - t0
    finally:
        llm.close()
    if args.json:
        print(json.dumps({"model": str(path), "policy": args.policy, "budget": args.budget,
                          "chunk_size": result.chunk_size, "chunks": result.chunks, "ppl": result.ppl,
                          "ppl_err": result.ppl_err, "nll": result.nll, "n_scored": result.n_scored,
                          "decode": args.decode, "seconds": seconds}))
    else:
        print(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_err:.5f}")
    if args.kv_stats or args.verbose:
        from .generate import print_kv_stats
        print_kv_stats(result.kv_stats)
    print(f"pykv: {result.n_scored} tokens scored in {seconds:.2f} s ({seconds / len(result.chunks):.2f} s per chunk)",
          file=sys.stderr)
    return EXIT_OK
