"""``pykv serve``: the OpenAI-compatible HTTP server (pykv/server/http.py) on one model."""

from __future__ import annotations

import argparse
import sys

from .main import EXIT_OK, UsageError, add_chat_template_flags, model_path_arg


def add_serve_parser(sub, add_model_flags):
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serve one model at /v1/completions, /v1/chat/completions, /v1/embeddings "
                                   "and /v1/models (llama-server, python -m llama_cpp.server). Requests run one "
                                   "at a time; Ctrl-C stops.")
    add_model_flags(p)
    p.set_defaults(seed=-1)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only). Bound to a loopback address "
                        "or a name, requests whose Host header names another host are refused (DNS rebinding); "
                        "bound to 0.0.0.0 or another address, any Host is taken (see docs/security.md)")
    g.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free one)")
    g.add_argument("-a", "--alias", default=None, metavar="NAME", help="the model's name in responses "
                   "(default: the GGUF's file name)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    g.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. https://app.example; '*' for any) call the server "
                        "(CORS headers, OPTIONS preflight); repeatable. Without it a request carrying an Origin "
                        "header is refused")
    g.add_argument("--max-body", type=_byte_count, default=None, metavar="BYTES",
                   help="largest request body taken, e.g. 4M, 512K (default 4M); larger ones get a 413 unread")
    g.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                   help="longest prompt (a chat's messages, an embedding's input) in characters, refused "
                        "before tokenising (default 1048576)")
    g.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                   help="close a connection that sends or reads nothing for this long (default 30)")
    g.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="connections served at once; more get a 503 (default 32)")
    g.add_argument("--embedding", "--embeddings", action="store_true", help="enable /v1/embeddings")
    g.add_argument("--pooling", choices=["none", "mean", "cls", "last"], default=None,
                   help="pooling of /v1/embeddings (default: the model's, else none, which it refuses)")
    g.add_argument("-v", "--verbose", action="store_true", help="log each request; runtime logging; tracebacks")
    add_chat_template_flags(p)
    p.set_defaults(run="serve")


def _byte_count(text: str) -> int:
    """'4194304', '4M', '512K', '1G' (binary units) as bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        value = int(float(number) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 4M, 512K, 1048576)") from None
    return value


def _limits(args) -> dict:
    """make_server's limits from the flags that were given (the others keep its defaults)."""
    limits = {"cors_origins": args.cors_origin}
    for name in ("max_body", "max_prompt_chars", "idle_timeout", "max_connections"):
        value = getattr(args, name)
        if value is not None:
            if not 0 < value < float("inf"):
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
            limits[name] = value
    return limits


def run_serve(args) -> int:
    from .generate import load_model, parse_policy_args
    from ..server.http import make_server

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {args.port}")
    parse_policy_args(args.policy_arg)
    limits = _limits(args)
    path = model_path_arg(args)
    llm = load_model(args, path, embedding=args.embedding, pooling_type=args.pooling)
    try:
        server = make_server(llm, args.host, args.port, args.alias, args.verbose, args.api_key, **limits)
        host, port = server.server_address[:2]
        host = f"[{host}]" if ":" in host else host   # an IPv6 address in a URL
        print(f"pykv: serving {server.model_name} at http://{host}:{port}/v1 (policy {args.policy}; "
              "Ctrl-C stops)", file=sys.stderr, flush=True)
        try:
            server.serve_forever()
        finally:
            server.server_close()
    finally:
        llm.close()
    return EXIT_OK
