"""`pagoda bench kernels`: argument parsing, the one-line skip without CUDA, and a whole run on tiny shapes
with the CPU standing in for the GPU (kernels interpreted, wall-clock timing), so that the code which will
first run on a GPU has at least run once."""

import json
import time

import pytest
import torch

from pagoda.attention import triton_backend
from pagoda.bench import kernels as bench
from pagoda.entrypoints import cli

pytestmark = pytest.mark.kernels


def test_defaults_cover_the_issue_shapes():
    args = bench.parse_args([])
    assert args.layouts == ["llama3-8b", "llama3-70b-tp8"]
    assert min(args.batch_sizes) == 1 and max(args.batch_sizes) == 256
    assert min(args.context_lens) == 128 and max(args.context_lens) == 32768
    assert bench.LAYOUTS["llama3-8b"][:3] == (32, 8, 128) and bench.LAYOUTS["llama3-70b-tp8"][:3] == (8, 1, 128)
    assert args.kernels == list(bench.KERNELS)


def test_argument_errors(capsys):
    for argv in (["--kernels", "matmul"], ["--batch-sizes", "0"], ["--iters", "0"], ["--block-size", "8"]):
        with pytest.raises(SystemExit) as exit_info:
            bench.parse_args(argv)
        assert exit_info.value.code == 2
    assert "--batch-sizes must all be >= 1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run")
def test_skips_without_cuda(capsys):
    assert cli.main(["bench", "kernels", "--iters", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "skipped: no CUDA device" in out[0]


def test_cache_cap_skips_large_shapes():
    args = bench.parse_args(["--batch-sizes", "1", "256", "--context-lens", "128", "32768", "--max-cache-gib", "1"])
    cases = list(bench.attention_cases("decode", "llama3-8b", args, torch.bfloat16))
    skipped = [shape for shape, query_lens, _ in cases if query_lens is None]
    assert skipped == ["batch 256 q     1 ctx 32768"]  # 32 GiB of KV cache


def test_decode_summary_against_the_aim():
    def result(pct, note="dispatch", ctx=16384):
        return bench.Result("decode", "llama3-8b", "split-K", f"batch   1 q     1 ctx {ctx:>5}", 10.0, 1.0, pct,
                            0.0, 0.0, None, note)

    assert bench.summarize_decode([result(55, note=""), result(80, ctx=1024)]) is None
    assert "75%..82% of peak bandwidth" in bench.summarize_decode([result(82), result(75), result(10, note="")])
    assert bench.summarize_decode([result(82), result(60)]).endswith("misses the 70% aim")


def test_whole_run_on_a_cpu_stand_in(monkeypatch, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("runs the CPU stand-in only where there is no GPU")

    def wall_clock(fn, warmup, iters, flush):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    class NoFlush:
        def __call__(self):
            pass

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "time_cuda", wall_clock)
    monkeypatch.setattr(bench, "L2Flush", NoFlush)
    monkeypatch.setattr(bench, "free_memory", lambda: 2**34)
    monkeypatch.setattr(triton_backend, "SPLIT_K_PARTITION_SIZE", 64)  # so a 160-long context has a split-K row
    out_file = tmp_path / "kernels.json"
    args = bench.parse_args(["--batch-sizes", "1", "2", "--context-lens", "160", "--prefill-chunk", "32",
                             "--max-batched-tokens", "64", "--dtype", "float16", "--iters", "1",
                             "--json", str(out_file)])
    results = bench.run(args, bench.Peaks("cpu stand-in", 10.0, 0.1, "given"))
    printed = capsys.readouterr().out
    assert bench.HEADER in printed
    seen = {(r.kernel, r.layout, r.variant) for r in results}
    for layout in bench.LAYOUTS:
        for kernel in ("prefill", "mixed", "kv-write", "rmsnorm", "rotary"):
            assert any(k == kernel and lay == layout for k, lay, _ in seen), (kernel, layout)
        assert ("decode", layout, "one-pass") in seen and ("decode", layout, "split-K/64") in seen
    assert all(r.microseconds > 0 and r.gbs > 0 and r.torch_microseconds for r in results)
    assert sum(r.note == "dispatch" for r in results if r.kernel == "decode") == 4  # one per decode shape
    saved = json.loads(out_file.read_text())
    assert saved["device"]["name"] == "cpu stand-in" and len(saved["results"]) == len(results)
