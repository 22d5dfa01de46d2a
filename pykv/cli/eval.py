"""``pykv eval needle|kl|ppl|compare``: quality under compression as grids of runs (pykv.eval)."""

from __future__ import annotations

import sys
from pathlib import Path

from .main import EXIT_OK, KV_CACHE_TYPES, UsageError, model_path_arg


def add_eval_parser(sub, parser_class):
    p = sub.add_parser("eval", help="measure what each KV policy and budget costs in quality",
                       description="Grids of runs under every policy and budget, against the full cache: "
                                   "'needle' (passkey retrieval), 'kl' (KL divergence of next-token "
                                   "distributions), 'ppl' (perplexity), and 'compare' of two runs' results. "
                                   "Tables go to stdout and DIR/summary.md, one record per run to "
                                   "DIR/results.json, pictures to DIR/*.png; a run that is stopped resumes "
                                   "from DIR.")
    kinds = p.add_subparsers(dest="eval_kind", metavar="KIND", parser_class=parser_class)
    kinds.required = True
    needle = kinds.add_parser("needle", help="needle-in-a-haystack retrieval grid",
                              description="A passkey hidden at a depth of a haystack of public-domain text "
                                          "(shipped with pykv), asked for through the model's chat template; "
                                          "greedy answer; accuracy per policy, budget, length and setting.")
    _grid_flags(needle, lengths="2k,4k,7k")
    needle.add_argument("--setting", default="aware,agnostic",
                        help="aware: the question is in the prompt the policy compresses; agnostic: the "
                             "context is compressed before the question arrives (default both)")
    needle.add_argument("--depths", default="10,30,50,70,90",
                        help="needle depths in %% of the document; sample i takes depth i mod their count")
    kl = kinds.add_parser("kl", help="KL divergence from the full cache's next-token distributions",
                          description="Per sample, a passage's first LENGTH tokens are a prompt the policy "
                                      "compresses; the next --tokens tokens are fed one by one and the mean "
                                      "KL(full || policy) of the distributions before them is the run's value.")
    _grid_flags(kl, lengths="2048")
    kl.add_argument("--tokens", type=int, default=64, metavar="N", help="tokens scored after the prompt (64)")
    kl.add_argument("-f", "--file", default=None, help="text to cut passages from (default: the shipped haystack)")
    ppl = kinds.add_parser("ppl", help="perplexity under each policy and budget",
                           description="Per sample, a chunk of LENGTH tokens: its first half is a prompt the "
                                       "policy compresses, its second half is scored (llama-perplexity's rule).")
    _grid_flags(ppl, lengths="1024")
    ppl.add_argument("--decode", action="store_true", help="score the second half as decode steps")
    ppl.add_argument("-f", "--file", default=None, help="text to cut chunks from (default: the shipped haystack)")
    cmp = kinds.add_parser("compare", help="two runs' results side by side",
                           description="Cells of two results.json files side by side, with the difference "
                                       "and whether it is larger than its standard error.")
    cmp.add_argument("a", metavar="A.json")
    cmp.add_argument("b", metavar="B.json")
    cmp.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")
    p.set_defaults(run="eval")


def _grid_flags(p, lengths):
    p.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="GGUF path, model name or hf:// address (default: smollm2)")
    p.add_argument("-m", "--model", help="same as MODEL")
    g = p.add_argument_group("grid")
    g.add_argument("--lengths", default=lengths, help=f"prompt lengths in tokens, 2k = 2048 (default {lengths})")
    g.add_argument("--budgets", default="2%,5%,10%,25%",
                   help="shares of what the policy compresses (10%%) or entries per (layer, KV head) "
                        "(default 2%%,5%%,10%%,25%%)")
    g.add_argument("--policies", default="all",
                   help="comma list, 'all' = every policy; a policy's own options follow a plus: "
                        "cake+pool=max (default all; the full cache always runs as the reference)")
    g.add_argument("--samples", type=int, default=20, metavar="N", help="samples per cell (default 20)")
    g.add_argument("--seed", type=int, default=0, help="which samples: another seed gives other haystacks, "
                                                       "passkeys and passages (default 0)")
    g.add_argument("--out", default=None, metavar="DIR",
                   help="results folder (default ./pykv-eval-KIND); a run resumes from what DIR holds")
    g.add_argument("--no-plots", action="store_true", help="write no pictures")
    r = p.add_argument_group("runtime (as pykv generate)")
    r.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="threads (default: physical cores)")
    r.add_argument("-b", "--batch-size", type=int, default=512, metavar="N", help="prefill chunk (512)")
    r.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, metavar="N", help="layers on the GPU")
    r.add_argument("--exact-matmul", action="store_true", help="float activations in every matrix product")
    r.add_argument("--window", type=int, default=None, metavar="N", help="recent tokens always kept (every policy)")
    r.add_argument("--sink", type=int, default=None, metavar="N", help="first tokens always kept (every policy)")
    r.add_argument("--policy-arg", action="append", default=[], metavar="K=V",
                   help="an option for every policy (repeatable); per policy, use policy+K=V")
    r.add_argument("--evict-every-chunk", action="store_true",
                   help="every evicting policy cuts the cache back after each prefill chunk")
    r.add_argument("-ctk", "--cache-type-k", choices=KV_CACHE_TYPES, default=None, help="key storage (f16)")
    r.add_argument("-ctv", "--cache-type-v", choices=KV_CACHE_TYPES, default=None, help="value storage (f16)")
    r.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors")


def _config(args):
    from ..eval import EvalConfig, parse_budgets, parse_depths, parse_lengths, parse_policies, parse_settings
    from .generate import parse_policy_args
    if args.samples < 1:
        raise UsageError("--samples must be at least 1")
    out = Path(args.out) if args.out else Path(f"pykv-eval-{args.eval_kind}")
    cfg = EvalConfig(model=str(model_path_arg(args)), out=out, lengths=parse_lengths(args.lengths),
                     budgets=parse_budgets(args.budgets), policies=parse_policies(args.policies),
                     samples=args.samples, seed=args.seed, threads=args.threads, n_batch=args.batch_size,
                     n_gpu_layers=args.n_gpu_layers, window=args.window, sink=args.sink,
                     policy_kwargs=parse_policy_args(args.policy_arg), evict_every_chunk=args.evict_every_chunk,
                     exact_matmul=args.exact_matmul, kv_type=args.cache_type_k, kv_type_v=args.cache_type_v)
    if args.eval_kind == "needle":
        cfg.settings = parse_settings(args.setting)
        cfg.depths = parse_depths(args.depths)
    return cfg


def run_eval(args) -> int:
    from ..eval import compare, evaluate, write_outputs
    from ..eval.plots import PLOT_HINT
    if args.eval_kind == "compare":
        print(compare(args.a, args.b))
        return EXIT_OK
    cfg = _config(args)
    text = None
    if getattr(args, "file", None):
        from .generate import read_flag_file
        text = read_flag_file("-f", args.file)
    if args.eval_kind == "kl" and args.tokens < 1:
        raise UsageError("--tokens must be at least 1")
    print(f"pykv eval {args.eval_kind}: {cfg.model_name}, results in {cfg.out}/", file=sys.stderr)
    records = evaluate(args.eval_kind, cfg, text=text, kl_tokens=getattr(args, "tokens", 64),
                       decode=getattr(args, "decode", False))
    tables, pictures = write_outputs(records, cfg.out, plots=not args.no_plots)
    print(tables.lstrip("\n"))
    if pictures is None and not args.no_plots:
        print(f"pykv: {PLOT_HINT}", file=sys.stderr)
    elif pictures:
        print(f"pykv eval: {len(pictures)} pictures in {cfg.out}/", file=sys.stderr)
    return EXIT_OK
