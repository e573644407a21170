"""Configuration: the user's arguments (args), the validated configs (configs) and the resolution from one to
the other (resolve: ``create_engine_config(args)``). Imports go one way, resolve -> args -> configs and the
leaves (kv_cache, quantization, ...); tests/unit/test_config_imports.py checks that no cycle comes back. A leaf: nothing here imports torch or the engine's machinery when imported."""

from pagoda.config.args import (
    DTYPES,
    EXECUTOR_BACKENDS,
    LOAD_FORMATS,
    PREEMPTION_MODES,
    UNSUPPORTED_ARGS,
    EngineArgs,
)
from pagoda.config.configs import (
    AUTO_TARGET,
    DEFAULT_CPU_KV_CACHE_GIB,
    DEFAULT_CPU_SWAP_SPACE_GIB,
    DEFAULT_GPU_SWAP_SPACE_GIB,
    DEFAULT_MODEL_NAME,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    relative_itl_target,
)
from pagoda.config.kv_cache import KV_CACHE_DTYPES
from pagoda.config.resolve import choose_dtype, create_engine_config, resolve_device, resolve_dtype

__all__ = ["AUTO_TARGET", "DEFAULT_CPU_KV_CACHE_GIB", "DEFAULT_CPU_SWAP_SPACE_GIB", "DEFAULT_GPU_SWAP_SPACE_GIB",
           "DEFAULT_MODEL_NAME", "DTYPES", "EXECUTOR_BACKENDS", "KV_CACHE_DTYPES", "LOAD_FORMATS",
           "PREEMPTION_MODES", "UNSUPPORTED_ARGS", "CacheConfig", "EngineArgs",
           "EngineConfig", "LoRAConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig", "SpeculativeConfig",
           "choose_dtype", "create_engine_config", "relative_itl_target", "resolve_device", "resolve_dtype"]
