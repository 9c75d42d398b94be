"""The scheduler's tokenizer: a Hugging Face `tokenizers` tokenizer plus the chat
template, both built from the strings an executor's Describe returns.

Chat templates are Jinja2 rendered the way transformers renders them (sandboxed
environment, trim_blocks, lstrip_blocks, `raise_exception`, `strftime_now`, a
`tojson` that keeps non-ASCII and takes indent/separators/sort_keys, and the
`bos_token`/`eos_token` variables), then encoded without adding special tokens
again, since the template already writes them.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` and renders its body.

    Some templates mark assistant text with this tag for transformers'
    assistant-token masks; we only need the text.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _namespace(*args: Any, **kwargs: Any) -> jinja2.utils.Namespace:
    # A namespace with underscore names could reach interpreter internals.
    attrs = dict(*args, **kwargs)
    if any(str(name).startswith("_") for name in attrs):
        raise jinja2.exceptions.SecurityError("namespace attribute names must not start with '_'")
    return jinja2.utils.Namespace(attrs)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles a chat template in a sandbox configured like transformers'.

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _namespace
    return env.from_string(source)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Returns plain copies of the messages, or raises ValueError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is not an object with role and content")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i}: role must be a non-empty string")
        if not isinstance(content, str):
            raise ValueError(f"message {i}: content must be a string")
        checked.append(dict(message))
    return checked


class Tokenizer:
    """Encodes, decodes and applies the chat template of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token or None
        self.eos_token = eos_token or None
        self.chat_template = chat_template or None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self._template: jinja2.Template | None = None
        self._template_error: str | None = None
        if self.chat_template is not None:
            try:
                self._template = compile_chat_template(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                # Serving plain prompts still works; chat requests get the error.
                self._template_error = f"the model's chat template does not parse: {e}"

    @classmethod
    def from_info(
        cls,
        tokenizer_json: str,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
    ) -> Tokenizer:
        """Builds the tokenizer from Describe's strings (empty string = absent).

        Raises:
            ValueError: tokenizer_json is empty or not a valid tokenizer.
        """
        if not tokenizer_json:
            raise ValueError("the executor sent no tokenizer_json")
        try:
            backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON.
            raise ValueError(f"invalid tokenizer_json: {e}") from e
        return cls(backend, chat_template, bos_token, eos_token)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` tokenizer, for code that needs its decoder or vocabulary directly."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens applies the post-processor (e.g. BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (ids outside the vocabulary decode to nothing)."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        """Whether token_id is a special added token (skipped when decoding)."""
        return token_id in self.special_ids

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> str:
        """The chat template's text for messages (and ``tools``, OpenAI's tool definitions, as Hugging Face does).

        Raises:
            ValueError: no chat template, malformed messages, or the template
                rejected the conversation (its raise_exception message is kept).
        """
        if self._template is None:
            raise ValueError(self._template_error or "the model has no chat template")
        checked = _check_messages(messages)
        try:
            return self._template.render(
                messages=checked,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except Exception as e:  # Template code is data: any failure is a bad request.
            raise ValueError(f"chat template error: {e}") from e

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes the special tokens).

        Raises:
            ValueError: as render_chat.
        """
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)
