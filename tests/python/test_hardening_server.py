"""The server against hostile and careless clients: the corpus of bad HTTP requests in
tests/corpus/http/ is sent to `pykv serve` (in a subprocess, so that a crash fails the case
instead of pytest) and each answer is checked, then the limits that no single request shows
(idle timeout, connection cap, bodies refused unread, prompts refused before tokenising) and a
short bounded soak (bench/server_soak.py).

A corpus file is one request: `# ` lines first (a note; `# expect: STATUS [text the answer
contains]`; `# header: Name: value` that the answer must carry, `# header: !Name` one it must
not; `# server: cors|key` to send it to a server started with --cors-origin https://app.example
or --api-key s3cret), then the request line and headers, a blank line and the body. Lines end
in CRLF when sent; `Content-Length: auto` is the body's length; `@@port@@` is the server's port
and `@@repeat N:TEXT@@` is TEXT N times."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pykv import Llama
from pykv.server.request_fields import RequestError, request_arguments
from pykv.server import HostCheck, make_server

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "corpus" / "http"
TIMEOUT = 30
SERVERS = {"default": [], "cors": ["--cors-origin", "https://app.example"], "key": ["--api-key", "s3cret"]}
LIMITS = ["-c", "256", "--max-body", "1M", "--max-prompt-chars", "20000", "--idle-timeout", "10"]


# ---- the corpus ----

class Case:
    def __init__(self, path: Path):
        self.name = path.stem
        lines = path.read_bytes().decode("utf-8", "surrogateescape").split("\n")
        first = next(i for i, line in enumerate(lines) if not line.startswith("#"))
        meta, self.template = lines[:first], "\n".join(lines[first:])
        self.expect_status, self.expect_text, self.headers, self.server = None, "", [], "default"
        for line in meta:
            key, _, value = line[2:].partition(": ")
            if key == "expect":
                status, _, self.expect_text = value.partition(" ")
                self.expect_status = int(status)
            elif key == "header":
                self.headers.append(value)
            elif key == "server":
                self.server = value
        assert self.expect_status is not None, f"{path.name} has no '# expect:' line"

    def request(self, port: int) -> bytes:
        text = re.sub(r"@@repeat (\d+):(.*?)@@", lambda m: m.group(2) * int(m.group(1)), self.template, flags=re.S)
        text = text.replace("@@port@@", str(port))
        head, _, body = text.partition("\n\n")
        raw_body = (body[:-1] if body.endswith("\n") else body).encode("utf-8", "surrogateescape")
        lines = [f"Content-Length: {len(raw_body)}" if line == "Content-Length: auto" else line
                 for line in head.rstrip("\n").split("\n")]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + raw_body


CASES = sorted(CORPUS.glob("*.http"))


def exchange(port: int, raw: bytes, timeout: float = TIMEOUT):
    """(status, {header name lowercased: value}, body text) of one raw request."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(raw)
        except OSError:   # refused before the whole body was sent: the answer is still there to read
            pass
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        assert lines and lines[0].startswith("HTTP/1."), f"no HTTP answer: {data[:200]!r}"
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        want = int(headers.get("content-length", -1))
        while want < 0 or len(body) < want:
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                break
            if not chunk:
                break
            body += chunk
    return status, headers, body.decode("utf-8", "replace")


class Servers:
    """`pykv serve` on the tiny model, one per configuration, started when first asked for and
    again after a case that failed (a server left busy or dead must not fail the cases after)."""

    def __init__(self, model):
        self.model = model
        self.running = {}

    def get(self, name: str):
        """(port, process) of the server for configuration name."""
        if name not in self.running:
            proc = subprocess.Popen([sys.executable, "-m", "pykv", "serve", str(self.model), "--port", "0",
                                     *LIMITS, *SERVERS[name]], stderr=subprocess.PIPE, text=True)
            line = proc.stderr.readline()
            if "serving" not in line:
                proc.kill()
                pytest.fail(f"pykv serve did not start: {line}")
            threading.Thread(target=proc.stderr.read, daemon=True).start()   # keep its pipe drained
            self.running[name] = (int(line.split("http://127.0.0.1:")[1].split("/")[0]), proc)
        return self.running[name]

    def discard(self, name: str) -> None:
        _, proc = self.running.pop(name)
        proc.kill()
        proc.wait(TIMEOUT)

    def stop(self) -> None:
        for name in list(self.running):
            self.discard(name)


@pytest.fixture(scope="module")
def servers(tiny_model):
    running = Servers(tiny_model())
    try:
        yield running
    finally:
        running.stop()


def _healthy(port: int) -> bool:
    status, _, body = exchange(port, f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    return status == 200 and json.loads(body) == {"status": "ok"}


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_corpus(servers, path):
    case = Case(path)
    port, proc = servers.get(case.server)
    try:
        check_answer(case, *exchange(port, case.request(port)))
        assert proc.poll() is None, f"the server exited ({proc.returncode}) on {case.name}"
        assert _healthy(port)
    except BaseException:
        servers.discard(case.server)
        raise


def check_answer(case: Case, status: int, headers: dict, body: str) -> None:
    assert status == case.expect_status, (status, body[:300])
    assert case.expect_text in body, body[:300]
    if status >= 400 and headers.get("content-type") == "application/json":
        error = json.loads(body)["error"]
        assert error["code"] == status and error["type"] and error["message"]
    for want in case.headers:
        if want.startswith("!"):
            assert want[1:].lower() not in headers, headers
        else:
            name, _, value = want.partition(": ")
            assert headers.get(name.lower()) == value, headers


def test_the_corpus_covers_every_refusal():
    statuses = {Case(p).expect_status for p in CASES}
    assert {200, 204, 400, 401, 403, 404, 411, 413, 415, 501}.issubset(statuses), statuses


# ---- limits no single request shows ----

@pytest.fixture
def start(tiny_model):
    """start(**make_server keywords) -> (port, llm, server): an in-process server on the tiny model."""
    made = []

    def run(**limits):
        llm = Llama(str(tiny_model()), n_ctx=256)
        server = make_server(llm, "127.0.0.1", 0, model_name="tiny", **limits)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        made.append((llm, server, thread))
        return server.server_address[1], llm, server
    yield run
    for llm, server, thread in made:
        server.shutdown()
        server.server_close()
        thread.join(TIMEOUT)
        llm.close()


def post(port: int, body: bytes, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers=headers or {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_an_idle_connection_is_closed(start):
    port, _, _ = start(idle_timeout=0.5)
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        began = time.monotonic()
        assert sock.recv(100) == b""   # closed by the server, nothing sent
        assert time.monotonic() - began < 10
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:   # a body that stops coming
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer


def test_connections_above_the_cap_get_a_503_and_no_thread(start):
    port, _, _ = start(max_connections=4, idle_timeout=20)
    base = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) for _ in range(4)]
    try:
        deadline = time.monotonic() + TIMEOUT
        while threading.active_count() < base + 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        more = [socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) for _ in range(60)]
        answers = [s.recv(4096) for s in more]
        assert all(a.startswith(b"HTTP/1.1 503") and b"--max-connections" in a for a in answers), answers[0]
        assert threading.active_count() <= base + 4 + 1   # 64 clients: 4 threads and the one lingering thread
        for s in more:
            s.close()
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:   # the slots come back as the idle connections end
        status, _ = post(port, b'{"prompt": "the cat", "max_tokens": 1}')
        if status == 200:
            break
        time.sleep(0.05)
    assert status == 200


def test_a_body_above_the_limit_gets_its_413_while_it_is_being_sent(start):
    """urllib sends the whole body before it reads: the server reads and drops it for a while
    after its 413, so that the client gets the answer instead of a reset connection."""
    port, _, _ = start(max_body=1 << 20)
    body = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    status, got = post(port, body)
    assert status == 413 and "--max-body" in got["error"]["message"]
    within = json.dumps({"prompt": "the cat", "max_tokens": 1, "user": "x" * ((1 << 20) - 100)}).encode()
    assert len(within) <= 1 << 20 and post(port, within)[0] == 200
    assert _healthy(port)


def test_a_long_prompt_is_refused_before_it_is_tokenised(start, monkeypatch):
    port, llm, _ = start(max_prompt_chars=1000)
    calls = []
    real = llm.tokenize
    monkeypatch.setattr(llm, "tokenize", lambda *a, **k: calls.append(1) or real(*a, **k))
    status, got = post(port, json.dumps({"prompt": "a" * 1001}).encode())
    assert status == 400 and "--max-prompt-chars" in got["error"]["message"] and calls == []
    status, got = post(port, json.dumps({"prompt": "the cat " * 20, "max_tokens": 1}).encode())
    assert status == 200 and calls   # within the limit: served


def test_max_tokens_above_the_context_is_cut_to_it():
    for given, want in ((1 << 70, 256), (257, 256), (256, 256), (5, 5), (0, 0), (-1, -1)):
        assert request_arguments("/v1/completions", {"prompt": "x", "max_tokens": given}, 100, 256)[
            "max_tokens"] == want
    for bad in (-2, -5, -(1 << 70)):
        with pytest.raises(RequestError, match="'max_tokens' must be -1"):
            request_arguments("/v1/completions", {"prompt": "x", "max_tokens": bad}, 100, 256)


@pytest.mark.parametrize("bound,host,allowed", [
    ("127.0.0.1", "127.0.0.1:8080", True), ("127.0.0.1", "localhost:8080", True), ("127.0.0.1", "LocalHost.", True),
    ("127.0.0.1", "[::1]:8080", True), ("127.0.0.1", "127.0.0.2", True), ("127.0.0.1", "app.localhost", True),
    ("127.0.0.1", "evil.example", False), ("127.0.0.1", "evil.example:8080", False), ("127.0.0.1", "10.0.0.1", False),
    ("127.0.0.1", "127.0.0.1.evil.example", False), ("127.0.0.1", "", False), ("127.0.0.1", None, True),
    ("localhost", "evil.example", False), ("localhost", "localhost:1", True), ("::1", "[::1]", True),
    ("box.lan", "box.lan:8080", True), ("box.lan", "BOX.LAN", True), ("box.lan", "192.168.1.5:8080", True),
    ("box.lan", "evil.example", False), ("box.lan", "box.lan.evil.example", False),
    ("0.0.0.0", "evil.example", True), ("192.168.1.5", "anything.example", True), ("", "evil.example", True),
])
def test_host_check(bound, host, allowed):
    assert HostCheck(bound).allows(host) is allowed


def test_ipv6_loopback(start, tiny_model):
    """Bound to ::1 the server listens on IPv6 and checks Host as on 127.0.0.1."""
    with Llama(str(tiny_model()), n_ctx=32) as llm:
        try:
            server = make_server(llm, "::1", 0)
        except OSError:
            pytest.skip("no IPv6 loopback here")
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            port = server.server_address[1]
            for host, want in ((f"[::1]:{port}", 200), ("evil.example", 403)):
                conn = http.client.HTTPConnection("::1", port, timeout=TIMEOUT)
                conn.putrequest("GET", "/health", skip_host=True)
                conn.putheader("Host", host)
                conn.endheaders()
                assert conn.getresponse().status == want, host
                conn.close()
        finally:
            server.shutdown()
            server.server_close()
            thread.join(TIMEOUT)


def test_make_server_refuses_limits_that_are_no_limits(tiny_model):
    with Llama(str(tiny_model()), n_ctx=32) as llm:
        for bad in (dict(max_body=0), dict(max_connections=-1), dict(idle_timeout=0), dict(max_prompt_chars="9")):
            with pytest.raises(ValueError, match=next(iter(bad))):
                make_server(llm, "127.0.0.1", 0, **bad)


def test_cli_limit_flags(tiny_model):
    for flags, needle in ((["--max-body", "lots"], "not a byte count"), (["--max-connections", "0"], "positive")):
        proc = subprocess.run([sys.executable, "-m", "pykv", "serve", str(tiny_model()), "--port", "0", *flags],
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode != 0 and needle in proc.stderr, proc.stderr


# ---- a short soak ----

def test_short_soak(tiny_model):
    """bench/server_soak.py for a few seconds: every answer is one the request deserves (no 500,
    no dropped connection without an answer), the server stays up, its threads stay under the
    cap and its memory does not grow."""
    spec = importlib.util.spec_from_file_location("server_soak", ROOT / "bench" / "server_soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    asan = "libasan" in os.environ.get("LD_PRELOAD", "")   # its quarantine holds freed memory for a while
    report = soak.soak(str(tiny_model()), seconds=6, max_requests=600, clients=6, seed=1, n_ctx=128,
                       max_growth_mib=512 if asan else 64)
    assert report["failures"] == [], report["failures"][:5]
    assert report["requests"] >= 10 and report["statuses"].get("200", 0) > 0, report
    assert report["server_alive"] and report["max_threads"] <= report["thread_cap"], report
