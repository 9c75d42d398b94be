"""``pagoda serve``'s pass-through flags: defined once in the services' configs, routed to the right children."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from executor_svc.config import ExecutorConfig
from pagoda.launch.serve import add_serve_arguments, launcher_from_args
from pagoda.launch.serve_flags import serve_flags
from pagoda_client.cli import build_parser
from scheduler_svc.config import SchedulerServiceConfig


def _launcher(*argv: str):
    args, unknown = build_parser().parse_known_args(["serve", "--kv-offload-dir", "", *argv])
    return launcher_from_args(args, unknown)


def _value_after(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_a_flag_of_both_services_reaches_every_executor_and_every_scheduler():
    launcher = _launcher("--executors", "2", "--schedulers", "2", "--otlp-endpoint", "http://127.0.0.1:4317")
    for child in [*launcher.executors, *launcher.schedulers]:
        assert _value_after(child.argv, "--otlp-endpoint") == "http://127.0.0.1:4317", child.name


def test_each_service_gets_only_its_own_flags_and_unknown_ones_go_to_the_scheduler():
    launcher = _launcher("--dtype", "bfloat16", "--kv-cache-memory", "1GiB", "--max-num-seqs", "8", "--foo", "1")
    (executor,), (scheduler,) = launcher.executors, launcher.schedulers
    assert _value_after(executor.argv, "--dtype") == "bfloat16"
    assert _value_after(executor.argv, "--kv-cache-memory") == "1GiB"  # as given, not re-formatted
    assert "--max-num-seqs" not in executor.argv and "--foo" not in executor.argv
    assert _value_after(scheduler.argv, "--max-num-seqs") == "8" and _value_after(scheduler.argv, "--foo") == "1"
    assert "--dtype" not in scheduler.argv


def test_the_model_is_given_once_and_a_bare_boolean_passes_as_true():
    launcher = _launcher("--model", "/models/m", "--enable-prefix-caching")
    (executor,), (scheduler,) = launcher.executors, launcher.schedulers
    assert executor.argv.count("--model") == 1 and _value_after(executor.argv, "--model") == "/models/m"
    assert _value_after(scheduler.argv, "--enable-prefix-caching") == "true"


def test_a_repeated_flag_reaches_every_executor_each_time_given():
    launcher = _launcher("--executors", "2", "--lora", "a=/adapters/a", "--lora", "b=/adapters/b", "--max-loras", "2")
    for executor in launcher.executors:
        lora_values = [executor.argv[i + 1] for i, arg in enumerate(executor.argv) if arg == "--lora"]
        assert lora_values == ["a=/adapters/a", "b=/adapters/b"] and _value_after(executor.argv, "--max-loras") == "2"
    assert "--lora" not in launcher.schedulers[0].argv  # the executors register them; the scheduler learns them
    assert ExecutorConfig.__dataclass_fields__["lora"].metadata["repeat"]


def test_a_repeatable_flag_is_a_tuple_from_flags_or_a_comma_separated_variable():
    from executor_svc.config import load_config
    from pagoda.runtime.flags import parse_config

    assert load_config(["--lora", "a=/x", "--lora", "b=/y"]).lora == ("a=/x", "b=/y")
    assert load_config([]).lora == ()
    config = parse_config(ExecutorConfig, [], "pagoda-executor", "", environ={"PAGODA_LORA": "a=/x,b=/y"})
    assert config.lora == ("a=/x", "b=/y")


def test_serve_checks_values_with_the_services_own_rules(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_known_args(["serve", "--otlp-endpoint", "collector:4317"])
    assert "http://HOST:PORT (plaintext) or https://HOST:PORT (TLS)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_known_args(["serve", "--kv-cache-memory", "lots"])
    assert "not a size: 'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_known_args(["serve", "--lora", "no-path"])
    assert "--lora takes NAME=PATH (a PEFT adapter folder), not 'no-path'" in capsys.readouterr().err


def test_every_serve_flag_has_the_help_of_its_config_field():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    configs = {"executor": ExecutorConfig, "scheduler": SchedulerServiceConfig}
    for flag in serve_flags():
        (field,) = [f for f in dataclasses.fields(configs[flag.services[0]]) if f.name == flag.name]
        assert helps[flag.flag] == field.metadata["help"].replace("%", "%%")
    names = [flag.name for flag in serve_flags()]
    assert {"otlp_endpoint", "log_format", "dtype", "max_num_seqs"} <= set(names)
    assert len(names) == len(set(names))


def test_a_field_of_both_configs_marked_serve_is_one_definition():
    """Fields both services pass from `pagoda serve` mean one thing: the same help and default in both."""
    executor = {f.name: f for f in dataclasses.fields(ExecutorConfig)}
    for field in dataclasses.fields(SchedulerServiceConfig):
        other = executor.get(field.name)
        if other is not None and (field.metadata.get("serve") and other.metadata.get("serve")):
            assert field.metadata == other.metadata and field.default == other.default, field.name
