"""llama-cpp-python's chat formats by name (Llama(chat_format=...)), as Jinja2 chat templates
that pykv renders like a GGUF's own template (pykv.chat). Each writes the prompt layout the
format's models were trained on; a system message that the layout has no place for goes
before the first user message, and any role other than system and assistant is written as
a user turn. `bos_token` and `eos_token` are the model's own.

    Llama("model.gguf", chat_format="llama-2")
"""
from __future__ import annotations

from typing import Dict

from . import errors
from .chat import CHATML

# The first message's content when it is a system message, and the messages after it.
_SPLIT_SYSTEM = ("{% if messages and messages[0]['role'] == 'system' %}"
                 "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
                 "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}")


def _folding_system(user_text: str) -> str:
    """user_text with the system message (if any) before the first user turn's content."""
    return ("{% if loop.first and system %}" + user_text.replace("CONTENT", "system + '\\n\\n' + m['content']") +
            "{% else %}" + user_text.replace("CONTENT", "m['content']") + "{% endif %}")


LLAMA_2 = (_SPLIT_SYSTEM +
           "{% for m in turns %}"
           "{% if m['role'] == 'assistant' %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}"
           "{% else %}{{ bos_token + '[INST] ' }}"
           "{% if loop.first and system %}{{ '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}{% endif %}"
           "{{ m['content'] | trim + ' [/INST]' }}{% endif %}"
           "{% endfor %}")

LLAMA_3 = ("{{ bos_token }}"
           "{% for m in messages %}"
           "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
           "{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

MISTRAL_INSTRUCT = (_SPLIT_SYSTEM + "{{ bos_token }}"
                    "{% for m in turns %}"
                    "{% if m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
                    "{% else %}" + _folding_system("{{ '[INST] ' + CONTENT + ' [/INST]' }}") + "{% endif %}"
                    "{% endfor %}")

GEMMA = (_SPLIT_SYSTEM + "{{ bos_token }}"
         "{% for m in turns %}"
         "{% if m['role'] == 'assistant' %}{{ '<start_of_turn>model\\n' + m['content'] | trim + '<end_of_turn>\\n' }}"
         "{% else %}" + _folding_system("{{ '<start_of_turn>user\\n' + CONTENT | trim + '<end_of_turn>\\n' }}") +
         "{% endif %}"
         "{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

PHI_3 = ("{{ bos_token }}"
         "{% for m in messages %}"
         "{% set role = m['role'] if m['role'] in ('system', 'assistant') else 'user' %}"
         "{{ '<|' + role + '|>\\n' + m['content'] + '<|end|>\\n' }}"
         "{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

ZEPHYR = ("{% for m in messages %}"
          "{% set role = m['role'] if m['role'] in ('system', 'assistant') else 'user' %}"
          "{{ '<|' + role + '|>\\n' + m['content'] + eos_token + '\\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

VICUNA = (_SPLIT_SYSTEM + "{% if system %}{{ system + ' ' }}{% endif %}"
          "{% for m in turns %}"
          "{% if m['role'] == 'assistant' %}{{ 'ASSISTANT: ' + m['content'] + eos_token }}"
          "{% else %}{{ 'USER: ' + m['content'] + ' ' }}{% endif %}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")

ALPACA = (_SPLIT_SYSTEM + "{% if system %}{{ system + '\\n\\n' }}{% endif %}"
          "{% for m in turns %}"
          "{% if m['role'] == 'assistant' %}{{ '### Response:\\n' + m['content'] + '\\n\\n' }}"
          "{% else %}{{ '### Instruction:\\n' + m['content'] + '\\n\\n' }}{% endif %}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}")

CHAT_FORMATS: Dict[str, str] = {
    "chatml": CHATML,
    # llama-cpp-python's name for ChatML with tools; pykv handles tools for any template
    "chatml-function-calling": CHATML,
    "qwen": CHATML,
    "llama-2": LLAMA_2,
    "llama-3": LLAMA_3,
    "mistral-instruct": MISTRAL_INSTRUCT,
    "gemma": GEMMA,
    "phi-3": PHI_3,
    "zephyr": ZEPHYR,
    "vicuna": VICUNA,
    "alpaca": ALPACA,
}


def chat_format_template(name) -> str:
    """The Jinja2 template of a chat format name; InvalidArgumentError listing the known
    names for any other."""
    if not isinstance(name, str) or name not in CHAT_FORMATS:
        raise errors.InvalidArgumentError(
            f"unknown chat_format {name!r}: pykv knows {', '.join(sorted(CHAT_FORMATS))} (leave it out to use "
            "the model's own chat template, or give chat_template=<Jinja2 text>)")
    return CHAT_FORMATS[name]
