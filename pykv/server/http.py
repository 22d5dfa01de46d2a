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
model call functions, as OpenAI's API does. Every field is checked before any work
(request_fields.py): a bad one is a 400 naming it, with OpenAI's {"error": {...}} body. A
client that goes away mid-stream cancels its generation, and one that goes away while its
prompt is evaluated stops that at the next chunk (a long prompt would otherwise hold the
server for its whole length). With an API key, every endpoint but /health wants
`Authorization: Bearer KEY` (401 otherwise).

What a web page in the user's browser could otherwise do to a local server is refused (see
docs/security.md): bodies must be `Content-Type: application/json` (415), a request with an
`Origin` header is refused (403) unless that origin was allowed (cors_origins, `--cors-origin`,
which also answers the browsers' OPTIONS preflight), and on a server bound to a loopback
address or to a name, a `Host` header naming another host (DNS rebinding) is refused (403).
Bodies larger than max_body get a 413 before they are read, prompts longer than
max_prompt_chars a 400 before they are tokenised; a connection idle for idle_timeout seconds
is closed, and above max_connections at once new ones get a 503.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import select
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .. import errors
from .openai import _usage
from .request_fields import FIELDS, MAX_DEPTH, RequestError, nesting_depth_exceeds, request_arguments

__all__ = ["make_server", "serve", "RequestError", "FIELDS"]

DEFAULT_MAX_BODY = 4 << 20            # bytes of a request body
DEFAULT_MAX_PROMPT_CHARS = 1 << 20    # characters of a prompt, of a chat's messages, of an embedding's input
DEFAULT_IDLE_TIMEOUT = 30.0           # seconds a connection may wait between reads (or writes)
DEFAULT_MAX_CONNECTIONS = 32          # connections served at once
_LINGER_SECONDS = 2.0                 # reading what a refused client still sends, so it gets the answer
_LINGER_BYTES = 64 << 20


def _hostname(host_header: str) -> str:
    """The host part of a Host header ("[::1]:8080" -> "::1"), lowercased, no trailing dot."""
    host = host_header.strip()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.lower().rstrip(".")


def _ip(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def _local_name(name: str) -> bool:
    return name == "localhost" or name.endswith(".localhost")


class HostCheck:
    """Which Host headers a server bound to `bound` answers, against DNS rebinding (a web page's
    own name re-pointed at this machine, so that the browser lets it read the answers).
    Bound to a loopback address or to "localhost": loopback addresses and localhost names only.
    Bound to another name: that name, localhost names and any address (an address cannot be
    re-pointed). Bound to an address that is not loopback (0.0.0.0, a LAN address): any Host,
    as the server is then meant to be reached under names it cannot know."""

    def __init__(self, bound: str):
        name = _hostname(bound) if bound else "0.0.0.0"
        ip = _ip(name)
        self.bound = name
        self.loopback = (ip is not None and ip.is_loopback) or _local_name(name)
        self.restricted = self.loopback or ip is None

    def allows(self, host_header) -> bool:
        if not self.restricted or host_header is None:   # no Host: no browser sent it
            return True
        name = _hostname(host_header)
        ip = _ip(name)
        if self.loopback:
            return _local_name(name) or (ip is not None and ip.is_loopback) or name == self.bound
        return name == self.bound or _local_name(name) or ip is not None


def _origin_key(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


class _Handler(BaseHTTPRequestHandler):
    server_version = "pykv"
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"   # a request line that cannot be read still gets a status line

    # the server object carries the model, its lock, the model name and the limits (see make_server)
    def setup(self):
        self.timeout = self.server.idle_timeout   # StreamRequestHandler.setup sets it on the socket
        self.unread_body = False
        self.cors_origin = None
        super().setup()

    def log_message(self, fmt, *args):
        if self.server.verbose:
            sys.stderr.write(f"pykv serve: {self.address_string()} {fmt % args}\n")

    def end_headers(self):
        if self.cors_origin is not None:
            self.send_header("Access-Control-Allow-Origin", self.cors_origin)
            self.send_header("Vary", "Origin")
        super().end_headers()

    def _send_json(self, status: int, obj, headers=()) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str, headers=()) -> None:
        kind = {401: "authentication_error", 403: "permission_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        self._send_json(status, {"error": {"message": message, "type": kind, "code": status}}, headers)

    # ---- what is checked before a request is read ----

    def _admitted(self) -> bool:
        """Host, Origin and API key; False when refused (the answer is sent)."""
        self.cors_origin = None
        host = self.headers.get("Host")
        if not self.server.host_check.allows(host):
            self._refuse(403, f"the Host header {host!r} is not this server's: it answers to "
                              f"{self.server.host_check.bound} and localhost names (a page reaching it through "
                              "another name is refused, against DNS rebinding)")
            return False
        origin = self.headers.get("Origin")
        if origin is not None:
            allowed = self.server.cors_origins
            if "*" not in allowed and _origin_key(origin) not in allowed:
                self._refuse(403, f"requests from web pages are refused (Origin: {origin}); pykv serve "
                                  "--cors-origin ORIGIN allows one origin")
                return False
            self.cors_origin = origin
        if self.command == "OPTIONS" or self._authorized():
            return True
        self._refuse(401, "a valid API key is required (Authorization: Bearer KEY)")
        return False

    def _authorized(self) -> bool:
        """True when no key is set, for /health, or with the right bearer key."""
        key = self.server.api_key
        if not key or self.path == "/health":
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

    def _refuse(self, status: int, message: str, headers=()) -> None:
        """An error answer to a request whose body, if any, is not read: the connection closes
        after it (reading what the client still sends for a while, so that it gets the answer)."""
        self.close_connection = True
        self.unread_body = self.command == "POST" or bool(self.headers.get("Content-Length"))
        self._send_error(status, message, headers)

    def _body_length(self) -> int:
        """The body's byte count from Content-Length; RequestError (413, 411, 400) when it
        cannot be read: too large for max_body, chunked, or no byte count."""
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(411, "a body needs a Content-Length (chunked bodies are not taken)")
        text = self.headers.get("Content-Length") or "0"
        if not text.strip().isdigit():
            raise RequestError(400, "the Content-Length header is not a byte count")
        length = int(text)
        if length > self.server.max_body:
            raise RequestError(413, f"the body has {length} bytes, more than this server takes "
                                    f"({self.server.max_body}; pykv serve --max-body)")
        return length

    def handle_expect_100(self):
        """Expect: 100-continue (curl's, for large bodies): a body the server will refuse is
        refused before the client sends it."""
        try:
            self._body_length()
        except RequestError:
            return True   # no 100 Continue: do_POST answers 413 and the client keeps its body
        return super().handle_expect_100()

    def _discard_body(self) -> None:
        """Read and drop the body of a request refused after its headers, so that the
        connection can serve the next request."""
        try:
            left = self._body_length()
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
        except (RequestError, OSError):
            self.close_connection = True

    def _read_body(self, length: int) -> bytes:
        try:
            data = self.rfile.read(length) if length else b""
        except OSError:   # the idle timeout, or the client went away
            data = None
        if data is None or len(data) != length:
            self.close_connection = True
            raise RequestError(408, "the body did not arrive in time")
        return data

    # ---- methods ----

    def do_OPTIONS(self):
        """A CORS preflight: allowed for --cors-origin's origins (the headers a browser wants
        before sending a JSON POST), refused for others; without Origin, what is allowed."""
        if not self._admitted():
            return
        self._discard_body()
        self.send_response(204)
        if self.cors_origin is not None:
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
            self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Allow", "GET, POST, OPTIONS")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        if not self._admitted():
            return
        self._discard_body()
        if self.path == "/health":
            self._send_json(200, {"status": "ok"})
        elif self.path in ("/v1/models", "/models"):
            self._send_json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                               "owned_by": "pykv"}]})
        else:
            self._send_error(404, f"no such endpoint: GET {self.path}")

    def do_POST(self):
        path = self.path if self.path.startswith("/v1/") else "/v1" + self.path   # /completions too
        if not self._admitted():
            return
        try:
            length = self._body_length()
        except RequestError as exc:
            self._refuse(exc.status, str(exc))
            return
        if path not in FIELDS:
            self._discard_body()
            self._send_error(404, f"no such endpoint: POST {self.path}")
            return
        media_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            self._discard_body()
            self._send_error(415, f"the body must be JSON sent as Content-Type: application/json, not "
                                  f"{media_type or 'no Content-Type'} (curl: -H 'Content-Type: application/json')")
            return
        try:
            raw = self._read_body(length)
            if not raw:
                raise RequestError(400, "a JSON body is required")
            body = _parse_json(raw)
            kwargs = request_arguments(path, body, self.server.max_prompt_chars, self.server.n_ctx)
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

    def finish(self):
        try:
            super().finish()
        finally:
            if self.unread_body:
                _linger(self.connection)

    def _run(self, path: str, kwargs: dict) -> None:
        llm = self.server.llm
        if path == "/v1/tokenize":   # special tokens parsed, BOS only when add_special, as llama-server
            self._send_json(200, {"tokens": llm.tokenize(kwargs["content"], add_bos=bool(kwargs.get("add_special")),
                                                         special=True)})
            return
        if path == "/v1/detokenize":
            self._send_json(200, {"content": llm.detokenize(kwargs["tokens"]).decode("utf-8", "replace")})
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
        except OSError:   # the client went away, or stopped reading for the idle timeout: stop generating
            chunks.close()
        except Exception as exc:  # noqa: BLE001 - after the headers: an error event ends the stream
            chunks.close()
            try:
                self._event({"error": {"message": str(exc), "type": "server_error", "code": 500}})
            except OSError:
                pass


def _refuse_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _parse_json(raw: bytes):
    """The body as JSON: RequestError (400) for text that is not JSON, NaN and Infinity
    (Python's extension), or nesting deeper than MAX_DEPTH levels."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise RequestError(400, f"the body nests arrays and objects deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise RequestError(400, f"the body is not JSON: {exc}") from None
    if nesting_depth_exceeds(body):
        raise RequestError(400, f"the body nests arrays and objects deeper than {MAX_DEPTH} levels")
    return body


def _hung_up(sock) -> bool:
    """Whether the peer has closed the connection: readable, with nothing left to read."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def _linger(sock, seconds: float = _LINGER_SECONDS, limit: int = _LINGER_BYTES) -> None:
    """Before closing a connection whose request was not read whole: stop writing, then read and
    drop what the client still sends (for a while, up to a bound), so that closing does not
    reset the connection and lose the answer the client has not read yet."""
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + seconds
        while limit > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            data = sock.recv(1 << 16)
            if not data:
                break
            limit -= len(data)
    except OSError:
        pass


def _prepend(first, rest):
    yield first
    yield from rest


class _Server(ThreadingHTTPServer):
    """One thread per connection, at most max_connections at once: a connection above that gets
    a 503 from the accepting thread and is handed to one lingering thread (_Refused), without
    a thread of its own."""
    daemon_threads = True
    request_queue_size = 128   # the listen backlog (socketserver's 5 makes bursts of clients wait seconds)

    def __init__(self, address, max_connections: int):
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        self.refused = _Refused()
        if ":" in address[0]:   # an IPv6 address such as ::1 or ::
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.refused.add(request, self.max_connections)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def server_close(self):
        super().server_close()
        self.refused.stop()


class _Refused:
    """The connections refused for the cap: each gets its 503 at once, then one thread reads
    and drops what they send (a bounded while, a bounded number of them) before closing them,
    so that closing does not reset a connection whose client has not read its 503 yet."""
    MAX_HELD = 256

    def __init__(self):
        self.lock = threading.Lock()
        self.held = {}   # socket -> deadline
        self.thread = None
        self.stopped = False

    def add(self, sock, max_connections: int) -> None:
        body = json.dumps({"error": {"message": f"the server is busy: {max_connections} connections are open "
                                                "(pykv serve --max-connections)", "type": "server_error",
                                     "code": 503}}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            sock.setblocking(False)
            sock.send(head + body)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        with self.lock:
            if self.stopped or len(self.held) >= self.MAX_HELD:
                sock.close()
                return
            self.held[sock] = time.monotonic() + _LINGER_SECONDS
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="pykv-refused", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.held:
                    self.thread = None
                    return
                socks = list(self.held)
            try:
                readable, _, _ = select.select(socks, [], [], 0.1)
            except (OSError, ValueError):   # a descriptor select cannot take: try each in turn
                time.sleep(0.05)
                readable = socks
            now = time.monotonic()
            for sock in socks:
                with self.lock:
                    deadline = self.held.get(sock)
                if deadline is None:   # stop() closed it
                    continue
                done = deadline <= now
                if sock in readable and not done:
                    try:
                        done = not sock.recv(1 << 16)
                    except BlockingIOError:
                        pass
                    except OSError:
                        done = True
                if done:
                    with self.lock:
                        self.held.pop(sock, None)
                    sock.close()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            for sock in self.held:
                sock.close()
            self.held.clear()


def _positive(name: str, value, kind=int):
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) \
            or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive {'number' if kind is float else 'integer'}, got {value!r}")
    return value


def make_server(llm, host: str = "127.0.0.1", port: int = 8080, model_name=None, verbose: bool = False,
                api_key=None, *, cors_origins=(), max_body: int = DEFAULT_MAX_BODY,
                max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS, idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                max_connections: int = DEFAULT_MAX_CONNECTIONS):
    """A ThreadingHTTPServer serving llm (not started: call serve_forever(), shutdown()).
    cors_origins: the web origins ("https://app.example", "*" for any) whose pages may call
    it; max_body: bytes of a request body; max_prompt_chars: characters of a prompt (of a
    chat's messages, of an embedding's input); idle_timeout: seconds a connection may stay
    idle; max_connections: connections served at once."""
    _positive("max_body", max_body)
    _positive("max_prompt_chars", max_prompt_chars)
    _positive("idle_timeout", idle_timeout, float)
    _positive("max_connections", max_connections)
    if isinstance(cors_origins, str):
        cors_origins = (cors_origins,)
    server = _Server((host, port), max_connections)
    server.llm = llm
    server.n_ctx = int(llm.n_ctx)   # fixed with the context: read once, not beside a running request
    server.lock = threading.Lock()
    server.model_name = model_name or Path(llm.model_path).name
    server.verbose = verbose
    server.api_key = api_key
    server.host_check = HostCheck(host)
    server.cors_origins = {_origin_key(o) if o != "*" else "*" for o in cors_origins}
    server.max_body = max_body
    server.max_prompt_chars = max_prompt_chars
    server.idle_timeout = float(idle_timeout)
    return server


def serve(llm, host: str = "127.0.0.1", port: int = 8080, model_name=None, verbose: bool = False,
          api_key=None, **limits) -> None:
    """Serve llm until interrupted (limits: make_server's keywords)."""
    server = make_server(llm, host, port, model_name, verbose, api_key, **limits)
    try:
        server.serve_forever()
    finally:
        server.server_close()
