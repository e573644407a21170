"""The vLLM engine arguments tutorials pass: accepted and honoured, or refused by name before anything
loads; their `pagoda serve` flags; the periodic stats line and the swap metrics. No model is run."""

import argparse
import json
import logging
import shutil

import pytest

from pagoda.config import EngineArgs, create_engine_config
from pagoda.errors import InvalidParam

pytestmark = pytest.mark.unit


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything is resolved or loaded: refusals must come first."""
    import pagoda.config.model_files as loader

    def boom(*args, **kwargs):
        raise AssertionError("the model was resolved or loaded before the arguments were checked")

    monkeypatch.setattr(loader, "resolve_model_path", boom)
    monkeypatch.setattr(loader, "load_hf_config", boom)


@pytest.mark.parametrize("name,value", [
    ("speculative_config", {"method": "eagle", "num_speculative_tokens": 4}), ("cpu_offload_gb", 4.0),
    ("num_scheduler_steps", 8), ("enable_sleep_mode", True),
    # data parallelism runs; bad sizes, ranks and ports are refused by name
    ("data_parallel_size", 0), ("data_parallel_start_rank", 1), ("data_parallel_rank", 1),
    ("data_parallel_rpc_port", 0), ("data_parallel_size_local", 2),
    ("tokenizer_mode", "mistral"), ("tokenizer_mode", "slow"), ("load_format", "pt"), ("load_format", "gguf"),
    ("kv_cache_dtype", "int8"), ("kv_cache_dtype", "fp8_e4m3fn"), ("calculate_kv_scales", True),
    ("distributed_executor_backend", "dask"),
    ("swap_space", -1), ("preemption_mode", "evict"), ("stats_log_interval", 0),
])
def test_unsupported_or_bad_values_are_refused_by_name_before_loading(no_loading, name, value):
    with pytest.raises(InvalidParam) as err:
        create_engine_config(EngineArgs(model="/not/loaded", **{name: value}))
    assert err.value.param == name and name in str(err.value)


@pytest.mark.parametrize("values,name", [
    (dict(data_parallel_rank=1, enable_expert_parallel=True), "enable_expert_parallel"),
    (dict(data_parallel_rank=1, data_parallel_size_local=2), "data_parallel_size_local"),
    (dict(data_parallel_rank=0, data_parallel_start_rank=1), "data_parallel_start_rank"),
])
def test_external_load_balancing_refuses_what_its_independent_ranks_cannot_run(no_loading, values, name):
    """--data-parallel-rank R: this server is rank R alone, an independent engine; experts over every rank
    (each rank its own endpoint) and many local ranks are refused, naming the field."""
    with pytest.raises(InvalidParam) as err:
        create_engine_config(EngineArgs(model="/not/loaded", data_parallel_size=2, **values))
    assert err.value.param == name and name in str(err.value)


@pytest.mark.parametrize("values,name", [
    (dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
])
def test_bad_lora_values_are_refused_by_name_before_loading(no_loading, values, name):
    with pytest.raises(InvalidParam) as err:
        create_engine_config(EngineArgs(model="/not/loaded", enable_lora=True, **values))
    assert err.value.param == name and name in str(err.value)


def test_swap_mode_without_swap_space_is_refused(no_loading):
    with pytest.raises(InvalidParam, match="swap_space > 0") as err:
        create_engine_config(EngineArgs(model="/not/loaded", preemption_mode="swap", swap_space=0))
    assert err.value.param == "preemption_mode"


def test_ray_backend_without_ray_installed_names_the_extra(no_loading, monkeypatch):
    from pagoda.config import ray_presence

    monkeypatch.setattr(ray_presence, "ray_installed", lambda: False)
    with pytest.raises(InvalidParam, match=r"needs Ray, which is not installed: pip install 'pagoda\[ray\]'") as err:
        create_engine_config(EngineArgs(model="/not/loaded", distributed_executor_backend="ray", tensor_parallel_size=2))
    assert err.value.param == "distributed_executor_backend"


def test_ray_backend_refuses_nnodes(no_loading):
    with pytest.raises(InvalidParam, match="nnodes is for the 'mp' backend") as err:
        create_engine_config(EngineArgs(model="/not/loaded", distributed_executor_backend="ray", pipeline_parallel_size=2,
                   nnodes=2))
    assert err.value.param == "nnodes"


def test_the_tutorial_arguments_are_accepted_and_take_effect(tiny_llama_dir):
    from pagoda import AsyncEngineArgs

    args = AsyncEngineArgs(model=str(tiny_llama_dir), block_size=16, max_num_batched_tokens=8192, max_num_seqs=256,
                           gpu_memory_utilization=0.95, swap_space=4, enable_prefix_caching=True,
                           disable_log_stats=False, enforce_eager=True, kv_cache_dtype="auto",
                           trust_remote_code=False, load_format="safetensors", tokenizer_mode="auto")
    cfg = create_engine_config(args)
    assert cfg.cache.swap_space_gib == 4 and cfg.cache.preemption_mode == "swap"
    assert cfg.scheduler.preemption_mode == "swap" and cfg.log_stats
    hf = cfg.model.hf_config
    block_bytes = 2 * 16 * hf.num_key_value_heads * (hf.hidden_size // hf.num_attention_heads) * \
        {"float32": 4}.get(cfg.model.dtype, 2) * hf.num_hidden_layers
    assert cfg.cache.num_swap_blocks == 4 * 2**30 // block_bytes
    assert cfg.cache.gpu_memory_utilization == 0.95 and cfg.scheduler.max_num_batched_tokens == 8192


def test_swap_defaults_on_cpu_and_recompute_without_swap_space(tiny_llama_dir):
    from pagoda.config import DEFAULT_CPU_SWAP_SPACE_GIB

    cfg = create_engine_config(EngineArgs(model=str(tiny_llama_dir)))
    assert cfg.cache.swap_space_gib == DEFAULT_CPU_SWAP_SPACE_GIB and cfg.cache.preemption_mode == "swap"
    assert cfg.cache.num_swap_blocks > 0
    cfg = create_engine_config(EngineArgs(model=str(tiny_llama_dir), swap_space=0))
    assert cfg.cache.preemption_mode == "recompute" and cfg.cache.num_swap_blocks == 0
    cfg = create_engine_config(EngineArgs(model=str(tiny_llama_dir), preemption_mode="recompute"))
    assert cfg.cache.num_swap_blocks == 0 and cfg.scheduler.preemption_mode == "recompute"


def test_llm_disables_the_stats_log_by_default_as_vllm(monkeypatch, tiny_llama_dir):
    import pagoda.entrypoints.llm as llm_module

    seen = []
    monkeypatch.setattr(llm_module.LLMEngine, "from_engine_args", classmethod(lambda cls, args: seen.append(args)))
    llm_module.LLM(str(tiny_llama_dir))
    llm_module.LLM(str(tiny_llama_dir), disable_log_stats=False)
    assert [a.disable_log_stats for a in seen] == [True, False]
    assert EngineArgs().disable_log_stats is False  # the server logs them


def _custom_code_model(tmp_path, tiny_llama_dir):
    path = tmp_path / "custom"
    shutil.copytree(tiny_llama_dir, path)
    (path / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class CustomLlamaConfig(LlamaConfig):\n"
        "    model_type = 'custom_llama'\n"
        "    loaded_from_remote_code = True\n")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "custom_llama"
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomLlamaConfig"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_trust_remote_code_reaches_transformers(tmp_path, tiny_llama_dir):
    path = _custom_code_model(tmp_path, tiny_llama_dir)
    with pytest.raises(ValueError, match="trust_remote_code"):
        create_engine_config(EngineArgs(model=str(path)))
    cfg = create_engine_config(EngineArgs(model=str(path), trust_remote_code=True))
    assert getattr(cfg.model.hf_config, "loaded_from_remote_code", False)
    assert cfg.model.trust_remote_code


def _serve_parser():
    from pagoda.entrypoints.openai.cli_args import add_serve_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.error = lambda message: (_ for _ in ()).throw(SystemExit(message))
    add_serve_arguments(parser)
    return parser


def test_serve_flags_reach_the_engine_args():
    from pagoda.entrypoints.openai.cli_args import split_args

    ns = _serve_parser().parse_args(["m", "--swap-space", "1.5", "--preemption-mode", "recompute",
                                     "--disable-log-stats", "--enforce-eager", "--kv-cache-dtype", "auto",
                                     "--trust-remote-code", "--stats-log-interval", "2"])
    engine, _ = split_args(ns)
    assert (engine.swap_space, engine.preemption_mode, engine.disable_log_stats, engine.enforce_eager,
            engine.kv_cache_dtype, engine.trust_remote_code, engine.stats_log_interval) == \
        (1.5, "recompute", True, True, "auto", True, 2.0)
    engine, _ = split_args(_serve_parser().parse_args(["m"]))
    assert engine.swap_space is None and engine.preemption_mode is None and not engine.disable_log_stats


def test_fp8_serve_flags_reach_the_engine_args(monkeypatch):
    from pagoda.entrypoints.openai.cli_args import split_args

    engine, _ = split_args(_serve_parser().parse_args(["m", "--kv-cache-dtype", "fp8_e5m2", "--calculate-kv-scales",
                                                       "--quantization", "fp8"]))
    assert (engine.kv_cache_dtype, engine.calculate_kv_scales, engine.quantization) == ("fp8_e5m2", True, "fp8")
    monkeypatch.setenv("PAGODA_KV_CACHE_DTYPE", "fp8")
    engine, _ = split_args(_serve_parser().parse_args(["m"]))
    assert engine.kv_cache_dtype == "fp8" and engine.calculate_kv_scales is False


@pytest.mark.parametrize("argv,flag", [
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype"), (["--preemption-mode", "evict"], "--preemption-mode"),
    (["--swap-space", "-1"], "--swap-space"), (["--stats-log-interval", "0"], "--stats-log-interval"),
])
def test_bad_serve_flags_name_the_flag(argv, flag):
    with pytest.raises((SystemExit, argparse.ArgumentError)) as err:
        _serve_parser().parse_args(["m", *argv])
    assert flag in str(err.value)


def test_stats_log_line_has_the_rates_since_the_previous_line(caplog):
    from pagoda.engine.outputs import EngineStats
    from pagoda.engine.stats_logger import StatsLogger

    now = [100.0]
    logger = StatsLogger(5.0, clock=lambda: now[0])
    assert not logger.due()
    now[0] = 105.0
    assert logger.due()
    with caplog.at_level(logging.INFO, logger="pagoda.stats"):
        line = logger.log(EngineStats(prompt_tokens=500, generation_tokens=100, num_requests_running=3,
                                      num_requests_waiting=2, num_requests_swapped=1, kv_cache_usage=0.5,
                                      prefix_cache_queries=400, prefix_cache_hits=100, num_preemptions=4,
                                      swap_space_usage=0.25))
    assert line in caplog.text
    for part in ["prompt throughput: 100.0 tokens/s", "generation throughput: 20.0 tokens/s", "Running: 3 reqs",
                 "Swapped: 1 reqs", "Waiting: 2 reqs", "KV cache usage: 50.0%", "Prefix cache hit rate: 25.0%",
                 "Swap space usage: 25.0%", "Preemptions: 4"]:
        assert part in line
    now[0] = 115.0
    line = logger.log(EngineStats(prompt_tokens=500, generation_tokens=300, num_preemptions=4))
    assert "prompt throughput: 0.0" in line and "generation throughput: 20.0" in line and "Preemptions: 0" in line


def test_swap_metrics_are_published():
    from pagoda.engine.outputs import EngineStats
    from pagoda.entrypoints.openai.metrics import ServerMetrics

    stats = EngineStats(num_swapped_out=3, num_swapped_in=2, num_recomputed=1, num_requests_swapped=1,
                        swap_space_usage=0.5, num_swap_blocks_used=8, num_swap_blocks_total=16)
    text = ServerMetrics("m", lambda: stats).render().decode()
    for line in ['pagoda:num_swapped_out_total{model_name="m"} 3.0', 'pagoda:num_swapped_in_total{model_name="m"} 2.0',
                 'pagoda:num_recomputed_total{model_name="m"} 1.0', 'pagoda:num_requests_swapped{model_name="m"} 1.0',
                 'pagoda:cpu_cache_usage_perc{model_name="m"} 0.5',
                 'pagoda:swap_space_used_blocks{model_name="m"} 8.0',
                 'pagoda:swap_space_total_blocks{model_name="m"} 16.0']:
        assert line in text


def test_a_tensor_parallel_size_that_cannot_split_the_heads_is_refused_by_name(tiny_llama_dir):
    # the tiny Llama has 4 attention heads over 2 KV heads: 3 ranks cannot split them (each rank building its
    # layers found out, one by one, in a crash loop when they were pods); 2 and 4 can
    with pytest.raises(InvalidParam) as refused:
        create_engine_config(EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=3))
    assert refused.value.param == "tensor_parallel_size"
    assert "4 attention heads" in str(refused.value) and "use one of 1, 2, 4" in str(refused.value)
    for tp in (2, 4):
        assert create_engine_config(EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=tp)) is not None
