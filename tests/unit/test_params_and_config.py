import pytest

from pagoda.config import EngineArgs, create_engine_config
from pagoda.errors import InvalidParam
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("n", 0),
    ("min_p", 2.0), ("presence_penalty", 3.0), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("logprobs", 21), ("stop", [""]), ("stop_token_ids", [-1]), ("min_tokens", -1),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", [
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 99999999999999999999999), ("seed", 1.5), ("seed", True),
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")),
    ("min_p", float("nan")), ("presence_penalty", float("inf")), ("repetition_penalty", float("nan")),
    ("repetition_penalty", float("inf")), ("top_k", 2**64), ("top_k", 1.5), ("max_tokens", 2**70),
    ("max_tokens", True), ("n", True), ("logprobs", -1), ("stop_token_ids", [2**64]), ("stop", 5),
    ("stop", ["x" * 5000]), ("stop", ["s"] * 100), ("ignore_eos", "yes"), ("min_tokens", 1.5),
])
def test_out_of_range_values_are_refused_with_the_field(field, value):
    """Nothing that passes SamplingParams may raise later, when it becomes tensors or generators."""
    with pytest.raises(InvalidParam) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_seed_plus_n_must_fit_int64():
    """Output i draws from seed + i: the last one must still be a valid seed."""
    SamplingParams(seed=2**63 - 1, n=1)
    SamplingParams(seed=-(2**63), n=4)
    with pytest.raises(InvalidParam, match="seed"):
        SamplingParams(seed=2**63 - 1, n=2)


def test_stop_string_and_top_k_zero_normalised():
    p = SamplingParams(stop="###", top_k=0)
    assert p.stop_strings == ["###"] and p.top_k == -1


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


@pytest.mark.parametrize("changes,match", [
    (dict(block_size=12), "block_size"), (dict(dtype="int8"), "dtype"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(kv_cache_memory=-1), "kv_cache_memory"),
    (dict(attention_backend="flash"), "attention_backend"), (dict(max_model_len=100000), "max_model_len"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=16), "max_num_batched_tokens"),
    (dict(node_rank=3, nnodes=2, pipeline_parallel_size=2), "node_rank"),
])
def test_invalid_engine_args_name_the_field(tiny_llama_dir, changes, match):
    with pytest.raises(ValueError, match=match):
        create_engine_config(EngineArgs(model=str(tiny_llama_dir), **changes))


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        create_engine_config(EngineArgs(model=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="no config.json"):
        create_engine_config(EngineArgs(model=str(tmp_path)))


def test_unsupported_architecture_names_the_supported_ones(tmp_path, tiny_llama_dir):
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        create_engine_config(EngineArgs(model=str(path)))


def test_auto_dtype_resolution(tiny_llama_dir):
    from pagoda.platform import choose_dtype

    cfg = create_engine_config(EngineArgs(model=str(tiny_llama_dir)))
    assert cfg.model.dtype == choose_dtype("cpu")[0]
    assert cfg.attention_backend == "torch" and cfg.device == "cpu"


def test_triton_backend_without_cuda_is_refused_at_config_time(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device"):
        create_engine_config(EngineArgs(model=str(tiny_llama_dir), attention_backend="triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels' tests run them in the interpreter
    assert create_engine_config(EngineArgs(model=str(tiny_llama_dir), attention_backend="triton")).attention_backend == "triton"


def test_configuration_errors_come_before_any_loading():
    """A bad backend is refused before the model path is even looked at (nothing loads, nothing converts)."""
    with pytest.raises(InvalidParam) as err:
        create_engine_config(EngineArgs(model="/does/not/exist", distributed_executor_backend="dask"))
    assert err.value.param == "distributed_executor_backend"


def test_auto_dtype_says_why(monkeypatch):
    """What the start-up log and `--help` say: a CPU without bfloat16 kernels (forced here to the generic
    level) gets float32, and says so; an asked-for dtype says it was asked."""
    from pagoda import platform
    from pagoda.config import choose_dtype

    monkeypatch.setenv("PAGODA_CPU_ISA", "generic")
    platform.cpu_isa.cache_clear()
    try:
        dtype, reason = choose_dtype("auto", "cpu")
        assert dtype == "float32" and reason.startswith("dtype auto -> float32: ISA level generic")
        assert choose_dtype("float32", "cpu") == ("float32", "dtype float32: as asked")
    finally:
        monkeypatch.delenv("PAGODA_CPU_ISA")
        platform.cpu_isa.cache_clear()


def test_the_start_up_log_says_why_the_dtype_was_chosen(tiny_llama_dir, caplog):
    from pagoda import LLM
    from pagoda.config import choose_dtype

    with caplog.at_level("INFO", logger="pagoda.engine.llm_engine"), LLM(str(tiny_llama_dir), kv_cache_memory=0.01):
        pass
    assert choose_dtype("auto", "cpu")[1] in caplog.text
