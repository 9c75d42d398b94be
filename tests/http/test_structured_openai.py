"""Structured outputs, tool calls and n > 1 with the official ``openai`` client against a real system.

The model is the tiny random Llama with a chat template that takes ``tools``
(built here, Hermes-style: calls as ``<tool_call>{...}</tool_call>``, results as
``role: "tool"`` messages). A random model writes nonsense, so whatever comes
out is what the constraint allowed: every output must parse and validate.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
from support.structured_schemas import SCHEMAS
from support.system import fp32_launcher
from support.tiny_model import build_tiny_model

from pagoda_client import Client, PagodaError
from tests.http.conftest import wait_http_health

pytestmark = pytest.mark.integration

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] is defined %}<|im_start|>assistant\n"
    "{% for call in m['tool_calls'] %}<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>tool\n<tool_response id={{ m['tool_call_id'] | tojson }}>"
    "{{ m['content'] }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    """(launcher, base url) of a system whose chat template takes tools."""
    from pagoda.launch.launcher import free_port

    folder = build_tiny_model(tmp_path_factory.mktemp("tools-model") / "tiny-tools")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    port = free_port()
    logs = tmp_path_factory.mktemp("structured-logs")
    with fp32_launcher(folder, logs, "4MiB", http_port=port, startup_timeout_s=180) as launcher:
        base_url = f"http://127.0.0.1:{port}"
        wait_http_health(base_url)
        yield launcher, base_url


@pytest.fixture(scope="module")
def served(system):
    """(openai client, model id, base url)."""
    _, base_url = system
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)
    return client, client.models.list().data[0].id, base_url


def _chat(served, stream: bool, **body) -> tuple[str, object]:
    """(content, the choice's finish reason) of one chat completion, streamed or not."""
    client, model, _ = served
    body = {"model": model, "messages": USER, "max_tokens": MAX_TOKENS, "temperature": 0, **body}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        return choice.message.content or "", choice.finish_reason
    chunks = list(client.chat.completions.create(stream=True, **body))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), finish[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_twenty_json_schemas_parse_and_validate(served, stream):
    assert len(SCHEMAS) == 20 and len({json.dumps(s) for s in SCHEMAS}) == 20

    def one(schema):
        response_format = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
        return _chat(served, stream, response_format=response_format, temperature=0.8, seed=len(json.dumps(schema)))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, SCHEMAS))
    for schema, (text, finish) in zip(SCHEMAS, results):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_object_parses(served, stream):
    text, finish = _chat(served, stream, response_format={"type": "json_object"}, max_tokens=200)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a random model may open objects until max_tokens: then what it wrote is a prefix of one
        assert finish == "length" and text.startswith("{")


REGEXES = [r"[a-z]{3,8}", r"\d{3}-\d{4}", r"(yes|no|maybe)!", r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}", r"0x[0-9a-f]{2,6}"]
CHOICES = [["red", "green", "blue"], ["The quick fox", "a lazy dog"], ["1 + 1", "2 * 3", "x"]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_regex_and_choice_outputs_match(served, stream):
    cases = [({"regex": r}, r) for r in REGEXES] + [({"choice": c}, c) for c in CHOICES]
    for seed in range(3):
        for spec, expected in cases:
            text, finish = _chat(served, stream, temperature=1.0, seed=seed, extra_body={"structured_outputs": spec})
            assert finish == "stop", (spec, text)
            assert re.fullmatch(expected, text) if isinstance(expected, str) else text in expected


def test_completions_take_the_constraint_too(served):
    client, model, _ = served
    reply = client.completions.create(
        model=model,
        prompt="The quick",
        max_tokens=30,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}},
    )
    assert re.fullmatch("[0-9]{4}", reply.choices[0].text)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_tool_call_round_trip(served, tool_choice):
    """tools sent, a call parsed (arguments valid), the result sent back as role tool, a final answer."""
    client, model, _ = served
    first = client.chat.completions.create(
        model=model, messages=USER, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    final = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER, TIME], tool_choice="none", max_tokens=16, temperature=0
    )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert isinstance(answer.message.content, str)
    # The tool result went through the template: the second prompt is longer by the call and the result.
    assert final.usage.prompt_tokens > first.usage.prompt_tokens


def test_streamed_tool_call_arrives_as_delta_tool_calls(served):
    client, model, _ = served
    body = dict(
        model=model, messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=MAX_TOKENS, temperature=0
    )
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(stream=True, **body))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0]
    assert deltas[0].function.name == whole.function.name and deltas[0].function.arguments == whole.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_auto_tool_choice_parses_a_written_call():
    """tool_choice auto: a call the model writes in the template's syntax is parsed (unit level: a random model
    would not write one)."""
    from scheduler_svc.api.http.tools import ToolStream, parse_calls, parse_tools

    spec = parse_tools([WEATHER], "auto")
    text = (
        'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>'
    )
    content, calls = parse_calls(text, spec)
    assert content == "Let me look." and json.loads(calls[0]["function"]["arguments"])["city"] == "Oslo"
    stream = ToolStream(spec)
    streamed = "".join(stream.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, streamed_calls = stream.finish()
    assert streamed == "Let me look. " and rest == "" and len(streamed_calls) == 1
    plain = ToolStream(spec)
    assert plain.feed("no call <tool") == "no call " and plain.finish() == ("<tool", [])


def _prefix_hits(base_url: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(m) for m in re.findall(r"^\S*prefix_cache_hits_total (\S+)$", text, re.M))


def test_n_choices_have_their_own_seed_streams_and_share_the_prompt(served):
    """Choice i equals a request alone with seed + i; choices 1.. read choice 0's prompt blocks from the cache."""
    client, model, base_url = served
    long_user = [{"role": "user", "content": "Paged attention stores keys and values in fixed-size blocks. " * 12}]
    body = dict(model=model, messages=long_user, max_tokens=12, temperature=1.0, seed=11)
    before = _prefix_hits(base_url)
    reply = client.chat.completions.create(n=3, **body)
    hits = _prefix_hits(base_url) - before
    assert [c.index for c in reply.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**{**body, "seed": 11 + i}) for i in range(3)]
    assert [c.message.content for c in reply.choices] == [a.choices[0].message.content for a in alone]
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens > 128
    # Blocks hold at most 64 tokens here: each later choice found all but the last partial block.
    assert hits >= 2 * (reply.usage.prompt_tokens - 64)
    chunks = list(client.chat.completions.create(n=3, stream=True, **body))
    texts = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    ]
    assert texts == [c.message.content for c in reply.choices]


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
            "response_format",
            "frob",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "dependentSchemas": {}}},
                }
            },
            "response_format",
            "dependentSchemas",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex", ""),
        ({"tools": [WEATHER] * 65}, "tools", "at most 64"),
        ({"n": 9}, "n", "must be in [1, 8]"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]},
            "tools[0].function.parameters",
            "frob",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(served, body, param, words):
    client, model, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=USER, max_tokens=4, **body)
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert words in info.value.message


def test_grpc_library_and_cli_take_the_constraint(system, tmp_path):
    """The same constraints over gRPC: the library's keywords, ``pagoda generate --json-schema FILE``, and the
    INVALID_ARGUMENT of a regex that does not compile."""
    launcher, _ = system
    with Client(launcher.target, timeout=120) as client:
        for seed in range(3):
            text = client.generate("Hi", max_tokens=40, temperature=1.0, seed=seed, regex=r"[a-z]{2,4}-\d\d").text
            assert re.fullmatch(r"[a-z]{2,4}-\d\d", text)
            assert client.generate("Hi", max_tokens=40, seed=seed, temperature=1.0, choice=["on", "off"]).text in (
                "on",
                "off",
            )
        result = client.generate("Hi", max_tokens=MAX_TOKENS, json_schema=SCHEMAS[8])
        jsonschema.validate(json.loads(result.text), SCHEMAS[8])
        with pytest.raises(PagodaError) as info:
            client.generate("Hi", max_tokens=4, regex="(unclosed")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "structured.regex" in info.value.message
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[6]))
    command = [sys.executable, "-m", "pagoda_client.cli", "generate", "Hi", "--target", launcher.target]
    out = subprocess.run(
        [*command, "--max-tokens", str(MAX_TOKENS), "--json-schema", str(schema_file), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    jsonschema.validate(json.loads(json.loads(out.stdout)["text"]), SCHEMAS[6])


def test_a_resumed_constrained_stream_continues_with_the_same_tokens(system):
    """A resume replays the delivered tokens into a new matcher: the rest of the stream is unchanged, so the
    whole output still validates."""
    from pagoda.v1 import generation_pb2_grpc
    from pagoda_client.core.requests import build_generate_request, resume_request

    launcher, _ = system
    options = {"json_schema": SCHEMAS[19], "seed": 5, "temperature": 1.0, "max_tokens": MAX_TOKENS, "request_id": "rz"}
    original = build_generate_request("Hi", options)
    with grpc.insecure_channel(launcher.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        full = [t for r in stub.Generate(original, timeout=120) for t in r.token_ids]
        assert len(full) > 4
        for cut in (1, len(full) // 2, len(full) - 1):
            resumed = resume_request(original, "rz", 5, full[:cut])
            rest = [t for r in stub.Generate(resumed, timeout=120) for t in r.token_ids]
            assert full[:cut] + rest == full
    with Client(launcher.target, timeout=120) as client:
        text = client.detokenize(full)
    jsonschema.validate(json.loads(text), SCHEMAS[19])
