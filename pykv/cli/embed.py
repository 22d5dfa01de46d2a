"""``pykv embed``: llama.cpp's llama-embedding: the embedding of each text, printed."""

from __future__ import annotations

import json
import sys

import numpy as np

from .main import EXIT_OK, UsageError, model_path_arg


def add_embed_parser(sub, add_model_flags):
    p = sub.add_parser("embed", help="print the embeddings of texts (llama-embedding)",
                       description="Embed each text (the prompt split at --embd-separator): its tokens' hidden "
                                   "states after the output norm, pooled, normalised, printed to stdout.")
    add_model_flags(p)
    p.set_defaults(seed=-1)
    g = p.add_argument_group("texts and output")
    g.add_argument("-p", "--prompt", help="the text(s)")
    g.add_argument("-f", "--file", help="read the text(s) from a file ('-' = stdin)")
    g.add_argument("--embd-separator", default="\n", metavar="STR",
                   help="what separates texts (default a newline); empty texts are skipped")
    g.add_argument("--pooling", choices=["none", "mean", "cls", "last"], default=None,
                   help="how a text's tokens are pooled (default: the model's, else none, as llama.cpp)")
    g.add_argument("--embd-normalize", type=int, default=2, metavar="N",
                   help="-1 none, 0 max absolute (int16 range), 1 taxicab, 2 Euclidean (default), >2 p-norm")
    g.add_argument("--embd-output-format", choices=["", "array", "json"], default="",
                   help="'' readable lines with a cosine similarity matrix (default), 'array' a JSON array, "
                        "'json' OpenAI's embeddings list")
    g.add_argument("-v", "--verbose", action="store_true", help="runtime logging; tracebacks on errors")
    p.set_defaults(run="embed")


def _texts(args) -> list:
    from .generate import model_prompt, read_prompt
    separator = args.embd_separator.replace("\\n", "\n").replace("\\t", "\t")   # as typed in a shell
    text = read_prompt(args)
    texts = [t for t in (text.split(separator) if separator else [text]) if t.strip()]
    if not texts:
        raise UsageError("nothing to embed: the text is empty")
    return [model_prompt(t) for t in texts]


def _short(vector) -> str:
    v = [f"{x:9.6f}" for x in vector]
    return " ".join(v if len(v) <= 6 else v[:3] + ["..."] + v[-3:])


def _print_readable(texts, vectors) -> None:
    from .._embedding import normalized
    for i, vec in enumerate(vectors):
        if vec.ndim == 2:   # no pooling: one line per token
            for j, row in enumerate(vec):
                print(f"embedding {i} token {j}: {_short(row)}")
        else:
            print(f"embedding {i}: {_short(vec)}")
    if len(vectors) > 1 and vectors[0].ndim == 1:
        unit = normalized(np.stack(vectors))
        print("\ncosine similarity matrix:")
        for i, row in enumerate(unit @ unit.T):
            label = texts[i] if isinstance(texts[i], str) else texts[i].decode("utf-8", "replace")
            print(" ".join(f"{x:6.2f}" for x in row) + f"  {label[:40]!r}")


def run_embed(args) -> int:
    from .generate import load_model, parse_policy_args
    from .._embedding import normalized

    texts = _texts(args)
    if args.embd_normalize < -1:
        raise UsageError(f"--embd-normalize must be -1 or more, got {args.embd_normalize}")
    parse_policy_args(args.policy_arg)
    path = model_path_arg(args)
    llm = load_model(args, path, embedding=True, pooling_type=args.pooling)
    try:
        raw, n_tokens = llm.embed(texts, truncate=True, return_count=True)
        vectors = [normalized(np.asarray(v, dtype=np.float32), args.embd_normalize) for v in raw]
        pooling = llm.pooling_type
    finally:
        llm.close()
    if args.embd_output_format == "array":
        print(json.dumps([v.tolist() for v in vectors]))
    elif args.embd_output_format == "json":
        print(json.dumps({"object": "list", "model": str(path), "usage": {"prompt_tokens": n_tokens,
                                                                          "total_tokens": n_tokens},
                          "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                                   for i, v in enumerate(vectors)]}))
    else:
        _print_readable(texts, vectors)
    print(f"pykv: {len(texts)} texts, {n_tokens} tokens, pooling {pooling}, normalize {args.embd_normalize}",
          file=sys.stderr)
    return EXIT_OK
