"""A bounded fuzz and soak of `pykv serve`: the server runs in a subprocess on 127.0.0.1 only,
and a few client threads send it, for a bounded time and a bounded number of requests, a mix of
valid requests (completions, chats, streams, tokenize), mutated ones (fields of the wrong type
or out of range, cut or corrupted JSON, wrong content types, foreign Host and Origin headers,
oversized bodies), clients that hang up mid-stream, idle connections and bursts of connections
above the server's cap. Then it stops by itself and reports.

Every answer must be one the request deserves: a 2xx, a 4xx, or a 503 from the connection cap
or a cancelled generation; a 500, a dropped connection without an answer or no answer within
the client's timeout is a failure. The server must still be up at the end, its thread count
must stay under its connection cap (plus its fixed threads), and its resident memory must not
grow by more than --max-growth-mib between the end of the warm-up and the end.

    python bench/server_soak.py MODEL.gguf [--seconds 60] [--requests 5000] [--clients 8]

Without MODEL, a tiny random-weight model is written to a temporary folder (needs the test
helpers in tests/python). Prints a JSON report; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"   # loopback only: the soak never listens anywhere else
ALLOWED = {200, 204, 400, 401, 403, 404, 408, 411, 413, 415, 503}
CLIENT_TIMEOUT = 60.0


class Server:
    """`pykv serve MODEL` on 127.0.0.1, a free port, with small limits."""

    def __init__(self, model: str, n_ctx: int, max_connections: int, idle_timeout: float):
        self.max_connections = max_connections
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pykv", "serve", model, "--host", HOST, "--port", "0", "-c", str(n_ctx),
             "--max-connections", str(max_connections), "--idle-timeout", str(idle_timeout),
             "--max-body", "256K", "--max-prompt-chars", "4000", "-t", "1"],
            stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()
        if "serving" not in line:
            self.proc.kill()
            raise RuntimeError(f"pykv serve did not start: {line}")
        self.port = int(line.split(f"http://{HOST}:")[1].split("/")[0])
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()   # keep its pipe drained

    def status(self, key: str) -> int:
        """A line of /proc/PID/status as a number (VmRSS in kB, Threads); 0 where there is none."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def exchange(port: int, raw: bytes, timeout: float = CLIENT_TIMEOUT, hang_up_after: int = 0):
    """The status of one raw request's answer; None when the connection ended without one.
    hang_up_after > 0: close after that many bytes of the answer (a client leaving mid-stream)."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        try:
            sock.sendall(raw)
        except OSError:
            pass   # refused before the whole body went: the answer may still be there
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
                if hang_up_after and len(data) >= hang_up_after:
                    break
            if data.startswith(b"HTTP/1.1 ") and not hang_up_after:
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                while length is None or len(body) < length:   # no length: a stream, read to its end
                    chunk = sock.recv(1 << 16)
                    if not chunk:
                        break
                    body += chunk
        except ConnectionResetError:
            if not data:
                return None
        except socket.timeout:
            return "timeout"
    if not data.startswith(b"HTTP/1.1 "):
        return None
    return int(data[9:12])


def request(port: int, path: str, body, content_type="application/json", headers=(), method="POST") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}:{port}"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    lines += list(headers) + [f"Content-Length: {len(data)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def valid_body(rng: random.Random) -> tuple:
    kind = rng.choice(["completion", "chat", "stream", "tokenize"])
    if kind == "completion":
        return "/v1/completions", {"prompt": rng.choice(["the cat", "Hello", "1 2 3"]), "temperature": 0,
                                   "max_tokens": rng.randint(1, 4)}
    if kind == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    if kind == "stream":
        return "/v1/completions", {"prompt": "the dog", "max_tokens": 3, "stream": True}
    return "/tokenize", {"content": "the cat and the dog"}


WEIRD = [None, True, -1, -5, 0, 1 << 70, -(1 << 70), 1e30, -1e30, 1.5, "5", "", "x" * 5000, [], [1, "a"], {},
         {"a": {"b": [1, 2]}}, [[[[[[[[]]]]]]]], [-1], ["a", "b"], 2 ** 31, 65536]
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
          "logit_bias", "logprobs", "top_logprobs", "echo", "grammar", "json_schema", "response_format", "tools",
          "tool_choice", "mirostat_mode", "typical_p", "n", "suffix", "stream_options", "content", "tokens"]


def mutated(rng: random.Random, port: int) -> bytes:
    """A valid request changed in one way."""
    path, body = valid_body(rng)
    how = rng.randrange(10)
    if how <= 3:
        body[rng.choice(FIELDS)] = rng.choice(WEIRD)
        if "max_tokens" in body and isinstance(body["max_tokens"], int) and not 0 < body["max_tokens"] <= 8:
            body["max_tokens"] = 4   # keep the run short: out-of-range values are in the corpus
        return request(port, path, body)
    data = json.dumps(body).encode()
    if how == 4:
        return request(port, path, data[:rng.randrange(len(data))])
    if how == 5:
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        return request(port, path, bytes(flipped))
    if how == 6:
        content_type = rng.choice(["text/plain", None, "application/x-www-form-urlencoded"])
        return request(port, path, data, content_type=content_type)
    if how == 7:
        return request(port, path, data, headers=[rng.choice(["Origin: https://evil.example", "Origin: null"])])
    if how == 8:
        raw = request(port, path, data)
        return raw.replace(f"Host: {HOST}:{port}".encode(), b"Host: evil.example")
    depth = rng.choice([50, 500, 50000])
    return request(port, path, b'{"prompt": "x", "stop": ' + b"[" * depth + b"]" * depth + b"}")


class Soak:
    def __init__(self, server: Server, seconds: float, max_requests: int, seed: int):
        self.server = server
        self.deadline = time.monotonic() + seconds
        self.max_requests = max_requests
        self.seed = seed
        self.lock = threading.Lock()
        self.count = 0
        self.statuses = {}
        self.failures = []
        self.max_threads = 0

    def take(self) -> bool:
        with self.lock:
            if self.count >= self.max_requests or time.monotonic() >= self.deadline:
                return False
            self.count += 1
            return True

    def record(self, what: str, status) -> None:
        with self.lock:
            self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
            if status not in ALLOWED:
                self.failures.append(f"{what}: {status}")
            self.max_threads = max(self.max_threads, self.server.status("Threads"))

    def client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        port = self.server.port
        while self.take():
            action = rng.random()
            try:
                if action < 0.35:
                    path, body = valid_body(rng)
                    status = exchange(port, request(port, path, body))
                    self.record(f"valid {path}", status)
                    if status not in (200, 503):
                        self.failures.append(f"valid {path} {body}: {status}")
                elif action < 0.85:
                    raw = mutated(rng, port)
                    self.record(f"mutated {raw[:80]!r}", exchange(port, raw))
                elif action < 0.90:
                    status = exchange(port, request(port, "/v1/completions", {"prompt": "the cat", "max_tokens": 64,
                                                                             "stream": True}), hang_up_after=1)
                    self.record("hang-up mid-stream", status if status is not None else 200)
                elif action < 0.95:
                    self.burst(rng)
                else:
                    with socket.create_connection((HOST, port), timeout=CLIENT_TIMEOUT) as sock:
                        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                     b"Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
                        time.sleep(rng.uniform(0, 0.3))   # a slow client, then gone
                    self.record("slow client", 200)
            except OSError as exc:
                self.record(f"action {action:.2f}", f"{type(exc).__name__}: {exc}")

    def burst(self, rng: random.Random) -> None:
        """More connections at once than the cap: each gets an answer (most a 503)."""
        port = self.server.port
        socks = [socket.create_connection((HOST, port), timeout=CLIENT_TIMEOUT)
                 for _ in range(self.server.max_connections + rng.randint(1, 8))]
        try:
            for sock in socks:
                sock.sendall(f"GET /health HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
            for sock in socks:
                data = sock.recv(64)
                self.record("burst", int(data[9:12]) if data.startswith(b"HTTP/1.1 ") else None)
        finally:
            for sock in socks:
                sock.close()


def soak(model: str, seconds: float = 60, max_requests: int = 5000, clients: int = 8, seed: int = 0,
         n_ctx: int = 256, max_connections: int = 16, idle_timeout: float = 2.0,
         max_growth_mib: float = 64.0) -> dict:
    """Run the soak and return its report (failures: what went wrong, empty when nothing did)."""
    server = Server(model, n_ctx, max_connections, idle_timeout)
    try:
        for _ in range(5):   # warm-up: the allocator's and the thread pool's first use
            exchange(server.port, request(server.port, "/v1/completions", {"prompt": "the cat", "max_tokens": 4}))
        base_threads = server.status("Threads")
        rss_before = server.status("VmRSS")
        run = Soak(server, seconds, max_requests, seed)
        threads = [threading.Thread(target=run.client, args=(i,), daemon=True) for i in range(clients)]
        began = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 2 * CLIENT_TIMEOUT)
        elapsed = time.monotonic() - began
        if any(t.is_alive() for t in threads):
            run.failures.append("a client did not finish")
        time.sleep(idle_timeout + 0.5)   # idle connections closed, refused ones let go
        alive = server.proc.poll() is None
        healthy = alive and exchange(server.port, f"GET /health HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode(), 10) == 200
        rss_after = server.status("VmRSS")
        thread_cap = base_threads + max_connections + 1   # each connection's thread and the lingering one
        growth = (rss_after - rss_before) / 1024
        if not healthy:
            run.failures.append(f"the server is {'not answering' if alive else f'gone ({server.proc.returncode})'}")
        if run.max_threads > thread_cap:
            run.failures.append(f"{run.max_threads} threads, more than the cap's {thread_cap}")
        if growth > max_growth_mib:
            run.failures.append(f"resident memory grew {growth:.1f} MiB")
        return {"requests": run.count, "seconds": round(elapsed, 1), "clients": clients, "seed": seed,
                "statuses": dict(sorted(run.statuses.items())), "failures": run.failures,
                "server_alive": healthy, "max_threads": run.max_threads, "thread_cap": thread_cap,
                "rss_mib_before": round(rss_before / 1024, 1), "rss_mib_after": round(rss_after / 1024, 1)}
    finally:
        server.stop()


def _tiny_model(folder: str) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
    import _tiny_models
    return str(_tiny_models.write_tiny_gguf(_tiny_models.variant(_tiny_models.DEFAULT_VARIANT),
                                            Path(folder) / "tiny.gguf"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="a GGUF (default: a tiny random-weight model)")
    p.add_argument("--seconds", type=float, default=60, help="how long at most (default 60)")
    p.add_argument("--requests", type=int, default=5000, help="how many requests at most (default 5000)")
    p.add_argument("--clients", type=int, default=8, help="client threads (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-c", "--ctx-size", type=int, default=256, help="the server's n_ctx (default 256)")
    p.add_argument("--max-connections", type=int, default=16, help="the server's cap (default 16)")
    p.add_argument("--max-growth-mib", type=float, default=64.0, help="resident memory growth allowed (default 64)")
    args = p.parse_args(argv)
    if not 0 < args.seconds <= 3600 or not 0 < args.requests <= 10 ** 6:
        p.error("--seconds must be in (0, 3600] and --requests in (0, 1e6]: the soak is bounded")
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or _tiny_model(folder)
        report = soak(model, args.seconds, args.requests, args.clients, args.seed, args.ctx_size,
                      args.max_connections, max_growth_mib=args.max_growth_mib)
    print(json.dumps(report, indent=1))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
