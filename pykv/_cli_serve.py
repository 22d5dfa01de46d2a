"""``pykv serve``: the OpenAI-compatible HTTP server (pykv/server.py) on one model."""

from __future__ import annotations

import sys

from .cli import EXIT_OK, UsageError, add_chat_template_flags, model_path_arg


def add_serve_parser(sub, add_model_flags):
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serve one model at /v1/completions, /v1/chat/completions, /v1/embeddings "
                                   "and /v1/models (llama-server, python -m llama_cpp.server). Requests run one "
                                   "at a time; Ctrl-C stops.")
    add_model_flags(p)
    p.set_defaults(seed=-1)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free one)")
    g.add_argument("-a", "--alias", default=None, metavar="NAME", help="the model's name in responses "
                   "(default: the GGUF's file name)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    g.add_argument("--embedding", "--embeddings", action="store_true", help="enable /v1/embeddings")
    g.add_argument("--pooling", choices=["none", "mean", "cls", "last"], default=None,
                   help="pooling of /v1/embeddings (default: the model's, else none, which it refuses)")
    g.add_argument("-v", "--verbose", action="store_true", help="log each request; runtime logging; tracebacks")
    add_chat_template_flags(p)
    p.set_defaults(run="serve")


def run_serve(args) -> int:
    from ._cli_generate import load_model, parse_policy_args
    from .server import make_server

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {args.port}")
    parse_policy_args(args.policy_arg)
    path = model_path_arg(args)
    llm = load_model(args, path, embedding=args.embedding, pooling_type=args.pooling)
    try:
        server = make_server(llm, args.host, args.port, args.alias, args.verbose, args.api_key)
        host, port = server.server_address[:2]
        print(f"pykv: serving {server.model_name} at http://{host}:{port}/v1 (policy {args.policy}; "
              "Ctrl-C stops)", file=sys.stderr, flush=True)
        try:
            server.serve_forever()
        finally:
            server.server_close()
    finally:
        llm.close()
    return EXIT_OK
