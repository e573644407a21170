"""Argument checks for the kernel launchers.

A wrong dtype, shape or stride inside a kernel shows up as silent garbage rather than an exception, so the
launchers check up front and every error names the tensor, what was expected and what it got.
"""

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # KV-cache storage (kv_cache_dtype="fp8")


def describe(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype} {list(tensor.shape)} with strides {list(tensor.stride())} on {tensor.device}"


def require(ok: bool, op: str, name: str, expected: str, tensor: torch.Tensor) -> None:
    if not ok:
        raise ValueError(f"{op}: {name} must be {expected}; got {describe(tensor)}")


def check_tensor(op: str, name: str, tensor, dims: str, shape: tuple[int | None, ...],
                 dtypes: tuple[torch.dtype, ...] | torch.dtype) -> None:
    """``dims`` names the axes for the message (e.g. "[num_tokens, num_heads, head_size]"); ``shape`` holds
    the sizes that are already known (None: any size)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor {dims}; got {type(tensor).__name__}")
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    require(tensor.dtype in dtypes, op, name, names, tensor)
    wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    ok = tensor.dim() == len(shape) and all(s is None or s == t for s, t in zip(shape, tensor.shape, strict=True))
    require(ok, op, name, f"of shape {dims} = {wanted}", tensor)


def is_interpreted(kernel) -> bool:
    """True when Triton was in interpreter mode as the kernel was defined (TRITON_INTERPRET=1)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def check_device(op: str, kernel, **tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and a device the kernel can run on."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, other in devices.items():
        if other != device:
            raise ValueError(f"{op}: {name} is on {other} but {first_name} is on {device}; "
                             "all tensors must be on one device")
    if device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError(f"{op}: the Triton kernels run on CUDA tensors; got tensors on {device}. "
                           "To run them on the CPU in Triton's interpreter, set TRITON_INTERPRET=1 "
                           "before pagoda.kernels is imported")
    return device
