"""The vLLM peer at a forced ISA level: `pagoda bench ... --isa avx2 --vllm-python` must run vLLM as it runs
on an AVX2 CPU, or the ratio compares Pagoda's AVX2 kernels with vLLM's AVX-512 ones. vLLM picks its kernel
build by what torch.cpu reports, so the peer's environment carries a sitecustomize that reports no AVX-512,
and the torch library caps that the forced level set."""

import os
import signal
import subprocess
import sys
import time

import pytest

from pagoda import platform
from pagoda.bench import vllm_peer
from pagoda.platform import isa as cpu_isa

pytestmark = pytest.mark.unit

PROBE = "import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported())"


@pytest.fixture
def restore_level():
    """force_level writes os.environ itself: the whole environment is put back, or a forced level (and the
    torch library caps) would leak into every later test of this process."""
    saved = dict(os.environ)
    for name in ("PAGODA_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                 "DNNL_MAX_CPU_ISA", "PYTHONPATH"):
        os.environ.pop(name, None)
    platform.cpu_isa.cache_clear()
    yield
    os.environ.clear()
    os.environ.update(saved)
    platform.cpu_isa.cache_clear()


def probe(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif("avx2" not in cpu_isa.detect("native").executable_levels
                    or cpu_isa.detect("native").best == "avx2", reason="needs a CPU above AVX2 to force avx2 on")
def test_the_peer_at_forced_avx2_sees_no_avx512(restore_level):
    platform.force_level("avx2")
    env = vllm_peer.peer_env(sys.executable)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert probe(env) == "False False"


def test_the_peer_at_the_native_level_is_left_alone(restore_level):
    platform.cpu_isa.cache_clear()
    env = vllm_peer.peer_env(sys.executable)
    assert "PYTHONPATH" not in env and "ATEN_CPU_CAPABILITY" not in env


@pytest.mark.skipif("generic" not in cpu_isa.detect("native").executable_levels, reason="x86 only")
def test_a_level_the_peer_cannot_emulate_is_refused(restore_level):
    platform.force_level("generic")
    with pytest.raises(SystemExit, match="only avx2 is emulated"):
        vllm_peer.peer_env(sys.executable)


@pytest.mark.parametrize("level, dtype", [("avx512bf16", "bfloat16"), ("neonbf16", "bfloat16"),
                                          ("avx512", "float32"), ("avx2", "float32"), ("generic", "float32")])
def test_the_peer_runs_at_its_fastest_dtype_for_the_level(level, dtype):
    assert vllm_peer.best_dtype(level) == dtype


def test_a_sigterm_to_the_benchmark_stops_the_peer_it_started(tmp_path):
    # the peer runs in its own session (a signal to the benchmark's does not reach it): the benchmark's SIGTERM
    # must still run the context's `finally`, or a killed benchmark leaves a vLLM server running
    pid_file = tmp_path / "peer.pid"
    fake = tmp_path / "bin" / "python"  # never healthy: the context waits for it until the signal
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 300\n")
    fake.chmod(0o755)
    code = ("from pagoda.bench.vllm_peer import vllm_server\n"
            f"with vllm_server({str(fake)!r}, 'm', 'm', startup_timeout=300):\n    pass\n")
    bench = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(300):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.1)
        peer = int(pid_file.read_text())
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        bench.kill()
    with pytest.raises(ProcessLookupError):
        os.kill(peer, 0)
