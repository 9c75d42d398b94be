"""The typed options and the CLI flags follow the ``pagoda.params`` table."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from pagoda import params
from pagoda_client import GenerateOptions, ParamOptions, RequestOptions
from pagoda_client.cli import build_parser, generation_kwargs
from pagoda_client.core.kinds import kind_of
from pagoda_client.options import CALL_OPTION_NAMES
from scripts.gen_client_options import OUT, render


def test_generated_param_options_are_current():
    assert OUT.read_text() == render(), "client/_param_options.py is stale: run make proto"


def test_param_options_have_one_key_per_table_row():
    assert tuple(ParamOptions.__annotations__) == params.names()
    assert set(RequestOptions.__annotations__) == set(params.names()) | CALL_OPTION_NAMES
    assert set(GenerateOptions.__annotations__) - set(RequestOptions.__annotations__) == {"token_ids", "messages"}


def test_unsupported_proto_type_is_refused_by_name():
    row = params.ParamField("grammar", "sampling", "bytes", params.Param(11, "optional bytes", "a grammar"), b"")
    with pytest.raises(ValueError, match="grammar: unsupported proto type 'optional bytes'"):
        kind_of(row)


def test_every_cli_row_has_a_flag_with_its_help():
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    flags = {option: action for action in generate._actions for option in action.option_strings}
    for row in params.fields():
        flag = "--" + row.name.replace("_", "-")
        assert flag in flags, flag
        assert flags[flag].help.startswith(row.spec.help) and flags[flag].dest == row.name


def test_flags_parse_to_the_table_types():
    args = build_parser().parse_args(
        ["generate", "hi", "--logprobs", "2", "--include-stop-str-in-output", "--presence-penalty", "-0.5"]
    )
    kwargs = generation_kwargs(args)
    assert kwargs["logprobs"] == 2 and kwargs["include_stop_str_in_output"] is True
    assert kwargs["presence_penalty"] == -0.5
    assert kwargs["ignore_eos"] is None and kwargs["stop"] is None and kwargs["priority"] is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--top-k", "many"])


@dataclasses.dataclass(frozen=True)
class _Sampling(params.SamplingParams):
    typical_p: float = params.param(1.0, params.Param(10, "optional float", "locally typical sampling mass"))


@dataclasses.dataclass(frozen=True)
class _Stopping(params.StoppingCriteria):
    ignore_eos: bool = params.param(False, params.Param(4, "bool", "keep generating past EOS", cli=False))


def test_a_new_row_gets_a_flag_and_cli_false_hides_one(monkeypatch):
    monkeypatch.setitem(params.PARAM_CLASSES, "sampling", _Sampling)
    monkeypatch.setitem(params.PARAM_CLASSES, "stopping", _Stopping)
    args = build_parser().parse_args(["chat", "hi", "--typical-p", "0.9"])
    kwargs = generation_kwargs(args)
    assert kwargs["typical_p"] == 0.9 and "ignore_eos" not in kwargs
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "hi", "--ignore-eos"])


_SNIPPET = """
from pagoda_client import AsyncClient, Client, RequestOptions


def ok(client: Client) -> str:
    options: RequestOptions = {"temperature": 0, "max_tokens": 8, "stop": "x"}
    text = client.generate(token_ids=[1, 2], seed=1, logprobs=2, ignore_eos=True, request_id="r").text
    return text + client.chat([{"role": "user", "content": "hi"}], **options).text


def bad(client: Client) -> None:
    client.generate("hi", temprature=0.5)  # line 12
    client.generate("hi", max_tokens="ten")  # line 13


async def bad_async(client: AsyncClient) -> None:
    await client.stream("hi", top_k=1.5).__anext__()  # line 17
"""


def test_a_type_checker_knows_every_option(tmp_path):
    pytest.importorskip("mypy")
    from scripts.typecheck import ROOT, link_tree

    (tmp_path / "snippet.py").write_text(_SNIPPET)
    env = {**os.environ, "MYPYPATH": os.pathsep.join([str(link_tree()), str(ROOT)])}
    cache = ROOT / "build" / "mypy-cache-options-test"
    argv = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), str(tmp_path / "snippet.py")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    errors = [line for line in proc.stdout.splitlines() if ": error: " in line]
    assert [int(line.split(":")[1]) for line in errors] == [12, 13, 17], proc.stdout
    assert 'Unexpected keyword argument "temprature"' in errors[0]
    assert 'incompatible type "str"; expected "int | None"' in errors[1]
