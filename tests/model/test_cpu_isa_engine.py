"""The whole engine on the CPU paths users without an AVX512-BF16 machine get, each in its own process (the
kernel libraries are built once per process): every C++ kernel off (PAGODA_CPU_KERNELS=0), the lowest ISA
level (generic: plain C++, no -march) and AVX2 (heavy where AVX2 is this host's own level, which every other
test runs at). Greedy tokens equal transformers' (float32), and the start-up log says which kernels run and why."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from checkpoints import hf_greedy

from pagoda.platform import isa as cpu_isa

pytestmark = pytest.mark.model

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog. " * 3, "a"]
MAX_TOKENS = 16
SETTINGS = {
    "kernels-off": {"PAGODA_CPU_KERNELS": "0"},
    "generic": {"PAGODA_CPU_ISA": "generic"},
    "avx2": {"PAGODA_CPU_ISA": "avx2"},
}
# this process's own level: every other engine test runs there already, so forcing it again (a build of its own,
# ~100 s on 2 cores) is heavy, as in tests/kernels/test_cpu_isa_levels.py
OWN_LEVEL = cpu_isa.detect().level
# the host's own detection, whatever PAGODA_CPU_ISA forces here (run_engine's processes drop that variable)
NATIVE = cpu_isa.detect("native")


def run_engine(path, env_overrides: dict, dtype: str = "float32") -> tuple[list[list[int]], str, list[dict]]:
    script = textwrap.dedent(f"""
        import json, logging
        logging.basicConfig(level=logging.INFO)
        from pagoda import LLM, SamplingParams
        llm = LLM({str(path)!r}, dtype={dtype!r}, kv_cache_memory=0.02)
        outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0.0, max_tokens={MAX_TOKENS}, ignore_eos=True,
                                                        logprobs=5), use_tqdm=False)
        print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]))
        print("LOGPROBS", json.dumps([{{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}}
                                      for o in outs]))
    """)
    env = {name: value for name, value in os.environ.items() if name != "PAGODA_CPU_ISA"}
    env.update({"PAGODA_CPU_KERNELS": "1", **env_overrides})
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = dict(x.split(" ", 1) for x in proc.stdout.splitlines() if x.startswith(("TOKENS ", "LOGPROBS ")))
    return json.loads(lines["TOKENS"]), proc.stderr, json.loads(lines["LOGPROBS"])


@pytest.mark.parametrize("setting", [
    pytest.param(setting, marks=pytest.mark.heavy) if SETTINGS[setting].get("PAGODA_CPU_ISA") == OWN_LEVEL
    else setting for setting in SETTINGS])
def test_greedy_tokens_equal_transformers(tiny_model_factory, setting):
    level = SETTINGS[setting].get("PAGODA_CPU_ISA")
    if level and level not in NATIVE.executable_levels:
        pytest.skip(f"this host cannot execute {level}")
    path = tiny_model_factory("llama")
    tokens, log, _ = run_engine(path, SETTINGS[setting])
    assert tokens == hf_greedy(path, PROMPTS, MAX_TOKENS)
    plan = next(line for line in log.splitlines() if "CPU kernels:" in line)
    if setting == "kernels-off":
        assert "torch attention and ops" in plan and "PAGODA_CPU_KERNELS=0" in plan
    else:
        assert f"ISA level {level} (forced" in plan and "C++ attention and fused ops" in plan


def test_bfloat16_weights_on_avx2_run_the_widening_kernel_and_the_layer_loop(tiny_model_factory):
    if "avx2" not in NATIVE.executable_levels:
        pytest.skip("this host cannot execute avx2")
    path = tiny_model_factory("llama")
    # where the host's own level is avx2, the build it has, not a forced one
    forced = {} if NATIVE.level == "avx2" else {"PAGODA_CPU_ISA": "avx2"}
    _, log, got = run_engine(path, forced, dtype="bfloat16")
    plan = next(line for line in log.splitlines() if "CPU kernels:" in line)
    assert "dtype bfloat16" in plan and "matmul vnni" in plan and "C++ layer loop" in plan
    _, _, expected = run_engine(path, {"PAGODA_CPU_KERNELS": "0"}, dtype="bfloat16")  # torch's bfloat16 path
    # float32 sums of bfloat16 weights against torch's bfloat16 matmuls: the first token's top logprobs agree
    # (a tiny random model's near-ties make later greedy tokens drift apart at bfloat16, as they do in torch).
    # The two round differently at every layer: under 0.05 apart on the Zen hosts, 0.050 on a Xeon with AMX,
    # where every C++ level (avx2, avx512, avx512bf16) gives the same logprobs to 1e-6 and torch's path is the
    # one apart
    for want, have in zip(expected, got):
        shared = want.keys() & have.keys()
        assert len(shared) >= 4, (want, have)
        for token in shared:
            assert have[token] == pytest.approx(want[token], abs=0.1)
