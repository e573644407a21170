"""vLLM as a benchmark peer: its offline engine and its server, run from another installation (its own
venv: `--vllm-python PATH`), so that Pagoda and vLLM are measured one after the other in one run, on the
same model directory and requests. vLLM is never imported here; it is a peer, not a dependency.

vLLM's CPU build is run as its docs advise: on all cores (`VLLM_CPU_OMP_THREADS_BIND`, none reserved),
with Intel OpenMP preloaded when the installation has it, and a KV cache of `VLLM_CPU_KVCACHE_SPACE` GiB.
"""

import functools
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

OFFLINE_SCRIPT = Path(__file__).with_name("vllm_offline_peer.py")
LORA_OFFLINE_SCRIPT = Path(__file__).with_name("vllm_lora_offline_peer.py")
# the served peer's --max-model-len unless a load needs more (bench.serve.peer_max_model_len): the matrix's loads
# all fit it, and its figures were measured at it
PEER_MAX_MODEL_LEN = 2048


@functools.cache  # once a process: the argument check and the run ask alike, and importing vllm takes seconds
def check_vllm_python(python: str) -> str:
    """The interpreter path, or SystemExit naming --vllm-python when it cannot import vllm."""
    path = Path(python)
    if path.is_dir():
        path = path / "bin" / "python"
    try:
        subprocess.run([str(path), "-c", "import vllm"], check=True, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise SystemExit(f"--vllm-python {python}: cannot import vllm with this interpreter ({e})") from None
    return str(path)


# Makes torch report no AVX-512 (nor AVX512-BF16, VNNI, AMX) to the peer, so that vLLM loads its AVX2 build
# (it chooses by these) as it would on an AVX2 CPU; torch's own libraries are capped by the environment that
# pagoda.platform.force_level set, which the peer inherits.
_AVX2_SHIM = """\
import torch.cpu
for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
"""


def _forced_level_shim() -> str | None:
    """A directory holding a sitecustomize that shows the peer this process's forced ISA level, or None at the
    native level. Only avx2 is emulated (vLLM's x86 builds are avx512bf16, avx512 and avx2)."""
    from pagoda import platform

    isa = platform.cpu_isa()
    if not isa.forced or isa.level == isa.best:
        return None
    if isa.level != "avx2":
        raise SystemExit(f"the vLLM peer cannot be run at the forced ISA level {isa.level!r}: only avx2 is emulated")
    shim = Path(tempfile.gettempdir()) / "pagoda-vllm-peer-avx2"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(_AVX2_SHIM)
    return str(shim)


def best_dtype(level: str) -> str:
    """vLLM's fastest dtype on a CPU at this ISA level: bfloat16 where the CPU computes in it (AVX512-BF16, ARM's
    BF16), else float32 (on AVX2, vLLM's bfloat16 converts every weight and ran 3.7x slower, docs/benchmarks.md)."""
    return "bfloat16" if level in ("avx512bf16", "neonbf16") else "float32"


def peer_env(python: str, kv_cache_gib: int = 2) -> dict[str, str]:
    """vLLM's environment: all cores, Intel OpenMP, and the ISA level this process runs at (forced or native)."""
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    venv = Path(python).parent.parent  # <venv>/bin/python, not resolved: the venv's python is a symlink
    iomp = next(iter(sorted(venv.rglob("libiomp5.so"))), None)
    if iomp is not None:
        env["LD_PRELOAD"] = str(iomp)
    env.pop("PYTHONPATH", None)  # Pagoda's path must not shadow the peer's packages
    shim = _forced_level_shim()
    if shim is not None:
        env["PYTHONPATH"] = shim
    return env


def _run_script(python: str, script: Path, spec: dict, what: str) -> dict:
    """One of the peer scripts on `spec` (a JSON file) in a child process: the dict it prints."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run([python, str(script), f.name], env=peer_env(python), capture_output=True, text=True,
                              timeout=3600)
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_PEER_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _requests(requests) -> list[dict]:
    return [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in requests]


def run_offline(python: str, model: str, requests, *, dtype: str, seed: int, max_num_seqs: int,
                max_model_len: int) -> dict:
    """The workload through vllm.LLM in a child process: {"seconds", "startup_seconds", "output_tokens"}."""
    spec = {"model": model, "dtype": dtype, "seed": seed, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
            "requests": _requests(requests)}
    return _run_script(python, OFFLINE_SCRIPT, spec, "the vLLM peer")


def run_lora_offline(python: str, model: str, requests, adapter_paths: list[str], *, dtype: str, seed: int,
                     max_num_seqs: int, max_model_len: int, max_loras: int, rank: int) -> dict:
    """`pagoda bench lora`'s batch through vllm.LLM(enable_lora=True) in a child process, the adapters spread
    round-robin over the requests (none: the base model): {"seconds", "startup_seconds", "output_tokens",
    "median_tpot_ms"}."""
    spec = {"model": model, "dtype": dtype, "seed": seed, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
            "max_loras": max_loras, "max_lora_rank": rank, "adapters": adapter_paths, "requests": _requests(requests)}
    return _run_script(python, LORA_OFFLINE_SCRIPT, spec, "the vLLM LoRA peer")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_server(python: str, model: str, served_name: str, *, dtype: str = "bfloat16",
                max_model_len: int = PEER_MAX_MODEL_LEN,
                kv_cache_dtype: str | None = None, kv_cache_gib: int = 2, startup_timeout: float = 600):
    """`vllm serve` on a free port, yielding its base URL; stopped (its whole process group) on exit."""
    import httpx

    port = _free_port()
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", model, "--dtype", dtype, "--max-model-len",
           str(max_model_len), "--port", str(port), "--host", "127.0.0.1", "--served-model-name", served_name,
           "--no-enable-prefix-caching"] + (["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype else [])
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="vllm-peer-", delete=False)
    proc = subprocess.Popen(cmd, env=peer_env(python, kv_cache_gib), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    restore_sigterm = _sigterm_exits()
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not ready after {startup_timeout:.0f} s (log: {log.name})")
            time.sleep(1)
        yield base_url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        os.unlink(log.name)
        restore_sigterm()


def _sigterm_exits():
    """Make SIGTERM to this process raise SystemExit, so that the peer's `finally` stops it (it runs in its own
    session, which a signal to ours does not reach); returns what puts the previous handler back."""
    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's only
        return lambda: None

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    return lambda: signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
