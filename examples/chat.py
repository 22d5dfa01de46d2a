"""A conversation of several turns with create_chat_completion (llama-cpp-python's chat API).

usage: python examples/chat.py [MODEL]

MODEL is a .gguf path or a pykv model name (default: smollm2, fetched once into ~/.cache/pykv).
"""
import sys

from pykv import Llama

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
questions = ["Hello! Who are you?", "Name three colors."]

with Llama(model, n_ctx=2048) as llm:
    # the conversation is a list of OpenAI-style messages; the model's chat template (from
    # the GGUF) turns it into the prompt
    messages = [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}]
    for question in questions:
        messages.append({"role": "user", "content": question})
        response = llm.create_chat_completion(messages, temperature=0.0, max_tokens=64)
        reply = response["choices"][0]["message"]["content"]
        # the reply goes into the conversation, so that the next turn sees it; the context
        # keeps what it has already evaluated and reads only the new messages
        messages.append({"role": "assistant", "content": reply})
        print(f"user: {question}\nassistant: {reply}\n")
