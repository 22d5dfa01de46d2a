"""Function calling in chat completions (tools, tool_choice; functions, function_call): the
call grammar accepts exactly the calls the `jsonschema` validator accepts, the streamed
arguments join to the whole call's, replies are recognised as calls or text, the tools reach
the template or the system message, and refusals are clear. On SmolLM2 a required call
names the right tool with arguments its schema allows."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from _compare import EXACT
from _tiny_models import grammar_takes
from pykv import InvalidArgumentError, Llama
from pykv.server.tools import CallStream, call_grammar, check_tools, choose, parse_calls
from pykv.grammar import bind


def tool(name, parameters, description=""):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


ADD = tool("add", {"type": "object", "required": ["a", "b"], "properties": {
    "a": {"type": "integer"}, "b": {"enum": [1, 2]}, "note": {"type": "string", "maxLength": 3}}}, "Add numbers")
# two tools whose local definitions share a name: each must keep its own
TREE = tool("tree", {"$defs": {"node": {"type": "object", "required": ["v"], "properties": {
    "v": {"type": "boolean"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}},
    "type": "object", "required": ["root"], "properties": {"root": {"$ref": "#/$defs/node"}}})
PAIR = tool("pair", {"$defs": {"node": {"type": "string", "maxLength": 2}}, "type": "object",
                     "required": ["x"], "properties": {"x": {"$ref": "#/$defs/node"}}})
TOOLS = [ADD, TREE, PAIR]


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    with Llama(str(tiny_model()), n_ctx=4096, **EXACT) as llm:
        yield llm


def valid_call(text: str, tools) -> bool:
    """The reference: a JSON object {"name": a tool's name, "arguments": what its schema allows},
    written with name first (the grammar's order)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if not isinstance(value, dict) or list(value) != ["name", "arguments"]:
        return False
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if value["name"] not in schemas:
        return False
    try:
        jsonschema.validate(value["arguments"], schemas[value["name"]])
    except jsonschema.ValidationError:
        return False
    return True


CALLS = ['{"name": "add", "arguments": {"a": 3, "b": 1}}', '{"name":"add","arguments":{"a":-7,"b":2,"note":"hi"}}',
         '{"name": "add", "arguments": {"a": 3, "b": 3}}', '{"name": "add", "arguments": {"a": 3}}',
         '{"name": "add", "arguments": {"a": 1.5, "b": 1}}', '{"name": "add", "arguments": {"a": 1, "b": 1, '
         '"note": "long"}}', '{"name": "tree", "arguments": {"root": {"v": true, "kids": [{"v": false}]}}}',
         '{"name": "tree", "arguments": {"root": {"v": true, "kids": [{"v": 1}]}}}',
         '{"name": "tree", "arguments": {"root": {"v": true, "kids": [{"v": true}, {"v": true}, {"v": true}]}}}',
         '{"name": "pair", "arguments": {"x": "ab"}}', '{"name": "pair", "arguments": {"x": "abc"}}',
         '{"name": "pair", "arguments": {"x": {"v": true}}}', '{"name": "nope", "arguments": {}}',
         '{"arguments": {"a": 1, "b": 1}, "name": "add"}', '{"name": "add"}', '[]']


@pytest.mark.parametrize("tools", [TOOLS, [ADD], [TREE, PAIR]], ids=["all", "add", "defs"])
def test_call_grammar_accepts_what_the_validator_accepts(tiny_llm, tools):
    matcher = bind(tiny_llm._model, call_grammar(tools))
    verdicts = [(text, grammar_takes(matcher, text), valid_call(text, tools)) for text in CALLS]
    assert any(want for _, _, want in verdicts) and any(not want for _, _, want in verdicts)
    assert [(t, got) for t, got, _ in verdicts] == [(t, want) for t, _, want in verdicts]


@pytest.mark.parametrize("text", [c for c in CALLS if valid_call(c, TOOLS)] +
                         ['{ "name" : "add" ,\n "arguments" :  {"a": 1, "b": {"c": "}}"}}  }\n'])
def test_call_stream_splits_name_and_arguments(text):
    """However the text is cut, the name comes whole and the pieces join to the arguments'
    JSON, without the call's own closing brace."""
    want = json.loads(text)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        stream, out = CallStream(), []
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            out.append(stream.push(text[a:b]))
            if stream.name is None:
                assert not "".join(out)
        out.append(stream.finish(complete=True))
        joined = "".join(out)
        assert stream.name == want["name"]
        assert joined == joined.strip() and json.loads(joined) == want["arguments"]


def test_replies_recognised_as_calls():
    assert parse_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', TOOLS) == [("add", '{"a": 1, "b": 2}')]
    assert parse_calls('  <tool_call>\n{"name": "pair", "arguments": "{\\"x\\": \\"q\\"}"}\n</tool_call>'
                       '<tool_call>{"name": "add", "parameters": {}}</tool_call>', TOOLS) == \
        [("pair", '{"x": "q"}'), ("add", "{}")]
    assert parse_calls('[{"name": "add", "arguments": {}}, {"name": "tree", "arguments": {"root": 1}}]', TOOLS) == \
        [("add", "{}"), ("tree", '{"root": 1}')]
    for text in ['{"name": "sub", "arguments": {}}', '{"name": "add", "arguments": 3}', "add(1, 2)",
                 '{"name": "add", "arguments": {}', 'Sure: <tool_call>{"name": "add", "arguments": {}}</tool_call>',
                 '[]', '{"answer": 4}']:
        assert parse_calls(text, TOOLS) is None, text


def test_refusals(tiny_llm):
    messages = [{"role": "user", "content": "hi"}]
    for kwargs, needle in [
            (dict(tools=[]), "non-empty list"), (dict(tools=[{"type": "code"}]), "'type': 'function'"),
            (dict(tools=[tool("a b", {})]), "function name"), (dict(tools=[ADD, ADD]), "given twice"),
            (dict(tools=[tool("f", [1])]), "JSON schema object"), (dict(tools=[ADD], functions=[]), "not both"),
            (dict(tool_choice="required"), "needs tools"), (dict(tools=[ADD], tool_choice="always"), "tool_choice must"),
            (dict(tools=[ADD], tool_choice={"type": "function", "function": {"name": "mul"}}), "not among"),
            (dict(tools=[ADD], tool_choice="required", function_call="auto"), "not both"),
            (dict(tools=[ADD], tool_choice="required", grammar='root ::= "x"'), "cannot take a grammar"),
            (dict(tools=[tool("f", {"type": "object", "properties": {"n": {"minimum": 1}}})], tool_choice="required"),
             "minimum")]:
        with pytest.raises(InvalidArgumentError, match=needle):
            tiny_llm.create_chat_completion(messages, max_tokens=1, **kwargs)
    assert choose(check_tools(None, [ADD["function"]]), None, {"name": "add"}) == ("call", [ADD])
    assert choose(check_tools([ADD], None), "none", None) == ("none", [ADD])


def test_bound_call_whole_and_streamed(tiny_llm):
    """A named function or "required": the random model's reply is a valid call, whole or
    streamed (the deltas join to the same arguments); the legacy functions form adds
    function_call and finishes with "function_call"."""
    messages = [{"role": "user", "content": "add"}]
    for choice, tools in [({"type": "function", "function": {"name": "add"}}, TOOLS), ("required", TOOLS)]:
        for seed in range(3):
            args = dict(tools=tools, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=400)
            tiny_llm.reset()
            whole = tiny_llm.create_chat_completion(messages, **args)["choices"][0]
            assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
            (call,) = whole["message"]["tool_calls"]
            assert call["type"] == "function" and call["id"].startswith("call_")
            text = json.dumps({"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])})
            assert valid_call(text, tools), text
            if isinstance(choice, dict):
                assert call["function"]["name"] == "add"
            tiny_llm.reset()
            chunks = [c["choices"][0] for c in tiny_llm.create_chat_completion(messages, stream=True, **args)]
            assert chunks[0]["delta"]["role"] == "assistant" and chunks[-1]["finish_reason"] == "tool_calls"
            deltas = [c["delta"]["tool_calls"][0] for c in chunks[1:-1]]
            assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == call["function"]["name"]
            assert all(d["index"] == 0 and "name" not in d["function"] for d in deltas[1:])
            assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    tiny_llm.reset()
    legacy = tiny_llm.create_chat_completion(messages, functions=[ADD["function"]], function_call={"name": "add"},
                                             temperature=0, max_tokens=400)["choices"][0]
    assert legacy["finish_reason"] == "function_call"
    assert legacy["message"]["function_call"] == legacy["message"]["tool_calls"][0]["function"]
    for choice in ("required", "auto"):   # streamed logprobs: one entry per token, none lost to held text
        chunks = list(tiny_llm.create_chat_completion(messages, tools=TOOLS, tool_choice=choice, temperature=1.0,
                                                      seed=0, max_tokens=60, stream=True, logprobs=True))
        entries = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
        assert len(entries) == len(tiny_llm.last_result.tokens) > 0


FORCED = {  # reply text (forced by a grammar) -> the calls "auto" finds in it, or None for text
    '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>': [("add", '{"a": 1}')],
    '[{"name": "add", "arguments": {}}, {"name": "pair", "arguments": {"x": "y"}}]': [("add", "{}"),
                                                                                    ("pair", '{"x": "y"}')],
    '{"answer": 4}': None,
    '  hello {"name": "add"}': None,
}


@pytest.mark.parametrize("text", list(FORCED))
def test_auto_finds_calls_in_the_reply(tiny_llm, text):
    """tool_choice "auto": the reply (forced here by a grammar) comes back as tool_calls when it
    is calls, else as content; streamed, the same."""
    gbnf = "root ::= " + json.dumps(text)
    args = dict(tools=TOOLS, grammar=gbnf, temperature=0, max_tokens=200)
    whole = tiny_llm.create_chat_completion([{"role": "user", "content": "x"}], **args)["choices"][0]
    chunks = [c["choices"][0] for c in tiny_llm.create_chat_completion([{"role": "user", "content": "x"}],
                                                                       stream=True, **args)]
    want = FORCED[text]
    if want is None:
        assert whole["message"] == {"role": "assistant", "content": text} and whole["finish_reason"] == "stop"
        assert "".join(c["delta"].get("content") or "" for c in chunks) == text
        assert chunks[-1]["finish_reason"] == "stop"
        return
    assert whole["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == want
    calls = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(i, n, a) for i, (n, a) in enumerate(want)]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert not any(c["delta"].get("content") for c in chunks)


def test_tools_reach_the_template(tiny_llm):
    """A template that reads tools gets them, and earlier calls' arguments as objects; one that
    does not (ChatML here) gets them described in the system message and earlier calls as JSON."""
    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    chatml = tiny_llm.detokenize(tiny_llm.chat_prompt(history, tools=[ADD]), special=True).decode()
    system = chatml.split("<|im_start|>system\n", 1)[1].split("<|im_end|>")[0]
    assert "You can call these tools:" in system and json.dumps(ADD["function"]) in system
    assert '<|im_start|>assistant\n{"name": "add", "arguments": {"a": 2, "b": 2}}<|im_end|>' in chatml
    assert "<|im_start|>tool\n4<|im_end|>" in chatml
    template = ("{% for t in tools %}T:{{ t.function.name }};{% endfor %}{% for m in messages %}"
                "{% for c in m.tool_calls or [] %}C:{{ c.function.arguments.a }};{% endfor %}"
                "{{ m.role }}:{{ m.content }};{% endfor %}")
    with Llama(tiny_llm.model_path, vocab_only=True, chat_template=template) as llm:
        text = llm.detokenize(llm.chat_prompt(history, tools=[ADD]), special=True).decode()
    assert text.endswith("T:add;user:2+2?;C:2;assistant:;tool:4;")


@pytest.mark.model
def test_smollm2_calls_the_right_tool(smollm2_path):
    """tool_choice "required" on SmolLM2: each question gets the tool it asks for, with the
    arguments it states, valid under the tool's schema."""
    weather = tool("get_weather", {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}}, "Current weather")
    add = tool("add", {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}, "Add two integers")
    asked = {"What is the weather in Paris?": ("get_weather", {"city": "Paris"}),
             "What is 12 plus 30?": ("add", {"a": 12, "b": 30}),
             "Is it raining in Tokyo?": ("get_weather", {"city": "Tokyo"})}
    with Llama(str(smollm2_path), n_ctx=1024, n_threads=2) as llm:
        for question, (name, stated) in asked.items():
            reply = llm.create_chat_completion([{"role": "user", "content": question}], tools=[weather, add],
                                               tool_choice="required", temperature=0, max_tokens=80)["choices"][0]
            assert reply["finish_reason"] == "tool_calls"
            call = reply["message"]["tool_calls"][0]["function"]
            args = json.loads(call["arguments"])
            assert call["name"] == name and {k: args.get(k) for k in stated} == stated, (question, call)
            jsonschema.validate(args, (weather if name == "get_weather" else add)["function"]["parameters"])


def test_json_whitespace_is_bounded(tiny_llm):
    """Between JSON tokens the call grammar and the JSON object grammar take one space, or one
    newline and at most 12 indentation characters: a finished call cannot be padded."""
    from pykv.grammar import JSON_GBNF, LlamaGrammar
    call = '{"name": "add", "arguments": {"a": 3, "b": 1}}'
    pretty = '{\n  "name": "add",\n  "arguments": {\n    "a": 3,\n    "b": 1\n  }\n}'
    for grammar in (call_grammar([ADD]), LlamaGrammar.from_string(JSON_GBNF)):
        matcher = bind(tiny_llm._model, grammar)
        for text, want in [(call, True), (pretty, True), (call + " ", True), (call + "\n" + "\t" * 12, True),
                           (call + "\n\n", False), (call + "  ", False), (call + "\n" + " " * 13, False),
                           (call + " \n", False), ('{"name":  "add", "arguments": {"a": 3, "b": 1}}', False),
                           ('{"name": "add", "arguments": {"a": 3, "b": 1}\n\n\n}', False)]:
            assert grammar_takes(matcher, text) == want, (grammar.text[:20], text)


def test_call_cut_short_comes_back_as_text(tiny_llm):
    """A required call cut by max_tokens: finish_reason "length", no tool_calls, the text as
    generated in "content"; streamed, the stream ends with "length" too. A whole call still
    comes back as tool_calls."""
    messages = [{"role": "user", "content": "add"}]
    for seed in range(3):
        args = dict(tools=[ADD], tool_choice="required", temperature=1.0, seed=seed, max_tokens=38)
        tiny_llm.reset()
        whole = tiny_llm.create_chat_completion(messages, **args)["choices"][0]
        assert whole["finish_reason"] == "length"
        assert "tool_calls" not in whole["message"] and "function_call" not in whole["message"]
        text = tiny_llm.detokenize(tiny_llm.last_result.tokens).decode()
        # the name has come (the old reply was a call with broken arguments), the call has not ended
        assert whole["message"]["content"] == text and '"arguments"' in text
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)
        tiny_llm.reset()
        chunks = [c["choices"][0] for c in tiny_llm.create_chat_completion(messages, stream=True, **args)]
        assert chunks[-1]["finish_reason"] == "length"
    legacy = tiny_llm.create_chat_completion(messages, functions=[ADD["function"]], function_call={"name": "add"},
                                             temperature=1.0, seed=0, max_tokens=38)["choices"][0]
    assert legacy["finish_reason"] == "length" and "function_call" not in legacy["message"]
    # a stop string that cuts the call: text too, with finish_reason "stop"
    cut = tiny_llm.create_chat_completion(messages, tools=[ADD], tool_choice="required", temperature=1.0, seed=0,
                                          max_tokens=400, stop=['"arguments"'])["choices"][0]
    assert cut["finish_reason"] == "stop" and "tool_calls" not in cut["message"]
    assert cut["message"]["content"].startswith('{')
