"""PAGODA_<FLAG> variables: flags win, and a bad variable is an error only for a flag not given."""

from __future__ import annotations

import pytest

from pagoda.entrypoints.cli import build_parser
from pagoda.entrypoints.openai.cli_args import split_args

pytestmark = pytest.mark.unit

# what the kubelet gives a pod when its namespace has a Service named pagoda (enableServiceLinks)
SERVICE_LINKS = {"PAGODA_PORT": "tcp://10.96.0.7:8000", "PAGODA_SERVICE_HOST": "10.96.0.7",
                 "PAGODA_SERVICE_PORT": "8000", "PAGODA_PORT_8000_TCP": "tcp://10.96.0.7:8000"}


def parse(argv: list[str]):
    return split_args(build_parser().parse_args(["serve", *argv]))


def test_a_flag_wins_over_an_invalid_variable(monkeypatch):
    for name, value in SERVICE_LINKS.items():
        monkeypatch.setenv(name, value)
    _, server = parse(["--port", "8000", "--host", "0.0.0.0"])
    assert server.port == 8000


def test_an_invalid_variable_without_its_flag_names_both(monkeypatch):
    monkeypatch.setenv("PAGODA_PORT", "tcp://10.96.0.7:8000")
    with pytest.raises(ValueError, match=r"argument --port: .*'tcp://10.96.0.7:8000' in PAGODA_PORT"):
        parse([])


def test_a_valid_variable_is_the_default(monkeypatch):
    monkeypatch.setenv("PAGODA_PORT", "8123")
    assert parse([])[1].port == 8123
    assert parse(["--port", "9000"])[1].port == 9000
