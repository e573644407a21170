"""LLM lifecycle: building TP=2 and PP=2 engines one after another in one process works (no "default
process group initialised twice"), every one gives transformers' greedy tokens, `del` releases workers,
process group and ports, and nothing leaks (no resource_tracker warning, no child left behind)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import load_hf_reference
from transformers import AutoTokenizer

pytestmark = pytest.mark.distributed

PROMPT = "Hello, my name is"


def hf_greedy(path: Path, max_tokens: int = 8) -> list[int]:
    tok = AutoTokenizer.from_pretrained(path)
    model = load_hf_reference(path)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_engines_one_after_another_in_one_process(tiny_model_factory):
    model_a = tiny_model_factory("llama", num_layers=3, num_kv_heads=1)
    model_b = tiny_model_factory("qwen2")
    script = Path(__file__).parent / "lifecycle_script.py"
    proc = subprocess.run([sys.executable, str(script), str(model_a), str(model_b), PROMPT],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(runs) == 5, proc.stdout
    expected = {str(model_a): hf_greedy(model_a), str(model_b): hf_greedy(model_b)}
    for run in runs:
        assert run["tokens"] == expected[run["model"]], run
    assert "leaked" not in proc.stderr, proc.stderr[-4000:]
    assert "initialize the default process group twice" not in proc.stderr
