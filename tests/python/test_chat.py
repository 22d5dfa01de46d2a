"""Chat: messages rendered with the GGUF's chat template in a Jinja2 sandbox (checked against
transformers' apply_chat_template on the same GGUF), ChatML without a template, clear errors
for bad messages and templates, and create_chat_completion's greedy answer against torch."""

from __future__ import annotations

from pathlib import Path

import pytest

import _vocab_fixtures as vf
from _compare import EXACT
from _torch_reference import greedy_continuation
from pykv import Llama
from pykv.chat import render
from pykv.errors import InvalidArgumentError

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Capital of Italy?"},
     {"role": "assistant", "content": "Rome."},
     {"role": "user", "content": "And of Spain? Ça va, 東京?"}],
    [{"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}],
    [{"role": "user", "content": "  spaces\n\nand newlines  "}],
]


@pytest.fixture(scope="module")
def smol_vocab(smollm2_path):
    with Llama(str(smollm2_path), vocab_only=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def smol_hf(smollm2_path):
    transformers = pytest.importorskip("transformers")
    path = Path(smollm2_path)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _flat(messages):
    """transformers takes text content only as a string."""
    return [dict(m, content=m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"]))
            for m in messages]


@pytest.mark.model
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_renders_as_transformers(smol_vocab, smol_hf, messages, add_generation_prompt):
    assert smol_vocab.chat_template and smol_vocab.chat_template == smol_hf.chat_template
    ours = smol_vocab.detokenize(smol_vocab.chat_prompt(messages, add_generation_prompt), special=True)
    ref = smol_hf.apply_chat_template(_flat(messages), add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.decode("utf-8") == ref


def test_chatml_without_a_template():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(None, messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert render(None, messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"content": "no role"}], "'role'"),
    ([{"role": "user", "content": 5}], "must be text"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text"),
    (["not a dict"], "'role'"),
])
def test_bad_messages(messages, match):
    with pytest.raises(InvalidArgumentError, match=match):
        render(None, messages)


@pytest.mark.parametrize("template, match", [
    ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}",
     "refused the messages: a system message comes first"),
    ("{% for m in messages %}", "cannot be rendered"),                                   # syntax
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "cannot be rendered"),            # the sandbox
    ("{{ messages.append(1) }}", "cannot be rendered"),                                  # immutable
    ("{{ messages[0]['content'] + 5 }}", "cannot be rendered: TypeError"),
])
def test_bad_templates_are_clear_errors(template, match):
    with pytest.raises(InvalidArgumentError, match=match):
        render(template, [{"role": "user", "content": "hi"}])


def test_template_helpers():
    t = "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{% for m in messages %}{% break %}{% endfor %}"
    out = render(t, [{"role": "user", "content": "é"}])
    assert out == '[{"role": "user", "content": "é"}]|4|'


def test_a_given_template_replaces_the_ggufs(tiny_model, tmp_path):
    """Llama(chat_template=...) and --chat-template/--chat-template-file: the given template (or
    the name chatml) renders the chat; a bare word that is no known name, or text that does not
    parse, is refused before the model loads."""
    import subprocess
    import sys
    messages = [{"role": "user", "content": "hi"}]
    mine = "{% for m in messages %}<<{{ m.role }}:{{ m.content }}>>{% endfor %}"
    with Llama(str(tiny_model()), vocab_only=True, chat_template=mine) as llm:
        assert llm.chat_template == mine
        assert llm.detokenize(llm.chat_prompt(messages)).decode().endswith("<<user:hi>>")
    with Llama(str(tiny_model()), vocab_only=True, chat_template="chatml") as llm:
        assert llm.detokenize(llm.chat_prompt(messages), special=True).decode().endswith(render(None, messages))
    for bad, needle in [("llama3", "unknown chat template name 'llama3'"), ("{% for m in messages %}", "does not parse"),
                        ("", "Jinja2 text or a name")]:
        with pytest.raises(InvalidArgumentError, match=needle):
            Llama(str(tmp_path / "never-loaded.gguf"), chat_template=bad)
    (tmp_path / "t.jinja").write_text(mine)
    for flags, code, needle in [(["--chat-template-file", str(tmp_path / "t.jinja")], 0, ""),
                                (["--chat-template-file", str(tmp_path / "none.jinja")], 1, "cannot read"),
                                (["--chat-template", "llama3"], 1, "unknown chat template name")]:
        r = subprocess.run([sys.executable, "-m", "pykv", "chat", str(tiny_model()), "-n", "2", "-c", "256", *flags],
                           input="hi\n", capture_output=True, text=True, timeout=120)
        assert r.returncode == code and needle in r.stderr, r.stderr


@pytest.mark.model
def test_bos_is_not_doubled(smollm2_path, tmp_path):
    """A model that adds BOS, with a template that writes BOS itself: one BOS, not two."""
    vocab = dict(vf.read_bpe_vocab(Path(smollm2_path)), bos=0)   # <|endoftext|> as BOS, apart from ChatML's marks
    from pykv.chat import CHATML
    messages = [{"role": "user", "content": "Hi"}]
    for template in (None, "{{ bos_token }}" + CHATML):
        path = vf.bpe_gguf_variant(vocab, "smollm", tmp_path / f"bos-{template is None}.gguf", add_bos=True,
                                   chat_template=template)
        with Llama(str(path), vocab_only=True) as llm:
            ids = llm.chat_prompt(messages)
            assert llm.token_bos() == 0 and ids[0] == 0 and ids.count(0) == 1
            assert llm.detokenize(ids[1:], special=True) == render(None, messages).encode()


@pytest.mark.model
def test_chat_completion_greedy_matches_torch(smollm2_path):
    messages = CONVERSATIONS[0]
    with Llama(str(smollm2_path), n_ctx=256, n_threads=2, **EXACT) as llm:
        prompt = llm.chat_prompt(messages)
        ref, gaps = greedy_continuation(smollm2_path, prompt, 12, eos_id=llm.token_eos())
        n = next((i for i, g in enumerate(gaps) if g < 1e-3), len(gaps))
        n = min(n, next((i for i, t in enumerate(ref) if llm.is_eog(t)), len(ref)))
        assert n >= 6
        greedy = dict(temperature=0.0, max_tokens=12, seed=0)
        out = llm.create_chat_completion(messages, **greedy)
        tokens = llm.last_result.tokens
        assert tokens[:n] == ref[:n]
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
        choice = out["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": llm.detokenize(tokens).decode("utf-8")}
        assert choice["finish_reason"] in ("stop", "length")
        assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                                "total_tokens": len(prompt) + len(tokens),
                                "prompt_tokens_details": {"cached_tokens": 0}}

        chunks = list(llm.create_chat_completion(messages, stream=True, **greedy))
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]


@pytest.mark.model
def test_chat_completion_with_a_policy_and_a_bad_message(smollm2_path):
    with Llama(str(smollm2_path), n_ctx=512, n_threads=2, policy="snapkv", budget=16, window=4) as llm:
        long_question = [{"role": "user", "content": "Tell me about Paris. " * 20}]
        out = llm.create_chat_completion(long_question, temperature=0.0, max_tokens=4)
        assert out["usage"]["prompt_tokens"] > 100 and out["usage"]["completion_tokens"] >= 1
        assert llm.kv_stats()["evicted"] > 0
        with pytest.raises(InvalidArgumentError, match="'role'"):
            llm.create_chat_completion([{"content": "x"}])
        with pytest.raises(InvalidArgumentError, match="'role'"):   # a stream fails at the call, not later
            llm.create_chat_completion([{"content": "x"}], stream=True)
