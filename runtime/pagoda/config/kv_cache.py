"""Which dtype the KV cache stores, validated at configuration time (torch-free).

``kv_cache_dtype`` as vLLM names it: ``auto`` stores keys and values in the model's dtype; ``fp8`` (the same
as ``fp8_e4m3``) and ``fp8_e5m2`` store them in 8 bits with one scale per layer for the keys and one for the
values (``pagoda.layers.quantization.kv_scales``), so a block takes half the memory of a bfloat16 one."""

from pagoda.errors import InvalidParam

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# torch dtype names of the fp8 formats: e4m3 (more mantissa, max 448) is the default, as in vLLM
FP8_STORAGE = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
MODEL_DTYPE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def check_kv_cache_dtype(kv_cache_dtype: str, calculate_kv_scales: bool = False) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidParam("kv_cache_dtype", f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                                             f"got {kv_cache_dtype!r}")
    if calculate_kv_scales and not is_fp8(kv_cache_dtype):
        raise InvalidParam("calculate_kv_scales", "calculate_kv_scales applies to an fp8 KV cache: pass "
                                                  "kv_cache_dtype='fp8' (or 'fp8_e4m3' / 'fp8_e5m2') with it")


def is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in FP8_STORAGE


def storage_dtype_name(kv_cache_dtype: str, model_dtype: str) -> str:
    """The torch dtype name a cache element is stored in."""
    return FP8_STORAGE.get(kv_cache_dtype, model_dtype)


def kv_cache_itemsize(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per cached key or value element."""
    return 1 if is_fp8(kv_cache_dtype) else MODEL_DTYPE_ITEMSIZE[model_dtype]
