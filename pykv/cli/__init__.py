"""The ``pykv`` command: the parser and exit codes in main.py, one module per subcommand
(generate, chat, perplexity, embed, serve, info, bench; pull and convert are in main.py)."""
from .main import KV_CACHE_TYPES, UsageError, build_parser, main

__all__ = ["KV_CACHE_TYPES", "UsageError", "build_parser", "main"]
