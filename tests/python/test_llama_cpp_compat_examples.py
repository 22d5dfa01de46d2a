"""llama-cpp-python's documented examples (its README's high-level API: completion, chat
completion with chat_format, JSON mode and JSON schema mode, function calling, embeddings,
and the prompt cache), each as written there but for the import (`from pykv import ...`
instead of `from llama_cpp import ...`), the model path (SmolLM2) and, where the examples
leave them to the user, lengths short enough for a test. Each checks what the example shows."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pykv import Llama, LlamaRAMCache

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model_path(smollm2_path):
    return str(smollm2_path)


def test_high_level_completion(model_path):
    llm = Llama(
        model_path=model_path,
        # n_gpu_layers=-1, # Uncomment to use GPU acceleration
        # seed=1337, # Uncomment to set a specific seed
        # n_ctx=2048, # Uncomment to increase the context window
    )
    output = llm(
        "Q: Name the planets in the solar system? A: ",  # Prompt
        max_tokens=32,  # Generate up to 32 tokens, set to None to generate up to the end of the context window
        stop=["Q:", "\n"],  # Stop generating just before the model would generate a new question
        echo=True  # Echo the prompt back in the output
    )  # Generate a completion, can also call create_completion
    choice = output["choices"][0]
    assert output["object"] == "text_completion" and choice["text"].startswith("Q: Name the planets")
    assert "\n" not in choice["text"] and choice["finish_reason"] in ("stop", "length")
    assert output["usage"]["completion_tokens"] <= 32


def test_chat_completion_with_chat_format(model_path):
    llm = Llama(
        model_path=model_path,
        chat_format="chatml"   # the README names "llama-2" for a Llama 2 model; SmolLM2 is trained on ChatML
    )
    reply = llm.create_chat_completion(
        messages=[
            {"role": "system", "content": "You are an assistant who perfectly describes images."},
            {
                "role": "user",
                "content": "Describe this image in detail please."
            }
        ],
        max_tokens=24,
    )
    message = reply["choices"][0]["message"]
    assert reply["object"] == "chat.completion" and message["role"] == "assistant" and message["content"]
    with Llama(model_path=model_path, chat_format="llama-2", n_ctx=256) as other:   # any format by name
        text = other.detokenize(other.chat_prompt([{"role": "user", "content": "Hi"}]), special=True).decode()
        assert text.endswith("[INST] Hi [/INST]") and "<<SYS>>" not in text


def test_json_mode(model_path):
    llm = Llama(model_path=model_path, chat_format="chatml")
    reply = llm.create_chat_completion(
        messages=[
            {
                "role": "system",
                "content": "You are a helpful assistant that outputs in JSON.",
            },
            {"role": "user", "content": "Who won the world series in 2020"},
        ],
        response_format={
            "type": "json_object",
        },
        temperature=0.7,
        seed=1,
        max_tokens=200,
    )
    choice = reply["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_json_schema_mode(model_path):
    llm = Llama(model_path=model_path, chat_format="chatml")
    schema = {
        "type": "object",
        "properties": {"team_name": {"type": "string", "maxLength": 40}},
        "required": ["team_name"],
    }
    reply = llm.create_chat_completion(
        messages=[
            {
                "role": "system",
                "content": "You are a helpful assistant that outputs in JSON.",
            },
            {"role": "user", "content": "Who won the world series in 2020"},
        ],
        response_format={
            "type": "json_object",
            "schema": schema,
        },
        temperature=0.7,
        seed=1,
        max_tokens=80,
    )
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_function_calling(model_path):
    llm = Llama(model_path=model_path, chat_format="chatml-function-calling")
    reply = llm.create_chat_completion(
        messages=[
            {
                "role": "system",
                "content": "A chat between a curious user and an artificial intelligence assistant. The assistant "
                           "gives helpful, detailed, and polite answers to the user's questions. The assistant calls "
                           "functions with appropriate input when necessary"
            },
            {
                "role": "user",
                "content": "Extract Jason is 25 years old"
            }
        ],
        tools=[{
            "type": "function",
            "function": {
                "name": "UserDetail",
                "parameters": {
                    "type": "object",
                    "title": "UserDetail",
                    "properties": {
                        "name": {
                            "title": "Name",
                            "type": "string"
                        },
                        "age": {
                            "title": "Age",
                            "type": "integer"
                        }
                    },
                    "required": ["name", "age"]
                }
            }
        }],
        tool_choice={
            "type": "function",
            "function": {
                "name": "UserDetail"
            }
        },
        temperature=0,
        max_tokens=60,
    )
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    args = json.loads(call["arguments"])
    assert call["name"] == "UserDetail" and set(args) == {"name", "age"} and isinstance(args["age"], int)


def test_embeddings(model_path):
    llm = Llama(model_path=model_path, embedding=True)
    embeddings = llm.create_embedding("Hello, world!")
    (item,) = embeddings["data"]
    # SmolLM2's GGUF names no pooling: one vector per token, as llama-cpp-python gives
    vectors = item["embedding"] if isinstance(item["embedding"][0], list) else [item["embedding"]]
    assert vectors and all(len(v) == llm.n_embd() for v in vectors)
    # or create multiple embeddings at once
    embeddings = llm.create_embedding(["Hello, world!", "Goodbye, world!"])
    assert [d["index"] for d in embeddings["data"]] == [0, 1]


def test_tokenize_and_cache(model_path):
    llm = Llama(model_path=model_path, n_ctx=512)
    tokens = llm.tokenize(b"Hello, world!")
    assert llm.detokenize(tokens) == b"Hello, world!"
    llm.set_cache(LlamaRAMCache())
    first = llm("The capital of France is", max_tokens=8, temperature=0)
    llm.reset()   # what another conversation would leave: the cache brings the prompt back
    again = llm("The capital of France is", max_tokens=8, temperature=0)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
