"""LLM lifecycle: building TP=2 and PP=2 engines one after another in one process works (no "default
process group initialised twice"), every one gives transformers' greedy tokens, `del` releases workers,
process group and ports, and nothing leaks (no resource_tracker warning, no child left behind)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import hf_greedy

pytestmark = pytest.mark.distributed

PROMPT = "Hello, my name is"


def test_engines_one_after_another_in_one_process(tiny_model_factory):
    model_a = tiny_model_factory("llama", num_layers=3, num_kv_heads=1)
    model_b = tiny_model_factory("qwen2")
    script = Path(__file__).parent / "lifecycle_script.py"
    proc = subprocess.run([sys.executable, str(script), str(model_a), str(model_b), PROMPT],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(runs) == 5, proc.stdout
    expected = {str(m): hf_greedy(m, [PROMPT], 8)[0] for m in (model_a, model_b)}
    for run in runs:
        assert run["tokens"] == expected[run["model"]], run
    assert "leaked" not in proc.stderr, proc.stderr[-4000:]
    assert "initialize the default process group twice" not in proc.stderr
