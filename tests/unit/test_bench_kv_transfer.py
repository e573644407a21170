"""`pagoda bench kv-transfer`: two processes with NIXL agents (UCX, DRAM) at a tiny KV layout; the decode side
READs blocks of the prefill side's cache through the engine's NixlConnectorWorker, checks what arrived and
reports GB/s and latency per size."""

import json
import subprocess
import sys

import pytest
import torch

from pagoda.bench import kv_transfer

pytestmark = pytest.mark.unit

TINY = ["--num-layers", "2", "--num-kv-heads", "2", "--head-size", "8", "--block-size", "4", "--dtype", "float16"]


def test_the_command_reads_blocks_between_two_processes(tmp_path):
    out = tmp_path / "kv.json"
    run = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "kv-transfer", *TINY,
                          "--blocks", "1", "3", "--iters", "3", "--warmup", "1", "--output-json", str(out)],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "GB/s" in run.stdout and "DRAM -> DRAM" in run.stdout
    report = json.loads(out.read_text())
    block_bytes = 2 * 2 * 2 * 4 * 8 * 2  # layers x (K, V) x KV heads x block size x head size x fp16
    assert report["block_bytes"] == block_bytes and report["mem_type"] == "DRAM" and report["backend"] == "UCX"
    assert [r["blocks"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert r["bytes"] == r["blocks"] * block_bytes and r["iters"] == 3
        assert r["descriptors"] == r["blocks"] * 2 * 2  # one per layer, plane and block, as a pull posts
        assert r["gb_per_s"] > 0 and 0 < r["latency_ms_p50"] <= r["latency_ms_p90"]


def test_a_read_that_moved_nothing_is_an_error_not_a_figure():
    layout = {"num_layers": 1, "num_kv_heads": 1, "head_size": 4}
    caches = kv_transfer._caches(layout, 4, 2, "float16", "cpu")
    with pytest.raises(RuntimeError, match="block 0: not the source's block 3"):
        kv_transfer._check(caches, [0], [3])
    caches[0][:, 0].fill_(3)
    kv_transfer._check(caches, [0], [3])


@pytest.mark.parametrize("argv, message", [
    (["--blocks", "0"], "--blocks"),
    (["--warmup", "-1"], "--warmup"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "torch.cuda is not available")]))
def test_bad_flags_are_usage_errors(argv, message, capsys):
    flags = TINY if argv[0] != "--model" else []
    with pytest.raises(SystemExit) as exit_:
        kv_transfer.parse_args([*flags, *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
