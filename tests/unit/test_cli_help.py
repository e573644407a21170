"""What the CLI says: every command's --help renders (argparse formats help strings with %, so a bare '%' in one, a
share written "0.2% of the load's", made `pagoda serve --help` raise a TypeError instead of printing), each flag
states its default once (an API key's value never), and a bad model or an empty workload given to a benchmark is a
usage error naming the flag, as `pagoda serve` reports its own."""

from __future__ import annotations

import argparse
import importlib

import pytest

from pagoda.entrypoints.cli import BENCHMARKS, build_parser, main

pytestmark = pytest.mark.unit

# entry points run as `python -m MODULE` (beside `pagoda bench NAME`)
MODULE_MAINS = ["pagoda.bench.cpu_attention", "pagoda.bench.preemption", "pagoda.bench.quantization",
                "pagoda.bench.structured", "pagoda.distributed.allreduce_bench", "pagoda.entrypoints.prebuild_kernels"]


def parsers(parser: argparse.ArgumentParser):
    """parser and every subcommand's parser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


def test_every_pagoda_command_formats_its_help():
    progs = []
    for parser in parsers(build_parser()):
        assert "usage:" in parser.format_help()
        progs.append(parser.prog)
    assert {"pagoda", "pagoda serve", "pagoda router", "pagoda download", "pagoda bench"} <= set(progs)


@pytest.mark.parametrize("benchmark", sorted(BENCHMARKS))
def test_every_benchmark_prints_its_help(benchmark, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", benchmark, "--help"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("module", MODULE_MAINS)
def test_every_module_entry_point_prints_its_help(module, capsys):
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(module).main(["--help"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_a_default_from_the_environment_is_shown_as_given(monkeypatch):
    """A PAGODA_<FLAG> value (the flag's default then) shows beside its variable: a '%' in it is text, not a
    format."""
    monkeypatch.setenv("PAGODA_SERVED_MODEL_NAME", "50%off")
    (serve,) = [p for p in parsers(build_parser()) if p.prog == "pagoda serve"]
    assert "[env PAGODA_SERVED_MODEL_NAME=50%off]" in " ".join(serve.format_help().split())


@pytest.mark.parametrize("model", ["missing", "not-a-model-dir"])
def test_a_bad_model_given_to_a_benchmark_is_a_usage_error(model, tmp_path, capsys):
    (tmp_path / "not-a-model-dir").mkdir()
    assert main(["bench", "throughput", "--model", str(tmp_path / model)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagoda bench throughput: error: model path '{tmp_path / model}' ")
    assert "Traceback" not in err


@pytest.mark.parametrize("environment", [{}, {"PAGODA_REVISION": "v2", "PAGODA_PORT": "9000"}])
def test_each_serve_flag_states_its_default_once(environment, monkeypatch):
    """The PAGODA_<FLAG> parser appends each flag's default to its help (the variable's value, when set)."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    (serve,) = [p for p in parsers(build_parser()) if p.prog == "pagoda serve"]
    formatter = serve._get_formatter()
    for action in serve._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            assert formatter._expand_help(action).count("(default:") <= 1, action.option_strings


def test_the_api_key_from_the_environment_is_not_in_the_help(monkeypatch):
    monkeypatch.setenv("PAGODA_API_KEY", "sk-very-secret")
    (serve,) = [p for p in parsers(build_parser()) if p.prog == "pagoda serve"]
    text = " ".join(serve.format_help().split())
    assert "sk-very-secret" not in text and "[env PAGODA_API_KEY=(set)]" in text


@pytest.mark.parametrize("argv, message", [
    (["throughput", "--num-requests", "0"], "--num-requests must be >= 1; got 0"),
    (["throughput", "--prompt-len", "10", "5"], "--prompt-len MIN MAX needs 1 <= MIN <= MAX; got 10 5"),
    (["parallel", "--output-len", "0", "3"], "--output-len MIN MAX needs 1 <= MIN <= MAX; got 0 3"),
    (["lora", "--num-requests", "0"], "--num-requests must be at least 1, got 0"),
    (["lora", "--adapters", "4", "0"], "--adapters: each count of distinct adapters must be at least 1"),
])
def test_a_benchmark_refuses_an_empty_workload_by_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", *argv])
    assert exited.value.code == 2
    assert f"pagoda bench {argv[0]}: error: {message}" in capsys.readouterr().err
