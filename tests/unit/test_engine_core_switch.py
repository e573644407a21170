"""PAGODA_ENABLE_ENGINE_CORE_PROCESS: 1 or 0 whatever the device; unset, on with a GPU and off on a CPU; any
other value is an error naming the variable."""

import pytest

from pagoda.engine.core_client import ENV, engine_core_process_enabled

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("value", "device", "expected"), [
    (None, "cpu", False), (None, "cuda", True), (None, "cuda:1", True),
    ("1", "cpu", True), ("true", "cpu", True), ("0", "cuda", False), ("off", "cuda", False),
])
def test_the_switch_and_its_default(monkeypatch, value, device, expected):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert engine_core_process_enabled(device) is expected


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ValueError, match=ENV):
        engine_core_process_enabled("cpu")
