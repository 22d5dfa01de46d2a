"""The OpenAI-compatible server (pykv.server, `pykv serve`) on a tiny model: each endpoint
answers what the Llama method it wraps returns for the same arguments (greedy, so equal),
streams as server-sent events, refuses bad requests with 400/404 and OpenAI's error body,
and keeps serving after a client leaves mid-stream."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from _compare import EXACT
from pykv import Llama, LlamaGrammar
from pykv.server import make_server

TIMEOUT = 60


@pytest.fixture
def served(tiny_model):
    """(base URL, the served Llama); the server runs on a free port in a thread."""
    with Llama(str(tiny_model()), n_ctx=1024, embedding=True, pooling_type="mean", **EXACT) as llm:
        server = make_server(llm, "127.0.0.1", 0, model_name="tiny")
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}", llm
        finally:
            server.shutdown()
            server.server_close()
            thread.join(TIMEOUT)


def request(url, body=None, raw=None):
    """(status, parsed JSON body) of a GET (no body) or a POST."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(url, body):
    """The data lines of a streamed response, JSON-decoded, '[DONE]' kept as is."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        lines = [line for line in r.read().decode().split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def test_health_and_models(served):
    url, _ = served
    assert request(url + "/health") == (200, {"status": "ok"})
    status, models = request(url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]


def test_completion_equals_the_method(served):
    url, llm = served
    args = dict(prompt="the cat and the dog", max_tokens=6, temperature=0, logprobs=2)
    want = llm.create_completion(**args)
    status, got = request(url + "/v1/completions", dict(args, model="whatever", user="u"))   # extras ignored
    assert status == 200 and got["model"] == "tiny"
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    # the server's call reused the context's prompt prefix: the same values up to float rounding
    np.testing.assert_allclose(got["choices"][0]["logprobs"]["token_logprobs"],
                               want["choices"][0]["logprobs"]["token_logprobs"], rtol=0, atol=1e-5)
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    # the same request without the /v1 prefix, as llama-server also answers
    assert request(url + "/completions", args)[1]["choices"][0]["text"] == want["choices"][0]["text"]
    stream = events(url + "/v1/completions", dict(args, stream=True))
    assert stream[-1] == "[DONE]" and stream[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in stream[:-1]) == want["choices"][0]["text"]


def test_chat_equals_the_method(served):
    url, llm = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    want = llm.create_chat_completion(messages, max_tokens=5, temperature=0)
    status, got = request(url + "/v1/chat/completions", dict(messages=messages, max_tokens=5, temperature=0))
    assert status == 200 and got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    stream = events(url + "/v1/chat/completions", dict(messages=messages, max_tokens=5, temperature=0, stream=True))
    assert stream[0]["choices"][0]["delta"] == {"role": "assistant"} and stream[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in stream[1:-1])
    assert text == want["choices"][0]["message"]["content"]


def test_embeddings(served):
    url, llm = served
    status, got = request(url + "/v1/embeddings", {"input": ["Hello world", "the cat"], "model": "m"})
    assert status == 200 and got["object"] == "list" and got["model"] == "tiny"
    want = llm.embed(["Hello world", "the cat"])
    for item, vec in zip(got["data"], want):
        np.testing.assert_array_equal(np.array(item["embedding"]), np.array(vec))


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/nothing", {}, 404, "no such endpoint"),
    ("/v1/completions", {"max_tokens": 2}, 400, "'prompt' is required"),
    ("/v1/chat/completions", {"prompt": "x"}, 400, "'messages' is required"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n=1"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "'temperature' must be a number"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, 400, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "the cat " * 1200}, 400, "n_ctx=1024"),
    ("/v1/completions", [1, 2], 400, "JSON object"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "'role'"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True, "top_p": 7},
     400, "top_p"),
])
def test_bad_requests(served, path, body, status, needle):
    url, _ = served
    got_status, got = request(url + path, body)
    assert got_status == status and needle in got["error"]["message"], got
    assert got["error"]["type"] == "invalid_request_error"


def test_bad_bodies(served):
    url, _ = served
    status, got = request(url + "/v1/completions", raw=b"not json")
    assert status == 400 and "not JSON" in got["error"]["message"]
    status, got = request(url + "/v1/completions", raw=b"")
    assert status == 400 and "body is required" in got["error"]["message"]
    status, got = request(url + "/v1/other")
    assert status == 404


def test_a_client_leaving_mid_stream_frees_the_server(served):
    url, _ = served
    body = dict(prompt="the cat", max_tokens=50, temperature=0, stream=True)
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=TIMEOUT)
    r.readline()   # the first event, then hang up
    r.close()
    results = []

    def ask():
        results.append(request(url + "/v1/completions", dict(prompt="the dog", max_tokens=3, temperature=0))[0])
    threads = [threading.Thread(target=ask) for _ in range(3)]   # concurrent: served one at a time
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert results == [200, 200, 200]


def test_embeddings_refused_without_pooling_or_embedding(tiny_model):
    for kwargs, needle in ((dict(embedding=True), "pooling"), ({}, "--embedding")):
        with Llama(str(tiny_model()), n_ctx=32, **kwargs) as llm:
            server = make_server(llm, "127.0.0.1", 0)
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            try:
                status, got = request(f"http://127.0.0.1:{server.server_address[1]}/v1/embeddings", {"input": "x"})
            finally:
                server.shutdown()
                server.server_close()
            assert status == 400 and needle in got["error"]["message"]


def test_pykv_serve_command(tiny_model):
    proc = subprocess.Popen([sys.executable, "-m", "pykv", "serve", str(tiny_model()), "--port", "0", "-c", "32",
                             "--alias", "tiny-cli"], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "serving tiny-cli at http://127.0.0.1:" in line, line
        base = line.split(" at ")[1].split()[0]   # http://127.0.0.1:PORT/v1
        status, models = request(base + "/models")
        assert status == 200 and models["data"][0]["id"] == "tiny-cli"
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)
    bad = subprocess.run([sys.executable, "-m", "pykv", "serve", "--port", "70000"], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert bad.returncode == 1 and "--port" in bad.stderr


def test_a_runtime_failure_is_a_500(served, monkeypatch):
    url, llm = served

    def broken(**kwargs):
        raise RuntimeError("out of something")
    monkeypatch.setattr(llm, "create_completion", broken)
    status, got = request(url + "/v1/completions", {"prompt": "x"})
    assert status == 500 and got["error"]["type"] == "server_error" and "out of something" in got["error"]["message"]
    assert request(url + "/health")[0] == 200   # still serving


def test_tokenize_and_detokenize(served):
    url, llm = served
    status, got = request(url + "/tokenize", {"content": "the cat and the dog"})
    assert status == 200 and got["tokens"] == llm.tokenize("the cat and the dog", add_bos=False, special=True)
    with_bos = request(url + "/tokenize", {"content": "the cat", "add_special": True})[1]["tokens"]
    assert with_bos[0] == llm.token_bos() and with_bos[1:] == llm.tokenize("the cat", add_bos=False)
    status, back = request(url + "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and back["content"] == llm.detokenize(got["tokens"]).decode()
    for path, body, needle in (("/tokenize", {"content": 5}, "string"), ("/detokenize", {"tokens": "abc"}, "list"),
                               ("/detokenize", {"tokens": [10 ** 6]}, "")):
        status, err = request(url + path, body)
        assert status == 400 and needle in err["error"]["message"]


def test_stream_options_include_usage(served):
    url, llm = served
    body = dict(messages=[{"role": "user", "content": "Hello world"}], max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True})
    stream = events(url + "/v1/chat/completions", body)
    assert stream[-1] == "[DONE]" and stream[-3]["choices"][0]["finish_reason"] is not None
    usage_chunk = stream[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["id"] == stream[0]["id"]
    assert usage_chunk["usage"]["completion_tokens"] == len(llm.last_result.tokens) == 4
    assert usage_chunk["usage"]["prompt_tokens"] == llm.last_result.prompt_tokens
    plain = events(url + "/v1/completions", dict(prompt="the cat", max_tokens=2, stream=True))
    assert all("usage" not in c for c in plain[:-1])   # only when asked


def test_api_key(tiny_model):
    with Llama(str(tiny_model()), n_ctx=64) as llm:
        server = make_server(llm, "127.0.0.1", 0, api_key="s3cret")
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            assert request(url + "/health")[0] == 200   # open, as llama-server's
            status, got = request(url + "/v1/models")
            assert status == 401 and got["error"]["type"] == "authentication_error"
            assert request(url + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 401
            for header, want in (("Bearer s3cret", 200), ("Bearer wrong", 401), ("s3cret", 401)):
                req = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "x", "max_tokens": 1}',
                                             headers={"Authorization": header, "Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
                        status = r.status
                except urllib.error.HTTPError as e:
                    status = e.code
                assert status == want, header
        finally:
            server.shutdown()
            server.server_close()


def test_connection_survives_refusals(served):
    """Keep-alive: after a 404 or a 400 the same connection serves the next request (the body
    was read); a Content-Length that is no byte count closes it."""
    import http.client
    url, _ = served
    conn = http.client.HTTPConnection(url.split("//")[1], timeout=TIMEOUT)
    for path, body, status in (("/v1/nope", b'{"a": 1}', 404), ("/v1/completions", b"{bad", 400),
                               ("/v1/completions", b'{"prompt": "x", "max_tokens": 1}', 200)):
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == status and json.loads(r.read()), path
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", "many")
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 400 and "Content-Length" in json.loads(r.read())["error"]["message"]
    conn.close()


def test_grammars(served):
    """"grammar" (both endpoints), "response_format" (chat) and llama-server's "json_schema"
    (completions) give what the method gives with the same grammar; a bad one is a 400."""
    url, llm = served
    words = 'root ::= [a-z]+ (" " [a-z]+)*'
    args = dict(prompt="the cat", max_tokens=8, temperature=0)
    want = llm.create_completion(**args, grammar=words)["choices"][0]["text"]
    assert request(url + "/v1/completions", dict(args, grammar=words))[1]["choices"][0]["text"] == want
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    want = llm.create_completion(**args, grammar=LlamaGrammar.from_json_schema(schema))["choices"][0]["text"]
    assert want.startswith('{') and request(url + "/v1/completions", dict(args, json_schema=schema))[1][
        "choices"][0]["text"] == want
    messages = [{"role": "user", "content": "Hello world"}]
    fmt = {"type": "json_object"}
    want = llm.create_chat_completion(messages, max_tokens=8, temperature=0, response_format=fmt)
    got = request(url + "/v1/chat/completions", dict(messages=messages, max_tokens=8, temperature=0,
                                                      response_format=fmt))[1]
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert want["choices"][0]["message"]["content"].startswith("{")
    for path, body, needle in [("/v1/completions", dict(args, grammar='root ::= "x'), "unterminated"),
                               ("/v1/completions", dict(args, grammar=words, json_schema={}), "not both"),
                               ("/v1/completions", dict(args, json_schema={"pattern": "a"}), "pattern"),
                               ("/v1/chat/completions", dict(messages=messages, response_format={"type": "yaml"}),
                                "not one of")]:
        status, body = request(url + path, body)
        assert status == 400 and needle in body["error"]["message"], body


def test_mirostat_fields(served):
    """llama-cpp-python's mirostat_mode/_tau/_eta, llama-server's "mirostat" and typical_p reach the sampler."""
    url, llm = served
    args = dict(prompt="the cat", max_tokens=8, temperature=1.0, seed=3)
    want = llm.create_completion(**args, mirostat_mode=1, mirostat_tau=2.0, mirostat_eta=0.2)["choices"][0]["text"]
    for extra in (dict(mirostat_mode=1), dict(mirostat=1)):
        got = request(url + "/v1/completions", dict(args, mirostat_tau=2.0, mirostat_eta=0.2, **extra))
        assert got[0] == 200 and got[1]["choices"][0]["text"] == want
    status, body = request(url + "/v1/completions", dict(args, mirostat_mode="2"))
    assert status == 400 and "mirostat_mode" in body["error"]["message"]
    want = llm.create_completion(**args, top_k=0, typical_p=0.4)["choices"][0]["text"]
    assert request(url + "/v1/completions", dict(args, top_k=0, typical_p=0.4))[1]["choices"][0]["text"] == want


def test_tools(served):
    """"tools" and "tool_choice" on chat: the call the method makes, streamed too; a tool_choice
    naming no tool is a 400."""
    url, llm = served
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}}}
    body = dict(messages=[{"role": "user", "content": "1+1"}], tools=[add], tool_choice="required",
                max_tokens=400, temperature=0)
    llm.reset()
    want = llm.create_chat_completion(**body)["choices"][0]
    llm.reset()
    status, got = request(url + "/v1/chat/completions", body)
    got = got["choices"][0]
    assert status == 200 and got["finish_reason"] == want["finish_reason"] == "tool_calls"
    assert got["message"]["tool_calls"][0]["function"] == want["message"]["tool_calls"][0]["function"]
    status, bad = request(url + "/v1/chat/completions", dict(body, tool_choice={"type": "function",
                                                                                "function": {"name": "mul"}}))
    assert status == 400 and "not among the tools" in bad["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_during_its_prompt_stops_it(tiny_model, stream):
    """A client that hangs up while its long prompt is evaluated: the server stops at the next
    chunk (the prompt would otherwise hold it for its whole length) and serves the next one."""
    import socket
    import time
    with Llama(str(tiny_model()), n_ctx=4096, n_batch=32, **EXACT) as llm:
        server = make_server(llm, "127.0.0.1", 0, model_name="tiny")
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            prompt = [5 + i % 290 for i in range(3000)]
            body = json.dumps(dict(prompt=prompt, max_tokens=4, temperature=0, stream=stream)).encode()
            with socket.create_connection(server.server_address, timeout=TIMEOUT) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + TIMEOUT
            while getattr(llm, "last_result", None) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            with server.lock:   # the request is done
                result = llm.last_result
                n_past = llm.n_past
            assert result.finish_reason == "cancelled"
            assert n_past < len(prompt) // 2, n_past   # stopped long before the prompt's end
            url = f"http://127.0.0.1:{server.server_address[1]}"
            status, out = request(url + "/v1/completions", dict(prompt="the dog", max_tokens=3, temperature=0))
            assert status == 200 and out["choices"][0]["text"] == llm.create_completion(
                "the dog", max_tokens=3, temperature=0)["choices"][0]["text"]
        finally:
            server.shutdown()
            server.server_close()
            thread.join(TIMEOUT)
