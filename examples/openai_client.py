"""The `openai` package against `pykv serve`: pykv's server speaks OpenAI's HTTP API, so an
OpenAI client only needs its address.

usage: python examples/openai_client.py [MODEL]

MODEL is a .gguf path or a pykv model name (default: smollm2, fetched once into ~/.cache/pykv).
Needs `pip install openai`. The example starts the server itself, on a free port of this
machine's loopback address, and stops it at the end; against a server you run yourself
(`pykv serve smollm2 --port 8080`) only the base_url below is needed.
"""
import re
import subprocess
import sys
import threading

from openai import OpenAI

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
API_KEY = "example-key"   # the server asks every request for it (--api-key)

# `pykv serve` in a subprocess; --port 0 lets the system pick a free port, which the server
# names on stderr once it listens: "pykv: serving NAME at http://127.0.0.1:PORT/v1 (...)"
server = subprocess.Popen([sys.executable, "-m", "pykv", "serve", model, "--host", "127.0.0.1", "--port", "0",
                           "-c", "2048", "--api-key", API_KEY], stderr=subprocess.PIPE, text=True)
try:
    for line in server.stderr:
        address = re.search(r" at (http://\S+/v1) ", line)
        if address:
            break
        sys.stderr.write(line)   # whatever the server said before (an error, if it failed to start)
    else:
        sys.exit(f"the server stopped (exit code {server.wait()}) before it listened")
    # keep reading the server's stderr, so that it never blocks on a full pipe
    threading.Thread(target=lambda: [sys.stderr.write(line) for line in server.stderr], daemon=True).start()

    client = OpenAI(base_url=address.group(1), api_key=API_KEY)
    served = client.models.list().data[0].id   # the server's one model

    # a chat completion: the whole reply in one response
    response = client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": "Name three colors."}], temperature=0, max_tokens=24)
    print("reply:", response.choices[0].message.content)

    # a streamed one: the reply arrives in pieces (server-sent events) as it is generated
    print("streamed: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": "Hello! Who are you?"}], temperature=0, max_tokens=24,
        stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
finally:
    server.terminate()   # stop the server (SIGTERM) and wait for it to exit
    server.wait()
