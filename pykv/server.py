"""An OpenAI-compatible HTTP server for one Llama, as llama-cpp-python's `llama_cpp.server`
and llama.cpp's llama-server offer: `pykv serve` or `serve(llm, host, port)`.

    GET  /health, /v1/models
    POST /v1/completions, /v1/chat/completions (with "stream": server-sent events), /v1/embeddings,
         /tokenize, /detokenize (llama-server's)

Only the standard library's http.server: requests are taken on threads but run one at a time
(one context). Request fields are the Llama methods' arguments under their OpenAI names;
unknown fields are ignored, as OpenAI clients send some pykv does not use ("user", ...).
"grammar" (GBNF, both completion endpoints), "response_format" (chat) and llama-server's
"json_schema" (completions) constrain the output; "tools" and "tool_choice" (chat) let the
model call functions, as OpenAI's API does. A bad
field is a 400 with OpenAI's {"error": {...}} body; a client that goes away mid-stream
cancels its generation, and one that goes away while its prompt is evaluated stops that at
the next chunk (a long prompt would otherwise hold the server for its whole length). With an API key, every endpoint but /health wants
`Authorization: Bearer KEY` (401 otherwise).
"""
from __future__ import annotations

import hmac
import json
import select
import socket
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from . import errors
from ._openai import _usage
from .grammar import LlamaGrammar

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "frequency_penalty",
             "presence_penalty", "logit_bias", "seed", "stop", "stream", "mirostat_mode", "mirostat_tau",
             "mirostat_eta", "typical_p")
FIELDS = {
    "/v1/completions": ("prompt",) + _SAMPLING + ("logprobs", "echo", "grammar", "json_schema", "suffix"),
    "/v1/chat/completions": ("messages",) + _SAMPLING + ("logprobs", "top_logprobs", "grammar", "response_format",
                                                         "tools", "tool_choice", "functions", "function_call"),
    "/v1/embeddings": ("input",),
    "/v1/tokenize": ("content", "add_special"),
    "/v1/detokenize": ("tokens",),
}
MAX_BODY = 64 << 20
_NUMBERS = ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty",
            "mirostat_tau", "mirostat_eta", "typical_p")
_INTEGERS = ("max_tokens", "top_k", "seed", "mirostat_mode")


class RequestError(Exception):
    """A request the server refuses: its HTTP status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _arguments(path: str, body: dict) -> dict:
    """The method's keyword arguments from a request body; RequestError for what cannot be."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    required = FIELDS[path][0]
    if required not in body:
        raise RequestError(400, f"'{required}' is required")
    if body.get("n", 1) != 1:
        raise RequestError(400, "only n=1 is supported")
    body = dict(body)
    if "mirostat" in body and "mirostat_mode" not in body:   # llama-server's name
        body["mirostat_mode"] = body["mirostat"]
    kwargs = {k: body[k] for k in FIELDS[path] if k in body and body[k] is not None}
    for name, kinds, what in ((_NUMBERS, (int, float), "a number"), (_INTEGERS, (int,), "an integer")):
        for key in name:
            if key in kwargs and (isinstance(kwargs[key], bool) or not isinstance(kwargs[key], kinds)):
                raise RequestError(400, f"'{key}' must be {what}, got {kwargs[key]!r}")
    if "json_schema" in kwargs:   # llama-server's: JSON that the schema allows
        if "grammar" in kwargs:
            raise RequestError(400, "give 'grammar' or 'json_schema', not both")
        kwargs["grammar"] = LlamaGrammar.from_json_schema(kwargs.pop("json_schema"))
    return kwargs


class _Handler(BaseHTTPRequestHandler):
    server_version = "pykv"
    protocol_version = "HTTP/1.1"

    # the server object carries the model, its lock and the model name (see make_server)
    def log_message(self, fmt, *args):
        if self.server.verbose:
            sys.stderr.write(f"pykv serve: {self.address_string()} {fmt % args}\n")

    def _send_json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str) -> None:
        kind = {401: "authentication_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
        self._send_json(status, {"error": {"message": message, "type": kind, "code": status}})

    def _authorized(self) -> bool:
        """True when no key is set, for /health, or with the right bearer key; else a 401 is sent."""
        key = self.server.api_key
        if not key or self.path == "/health":
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return True
        self._send_error(401, "a valid API key is required (Authorization: Bearer KEY)")
        return False

    def do_GET(self):
        if not self._authorized():
            return
        if self.path == "/health":
            self._send_json(200, {"status": "ok"})
        elif self.path in ("/v1/models", "/models"):
            self._send_json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                               "owned_by": "pykv"}]})
        else:
            self._send_error(404, f"no such endpoint: GET {self.path}")

    def do_POST(self):
        path = self.path if self.path.startswith("/v1/") else "/v1" + self.path   # /completions too
        if not self._authorized():
            self.close_connection = True   # its body was not read
            return
        try:
            raw = self._read_body()
            if path not in FIELDS:
                raise RequestError(404, f"no such endpoint: POST {self.path}")
            if not raw:
                raise RequestError(400, "a JSON body is required")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise RequestError(400, f"the body is not JSON: {exc}") from None
            kwargs = _arguments(path, body)
            options = body.get("stream_options")
            self.include_usage = bool(kwargs.get("stream") and isinstance(options, dict)
                                      and options.get("include_usage"))
            with self.server.lock:
                self._run(path, kwargs)
        except RequestError as exc:
            self._send_error(exc.status, str(exc))
        except (errors.InvalidArgumentError, errors.ContextOverflowError, TypeError, ValueError) as exc:
            self._send_error(400, str(exc))
        except errors.GenerationCancelled:
            self.close_connection = True
            if not _hung_up(self.connection):   # else no one is left to answer
                self._send_error(503, "the generation was cancelled")
        except Exception as exc:  # noqa: BLE001 - the runtime failed: a 500 that says why, never a dropped line
            if self.server.verbose:
                traceback.print_exc()
            self._send_error(500, f"{type(exc).__name__}: {exc}" if not isinstance(exc, errors.PykvError) else str(exc))

    def _read_body(self) -> bytes:
        """The request's body, read whole so that the connection can serve the next request;
        one that cannot be read (a bad or too large Content-Length) closes the connection."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True
            raise RequestError(413 if length > MAX_BODY else 400,
                               f"the body is larger than {MAX_BODY} bytes" if length > MAX_BODY
                               else "the Content-Length header is not a byte count")
        return self.rfile.read(length) if length else b""

    def _run(self, path: str, kwargs: dict) -> None:
        llm = self.server.llm
        if path == "/v1/tokenize":   # special tokens parsed, BOS only when add_special, as llama-server
            if not isinstance(kwargs["content"], str):
                raise RequestError(400, "'content' must be a string")
            self._send_json(200, {"tokens": llm.tokenize(kwargs["content"], add_bos=bool(kwargs.get("add_special")),
                                                         special=True)})
            return
        if path == "/v1/detokenize":
            tokens = kwargs["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise RequestError(400, "'tokens' must be a list of token ids")
            self._send_json(200, {"content": llm.detokenize(tokens).decode("utf-8", "replace")})
            return
        if path == "/v1/embeddings":
            if not llm.embedding:
                raise RequestError(400, "this server was started without --embedding")
            if llm.pooling_type == "none":
                raise RequestError(400, "embeddings need a pooling type other than none (--pooling mean)")
            out = llm.create_embedding(kwargs["input"], model=self.server.model_name)
            self._send_json(200, out)
            return
        kwargs = dict(kwargs, prompt_progress=self._client_waiting)
        if path == "/v1/chat/completions":
            out = llm.create_chat_completion(**kwargs)
        else:
            out = llm.create_completion(**kwargs)
        if not kwargs.get("stream"):
            out["model"] = self.server.model_name
            self._send_json(200, out)
            return
        self._stream(out)

    def _client_waiting(self, _done: int, _total: int) -> bool:
        """Between the chunks of a prompt: False (stop) once the client has hung up."""
        return not _hung_up(self.connection)

    def _event(self, obj) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _stream(self, chunks) -> None:
        """Server-sent events, one chunk each, then [DONE]. The first chunk is taken before the
        headers go out, so a refused request still gets a JSON error."""
        first = next(chunks)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for chunk in _prepend(first, chunks):
                chunk["model"] = self.server.model_name
                self._event(chunk)
            if self.include_usage:   # OpenAI's stream_options: a last chunk with the usage, no choices
                self._event(dict({k: chunk[k] for k in ("id", "object", "created", "model")}, choices=[],
                                 usage=_usage(self.server.llm.last_result)))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            chunks.close()   # the client went away: stop generating
        except Exception as exc:  # noqa: BLE001 - after the headers: an error event ends the stream
            chunks.close()
            self._event({"error": {"message": str(exc), "type": "server_error", "code": 500}})


def _hung_up(sock) -> bool:
    """Whether the peer has closed the connection: readable, with nothing left to read."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def _prepend(first, rest):
    yield first
    yield from rest


def make_server(llm, host: str = "127.0.0.1", port: int = 8080, model_name=None, verbose: bool = False,
                api_key=None):
    """A ThreadingHTTPServer serving llm (not started: call serve_forever(), shutdown())."""
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    server.llm = llm
    server.lock = threading.Lock()
    server.model_name = model_name or Path(llm.model_path).name
    server.verbose = verbose
    server.api_key = api_key
    return server


def serve(llm, host: str = "127.0.0.1", port: int = 8080, model_name=None, verbose: bool = False,
          api_key=None) -> None:
    """Serve llm until interrupted."""
    server = make_server(llm, host, port, model_name, verbose, api_key)
    try:
        server.serve_forever()
    finally:
        server.server_close()
