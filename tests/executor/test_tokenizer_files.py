"""read_tokenizer_files on tiny checkpoint folders, one per layout variant."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_gguf_loader import TINY_SPECIALS, random_hf_weights, specials, write_tiny_gguf  # noqa: E402

from executor_svc.loading.gguf_loader import GgufModel, load_gguf
from executor_svc.loading.tokenizer_files import (
    TokenizerFiles,
    TokenizerFilesError,
    from_gguf,
    from_gguf_file,
    load_tokenizer_files,
    read_tokenizer_files,
    vocabulary,
    vocabulary_difference,
)

TOKENIZER_JSON = '{"version": "1.0", "model": {"type": "BPE"}}'


def make_folder(root: pathlib.Path, **files: object) -> pathlib.Path:
    """A folder with tokenizer.json plus the given files (dicts written as JSON)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(TOKENIZER_JSON)
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (root / name.replace("__", ".")).write_text(text)
    return root


def test_string_template_and_string_tokens(tmp_path: pathlib.Path) -> None:
    folder = make_folder(
        tmp_path,
        tokenizer_config__json={"chat_template": "T1", "bos_token": "<s>", "eos_token": "</s>"},
        generation_config__json={"eos_token_id": 7},
        config__json={"eos_token_id": 99},
    )
    assert read_tokenizer_files(folder) == TokenizerFiles(TOKENIZER_JSON, "T1", "<s>", "</s>", (7,))


def test_named_templates_added_token_dicts_and_eos_list(tmp_path: pathlib.Path) -> None:
    folder = make_folder(
        tmp_path,
        tokenizer_config__json={
            "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}],
            "bos_token": {"content": "<|begin|>", "lstrip": False, "special": True},
            "eos_token": {"content": "<|end|>", "rstrip": False},
        },
        generation_config__json={"eos_token_id": [128001, 128009, 128001]},
    )
    files = read_tokenizer_files(folder)
    assert files.chat_template == "DEFAULT"
    assert (files.bos_token, files.eos_token) == ("<|begin|>", "<|end|>")
    assert files.eos_token_ids == (128001, 128009)


def test_jinja_file_and_config_fallback(tmp_path: pathlib.Path) -> None:
    folder = make_folder(
        tmp_path,
        tokenizer_config__json={"eos_token": "</s>"},
        chat_template__jinja="{{ messages }}",
        generation_config__json={"do_sample": True},  # no eos here: config.json's is used
        config__json={"eos_token_id": [2, 3]},
    )
    files = read_tokenizer_files(folder)
    assert (files.chat_template, files.bos_token, files.eos_token, files.eos_token_ids) == (
        "{{ messages }}",
        None,
        "</s>",
        (2, 3),
    )


def test_config_template_wins_over_jinja_file(tmp_path: pathlib.Path) -> None:
    folder = make_folder(tmp_path, tokenizer_config__json={"chat_template": "A"}, chat_template__jinja="B")
    assert read_tokenizer_files(folder).chat_template == "A"


def test_only_tokenizer_json(tmp_path: pathlib.Path) -> None:
    assert read_tokenizer_files(make_folder(tmp_path)) == TokenizerFiles(TOKENIZER_JSON, None, None, None, ())


def test_missing_tokenizer_json_is_an_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(TokenizerFilesError, match="no tokenizer.json"):
        read_tokenizer_files(tmp_path)


def test_malformed_json_names_the_file(tmp_path: pathlib.Path) -> None:
    folder = make_folder(tmp_path, tokenizer_config__json="{not json")
    with pytest.raises(TokenizerFilesError, match="tokenizer_config.json: invalid JSON"):
        read_tokenizer_files(folder)


def test_from_gguf_copies_the_tokenizer_fields() -> None:
    model = GgufModel(
        config={},
        tensors={},
        tokenizer_json=TOKENIZER_JSON,
        chat_template="T",
        bos_token="<b>",
        eos_token="<e>",
        eos_token_ids=(5, 6),
    )
    assert from_gguf(model) == TokenizerFiles(TOKENIZER_JSON, "T", "<b>", "<e>", (5, 6))


def test_gguf_file_tokenizer_without_reading_weights(tmp_path: pathlib.Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", random_hf_weights())
    files = from_gguf_file(path)
    assert files == from_gguf(load_gguf(path))
    assert specials(files) == TINY_SPECIALS
    assert load_tokenizer_files(path) == files


def test_tokenizer_json_beside_a_gguf_wins(tmp_path: pathlib.Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", random_hf_weights())
    make_folder(tmp_path, tokenizer_config__json={"chat_template": "HF"})
    assert load_tokenizer_files(path) == TokenizerFiles(TOKENIZER_JSON, "HF", None, None, ())
    assert load_tokenizer_files(tmp_path) == load_tokenizer_files(path)


def _document(vocab: object, added: list[tuple[int, str]] = ()) -> str:
    added_tokens = [{"id": i, "content": c, "special": True} for i, c in added]
    return json.dumps({"model": {"type": "BPE", "vocab": vocab}, "added_tokens": added_tokens})


def test_vocabularies_compare_by_id_with_added_tokens() -> None:
    """A draft model must read ids as the model does: the vocabulary and the added tokens, not the rest."""
    ours = _document({"a": 0, "b": 1, "ab": 2}, [(3, "<eos>")])
    assert vocabulary(ours) == {0: "a", 1: "b", 2: "ab", 3: "<eos>"}
    reordered = json.dumps(
        {"added_tokens": [{"id": 3, "content": "<eos>"}], "model": {"vocab": {"ab": 2, "a": 0, "b": 1}}}
    )
    assert vocabulary_difference(ours, reordered) is None
    assert vocabulary_difference(ours, _document({"a": 0, "b": 1, "ba": 2}, [(3, "<eos>")])) == (
        "token 2 is 'ba' instead of 'ab'"
    )
    assert vocabulary_difference(ours, _document({"a": 0, "b": 1})) == "2 tokens instead of 4"
    unigram = _document([["a", -1.0], ["b", -2.0], ["ab", -0.5]], [(3, "<eos>")])
    assert vocabulary_difference(ours, unigram) is None
    with pytest.raises(TokenizerFilesError, match="not a tokenizer document"):
        vocabulary('{"model": {}}')
