"""The OpenAI-compatible HTTP server (`pykv serve`, http.py) and what it shares with Llama:
the OpenAI response shapes (openai.py), tool calls (tools.py), fill-in-the-middle prompts
(fim.py) and the checks of request fields (request_fields.py)."""
from .http import HostCheck, make_server, serve

__all__ = ["HostCheck", "make_server", "serve"]
