"""vLLM's POST /tokenize and POST /detokenize: bodies checked, answers built.

Clients of vLLM's server (its `vllm bench serve` among them) count tokens with
these routes, so the shapes are vLLM's: a prompt (`prompt`, add_special_tokens
default true) or a chat (`messages`, add_special_tokens default false, as the
template writes them) → `{count, max_model_len, tokens, token_strs}`; `tokens`
→ `{prompt}`. The tokenizer and chat template are the engine's, the ones
/v1/completions and /v1/chat/completions encode prompts with (as the gRPC
Tokenize does), so a count here is the `usage.prompt_tokens` there. As vLLM,
neither route takes more tokens than the model's context. Nothing here touches
the engine's state: a bad body is a 400 and nothing else.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from scheduler_svc.api.http.errors import bad_request
from scheduler_svc.api.http.protocol import Fields, parse_messages
from scheduler_svc.api.http.tools import parse_tools
from scheduler_svc.request import PromptInput
from scheduler_svc.text.tokenizer import Tokenizer

Json = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TokenizeBody:
    """A /tokenize body."""

    model: str | None
    # Text, or messages with add_generation_prompt and tools.
    prompt: PromptInput
    # Whether the tokenizer's post-processor adds its special tokens (e.g. BOS).
    add_special_tokens: bool
    # Also answer each token's vocabulary string.
    return_token_strs: bool


@dataclasses.dataclass(frozen=True)
class DetokenizeBody:
    """A /detokenize body."""

    model: str | None
    token_ids: tuple[int, ...]


def parse_tokenize(body: Json) -> TokenizeBody:
    """A /tokenize body: exactly one of prompt (a string) and messages (a chat)."""
    f = Fields(body)
    if body.get("messages") is None:
        text = f.get("prompt", "str")
        if text is None:
            raise bad_request("prompt", "prompt (a string) or messages (a chat) is required")
        prompt, add_special_default = PromptInput(text=text), True
    else:
        if body.get("prompt") is not None:
            raise bad_request("messages", "set either prompt or messages, not both")
        tools = parse_tools(body.get("tools"), None)
        prompt = PromptInput(
            messages=parse_messages(body["messages"]),
            add_generation_prompt=f.get("add_generation_prompt", "bool", True),
            tools_json=tools.tools_json if tools is not None else "",
        )
        add_special_default = False
    return TokenizeBody(
        f.get("model", "str"),
        prompt,
        f.get("add_special_tokens", "bool", add_special_default),
        f.get("return_token_strs", "bool", False),
    )


def parse_detokenize(body: Json) -> DetokenizeBody:
    """A /detokenize body: ``tokens``, a list of token ids."""
    f = Fields(body)
    token_ids = f.list_of("tokens", "int")
    if token_ids is None:
        raise bad_request("tokens", "tokens (a list of token ids) is required")
    return DetokenizeBody(f.get("model", "str"), token_ids)


def tokenize_reply(tokenizer: Tokenizer, body: TokenizeBody, max_model_len: int) -> Json:
    """The TokenizeResponse of a checked body."""
    token_ids = _encode(tokenizer, body)
    _check_fits("prompt" if body.prompt.text is not None else "messages", token_ids, max_model_len)
    token_strs = [tokenizer.backend.id_to_token(t) for t in token_ids] if body.return_token_strs else None
    return {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids, "token_strs": token_strs}


def detokenize_reply(tokenizer: Tokenizer, body: DetokenizeBody, max_model_len: int) -> Json:
    """The DetokenizeResponse of a checked body; special tokens are kept, as vLLM decodes them."""
    _check_fits("tokens", body.token_ids, max_model_len)
    bad = next((t for t in body.token_ids if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise bad_request("tokens", f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})")
    return {"prompt": tokenizer.decode(body.token_ids, skip_special_tokens=False)}


def _encode(tokenizer: Tokenizer, body: TokenizeBody) -> list[int]:
    """The text encoded, or the chat rendered as the engine renders it (Engine._tokenize) and then encoded."""
    prompt = body.prompt
    if prompt.text is not None:
        return tokenizer.encode(prompt.text, add_special_tokens=body.add_special_tokens)
    messages = [m.template_fields() for m in prompt.messages or ()]
    tools = json.loads(prompt.tools_json) if prompt.tools_json else None
    try:
        text = tokenizer.render_chat(messages, prompt.add_generation_prompt, tools)
    except ValueError as exc:
        raise bad_request("messages", str(exc)) from None
    return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)


def _check_fits(param: str, token_ids: Sequence[int], max_model_len: int) -> None:
    if len(token_ids) > max_model_len:
        raise bad_request(param, f"{len(token_ids)} tokens, more than the model's context of {max_model_len} tokens")
