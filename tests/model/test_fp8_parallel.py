"""FP8 with tensor and pipeline parallelism (gloo, local processes): online fp8 weights (row-parallel ranks
agree on each row's scale), a block-wise FP8 checkpoint sharded by rows and by whole input blocks, and an fp8
KV cache with the checkpoint's scales; greedy tokens equal the single-process engine's."""

import pytest
from fp8_checkpoints import write_fp8_model
from test_quantization_tp import greedy

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    write_fp8_model(tiny_model_factory("llama", num_layers=2), out / "fp8", out / "dequantized", "fp8", "block",
                    (16, 16), kv_scales={0: (0.3, 0.07), 1: (0.6, 0.011)})
    return out / "fp8"


@pytest.mark.parametrize("kwargs,parallel", [
    (dict(quantization="fp8"), dict(tensor_parallel_size=2)),
    (dict(kv_cache_dtype="fp8"), dict(tensor_parallel_size=2)),
    (dict(kv_cache_dtype="fp8"), dict(pipeline_parallel_size=2)),
    (dict(), dict(tensor_parallel_size=2)),
], ids=["online-weights-tp2", "kv-tp2", "kv-pp2", "checkpoint-weights-tp2"])
def test_parallel_fp8_equals_single_process(fp8_checkpoint, tiny_model_factory, kwargs, parallel):
    path = fp8_checkpoint if not kwargs.get("quantization") else tiny_model_factory("llama", num_layers=2)
    assert greedy(path, **kwargs, **parallel) == greedy(path, **kwargs)
