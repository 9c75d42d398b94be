"""Tokenizer and chat template against transformers as the oracle.

Two real tokenizers: a tiny byte-level BPE trained here, and SmolLM2's, rebuilt
from the default model's GGUF by transformers.
"""

from __future__ import annotations

import json

import pytest
import tokenizers
from support.smollm2 import smollm2_tokenizer_info
from support.tiny_model import train_tokenizer
from tokenizers import processors

from scheduler_svc.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TINY_CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "héllo wörld, ça va? 世界你好 🎉🚀 naïve café",
    "def add(x, y):\n    return x + y  # spaces   and tabs\t\n",
    "12345 67890 3.14159 -42 1e10",
]
TINY_SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# Exercises trim_blocks/lstrip_blocks, bos_token, raise_exception, tojson with
# non-ASCII and keyword arguments, namespace, loop controls and {% generation %}.
TINY_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}
<|im_start|>system
{{ {'text': message['content'], 'n': loop.index} | tojson(sort_keys=True, separators=(',', ':')) }}<|im_end|>
    {% elif message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] }}{% endgeneration %}<|im_end|>
    {% else %}
        {% set ns.turns = ns.turns + 1 %}
<|im_start|>user {{ ns.turns }}
{{ message['content'] }}<|im_end|>
    {% endif %}
    {% if message['content'] == 'STOP' %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse. Réponds en français 🇫🇷."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 世界 × 3 🎉?"},
    ],
    [
        {"role": "user", "content": "Fix this:\n\ndef f(x):\n    return  x+1\n"},
        {"role": "assistant", "content": "```python\ndef f(x):\n    return x + 1\n```"},
        {"role": "user", "content": "STOP"},
        {"role": "user", "content": "never rendered by the tiny template"},
    ],
    [{"role": "user", "content": ""}],
]

TEXTS = [
    "Hello world",
    " leading and trailing spaces  ",
    "héllo wörld 世界 🎉🚀 naïve",
    "def add(x, y):\n\treturn x + y\n",
    "<|im_start|>user\nhi<|im_end|>",
    "12345 + 678 = 13023",
    "",
]


def train_tiny_tokenizer() -> str:
    """A byte-level BPE with BOS added by its post-processor, as JSON."""
    tok = train_tokenizer(400, TINY_CORPUS * 10, TINY_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok.to_str()


def oracle(info: tuple[str, str, str, str]):
    tokenizer_json, chat_template, bos, eos = info
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer_json),
        chat_template=chat_template,
        bos_token=bos,
        eos_token=eos,
    )


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def info(request) -> tuple[str, str, str, str]:
    if request.param == "tiny":
        return train_tiny_tokenizer(), TINY_TEMPLATE, "<s>", "</s>"
    return smollm2_tokenizer_info()


@pytest.fixture(scope="module")
def pair(info):
    return Tokenizer.from_info(*info), oracle(info)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_ids_match_transformers(pair, conversation, add_generation_prompt):
    tok, hf = pair
    expected = hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)[
        "input_ids"
    ]
    assert tok.apply_chat_template(conversation, add_generation_prompt) == expected
    text = hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert tok.render_chat(conversation, add_generation_prompt) == text


def test_tiny_template_renders_exactly():
    tok = Tokenizer.from_info(train_tiny_tokenizer(), TINY_TEMPLATE, "<s>", "</s>")
    text = tok.render_chat(CONVERSATIONS[1][:3], add_generation_prompt=True)
    assert text == (
        "<s>\n<|im_start|>system\n"
        '{"n":1,"text":"You are terse. Réponds en français 🇫🇷."}<|im_end|>\n'
        "<|im_start|>user 1\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The template writes <s>; encoding must not add a second one.
    ids = tok.apply_chat_template(CONVERSATIONS[0])
    assert ids[0] == tok.encode("")[0] and ids[1] != ids[0]


def test_smollm2_default_system_prompt():
    tok = Tokenizer.from_info(*smollm2_tokenizer_info())
    text = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_transformers(pair, text, add_special_tokens):
    tok, hf = pair
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    assert ids == hf.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_bos_added_only_with_special_tokens():
    tok = Tokenizer.from_info(train_tiny_tokenizer(), None, "<s>", "</s>")
    bos_id = TINY_SPECIALS.index("<s>")
    assert tok.encode("Hello")[0] == bos_id
    assert tok.encode("Hello") == [bos_id] + tok.encode("Hello", add_special_tokens=False)
    assert tok.decode(tok.encode("Hello")) == "Hello"
    assert tok.decode(tok.encode("Hello"), skip_special_tokens=False) == "<s>Hello"


def test_vocab_size_and_special_ids(pair, info):
    tok, hf = pair
    assert tok.vocab_size == len(hf)
    added = json.loads(info[0])["added_tokens"]
    special_ids = {t["id"] for t in added if t["special"]}
    assert special_ids and tok.special_ids == special_ids
    for token_id in range(tok.vocab_size):
        assert tok.is_special(token_id) == (token_id in special_ids)
    assert not tok.is_special(tok.vocab_size) and not tok.is_special(-1)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "message 0 is not an object"),
        ([{"role": "user"}], "message 0: content must be a string"),
        ([{"role": "user", "content": None}], "content must be a string"),
        ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], "message 1: role"),
        ([{"content": "hi"}], "role must be a non-empty string"),
        ([{"role": "tool", "content": "x"}], "chat template error: Unknown role: tool"),
    ],
)
def test_malformed_messages_raise_value_error(messages, match):
    tok = Tokenizer.from_info(train_tiny_tokenizer(), TINY_TEMPLATE, "<s>", "</s>")
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


@pytest.mark.parametrize("template", [None, ""])
def test_no_chat_template_raises(template):
    tok = Tokenizer.from_info(train_tiny_tokenizer(), template, "<s>", "</s>")
    with pytest.raises(ValueError, match="the model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(tok.encode("still encodes")) == "still encodes"


def test_broken_template_fails_only_chat_requests():
    tok = Tokenizer.from_info(train_tiny_tokenizer(), "{% for m in messages %}", "<s>", "</s>")
    with pytest.raises(ValueError, match="does not parse"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.encode("hi", add_special_tokens=False) != []


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set ns = namespace(__init__=1) %}",
    ],
)
def test_template_sandbox_refuses_internals(template):
    tok = Tokenizer.from_info(train_tiny_tokenizer(), template, "<s>", "</s>")
    with pytest.raises(ValueError, match="chat template error"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("bad_json", ["", "{", '{"model": 3}'])
def test_invalid_tokenizer_json(bad_json):
    with pytest.raises(ValueError, match="tokenizer_json"):
        Tokenizer.from_info(bad_json, None, None, None)


def test_strftime_now_is_available():
    tok = Tokenizer.from_info(train_tiny_tokenizer(), "{{ strftime_now('%Y') }}|{{ messages[0].content }}", None, None)
    text = tok.render_chat([{"role": "user", "content": "x"}])
    year, content = text.split("|")
    assert year.isdigit() and len(year) == 4 and content == "x"
