"""The tokenizer side of a checkpoint: tokenizer.json, chat template, special tokens.

Reads a Hugging Face checkpoint folder (or takes a loaded GGUF) and returns the
plain strings and ids the scheduler needs; no tokenization happens here.

Where things live in a Hugging Face folder:
- `tokenizer.json`: the `tokenizers` document.
- chat template: `chat_template` in tokenizer_config.json (a string, or a list of
  `{"name", "template"}` of which "default" is used), else `chat_template.jinja`.
- bos/eos tokens: tokenizer_config.json (strings, or AddedToken dicts with "content").
- eos ids: generation_config.json `eos_token_id` (int or list), else config.json's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import TYPE_CHECKING, Any

from pagoda.by_name import copy_by_name

if TYPE_CHECKING:
    from executor_svc.loading.gguf_tokenizer import GgufTokenizer


class TokenizerFilesError(ValueError):
    """A checkpoint folder whose tokenizer files are missing or malformed."""


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    """What a scheduler needs to tokenize and detokenize for a model."""

    # A complete Hugging Face `tokenizers` JSON document.
    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    # Token ids that end generation.
    eos_token_ids: tuple[int, ...]


def read_tokenizer_files(model_dir: str | os.PathLike[str]) -> TokenizerFiles:
    """Reads tokenizer.json, the chat template and special tokens of a checkpoint folder.

    Raises:
        TokenizerFilesError: no tokenizer.json, or a malformed JSON file.
    """
    folder = pathlib.Path(model_dir)
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise TokenizerFilesError(f"{folder}: no tokenizer.json")
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    return TokenizerFiles(
        tokenizer_json=tokenizer_path.read_text(encoding="utf-8"),
        chat_template=_chat_template(folder, tokenizer_config),
        bos_token=_token_content(tokenizer_config.get("bos_token")),
        eos_token=_token_content(tokenizer_config.get("eos_token")),
        eos_token_ids=_eos_token_ids(folder),
    )


def from_gguf(model: Any) -> TokenizerFiles:
    """The tokenizer files of a loaded GGUF model (``gguf_loader.GgufModel``: it carries them under the same
    names; not imported here, since the loader imports this module)."""
    return copy_by_name(TokenizerFiles, model)


def from_gguf_metadata(metadata: dict[str, Any], built: GgufTokenizer | None = None) -> TokenizerFiles:
    """The tokenizer files of a GGUF file's metadata; ``built``: its tokenizer, when already built from it."""
    from executor_svc.loading import gguf_tokenizer

    built = built or gguf_tokenizer.build_tokenizer(metadata)
    return copy_by_name(TokenizerFiles, built, chat_template=metadata.get("tokenizer.chat_template"))


def from_gguf_file(path: str | os.PathLike[str]) -> TokenizerFiles:
    """The tokenizer files of a GGUF file, from its metadata only (no weights read)."""
    from executor_svc.loading.gguf_reader import read_metadata

    return from_gguf_metadata(read_metadata(path))


def load_tokenizer_files(model_path: str | os.PathLike[str]) -> TokenizerFiles:
    """The tokenizer of a checkpoint folder or of a .gguf file.

    For a GGUF file, a tokenizer.json beside it wins (with that folder's
    tokenizer_config.json etc.); otherwise the tokenizer comes from the GGUF metadata.
    """
    path = pathlib.Path(model_path)
    if path.is_dir():
        return read_tokenizer_files(path)
    if (path.parent / "tokenizer.json").is_file():
        return read_tokenizer_files(path.parent)
    return from_gguf_file(path)


def vocabulary(tokenizer_json: str) -> dict[int, str]:
    """Token id -> token of a `tokenizers` document: its model's vocabulary and its added tokens.

    Raises:
        TokenizerFilesError: not a tokenizer document.
    """
    try:
        document = json.loads(tokenizer_json)
        vocab = document["model"]["vocab"]
        # BPE and WordPiece map tokens to ids; Unigram lists [piece, score] in id order.
        tokens = (
            {int(i): t for t, i in vocab.items()} if isinstance(vocab, dict) else dict(enumerate(p for p, _ in vocab))
        )
        tokens.update({int(added["id"]): added["content"] for added in document.get("added_tokens") or ()})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TokenizerFilesError(f"not a tokenizer document ({type(exc).__name__}: {exc})") from exc
    return tokens


def vocabulary_difference(tokenizer_json: str, other_json: str) -> str | None:
    """How two tokenizers' vocabularies differ (None: the same id means the same token in both)."""
    ours, theirs = vocabulary(tokenizer_json), vocabulary(other_json)
    if ours == theirs:
        return None
    if len(ours) != len(theirs):
        return f"{len(theirs)} tokens instead of {len(ours)}"
    token_id = min(i for i in ours.keys() | theirs.keys() if ours.get(i) != theirs.get(i))
    return f"token {token_id} is {theirs.get(token_id)!r} instead of {ours.get(token_id)!r}"


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TokenizerFilesError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise TokenizerFilesError(f"{path}: expected a JSON object")
    return value


def _chat_template(folder: pathlib.Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The chat template: tokenizer_config.json first, then chat_template.jinja."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return None


def _token_content(token: Any) -> str | None:
    """A special token given as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _eos_token_ids(folder: pathlib.Path) -> tuple[int, ...]:
    """eos ids from generation_config.json, falling back to config.json."""
    for name in ("generation_config.json", "config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        return tuple(dict.fromkeys(int(i) for i in ids))
    return ()
