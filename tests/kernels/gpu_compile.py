"""Compile every kernel for sm_80, sm_86 and sm_90 without a GPU: Triton's front end, its GPU passes and ptxas,
which the interpreter never exercises (types of loop-carried values, constexpr branches, dot shapes, ...).

Run as a script, in a process where TRITON_INTERPRET is unset (kernels defined under the interpreter cannot
be compiled). The argument specialisations mirror what Triton derives at a real launch: unit strides
become constants and pointers are 16-byte aligned. Prints one line per kernel; exits non-zero on failure.
"""

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagoda.kernels import flash_decode, fused_moe, kv_cache, lora_sgmv, paged_attention, rmsnorm, rotary
from pagoda.kernels.paged_kv import head_pad

TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
INT_POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                "sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "seg_starts_ptr": "*i32",
                "seg_slots_ptr": "*i32", "slot_mapping_ptr": "*i64", "positions_ptr": "*i64"}
FLOAT32_POINTERS = {"partial_max_ptr", "partial_sum_ptr", "partial_out_ptr", "cos_sin_ptr", "routing_weights_ptr",
                    "s_ptr"}
FLOAT_ARGS = {"scale_log2", "eps", "v_scale", "k_inv_scale", "v_inv_scale"}
UNIT_STRIDES = {"stride_ak", "stride_wk", "stride_cn"}  # fused_moe's contiguous rows
SHARED_MEMORY = {80: 163 * 1024, 86: 99 * 1024, 90: 227 * 1024}  # per block, opt-in maximum


def source(kernel, dtype, constexprs: dict) -> ASTSource:
    signature, attrs, constexprs = {}, {}, dict(constexprs)
    for i, name in enumerate(kernel.arg_names):
        if name.startswith("stride_") and (name.endswith("_d") or name in UNIT_STRIDES):
            constexprs[name] = 1  # a unit stride: Triton specialises it into a constant
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = INT_POINTERS.get(name) or ("*fp32" if name in FLOAT32_POINTERS else f"*{TYPES[dtype]}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    return ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)


def attention_constexprs(dtype, group: int, head_size: int, max_query_len: int, block_size: int,
                         softcap: float = 0.0, arch: int = 80) -> tuple[dict, dict]:
    """The constexprs and launch options the launcher picks for such a batch."""
    group_pad, block_q, block_m = paged_attention.tile_shape(group, max_query_len)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_SIZE=head_size,
                HEAD_PAD=head_pad(head_size), BLOCK_SIZE=block_size, TILE_N=paged_attention.TILE_N,
                UPCAST_DOT=False, DOT_PRECISION=precision, KV_FP8=False, SOFTCAP=softcap), dict(num_warps=paged_attention.num_warps(block_m, head_size, arch, dtype),
                                                                 **paged_attention.launch_stages(dtype))


def cases(arch: int):
    for dtype, group, head_size, max_query_len, block_size, softcap in [
        (torch.float16, 4, 128, 512, 16, 0.0),  # Llama-3-8B prefill tiles
        (torch.bfloat16, 8, 128, 1, 32, 0.0),  # Llama-3-70B at TP=8, decode
        (torch.float32, 1, 80, 7, 16, 0.0),  # padded head size, the test dtype
        (torch.bfloat16, 2, 256, 512, 16, 50.0),  # Gemma-2-9B prefill: soft-capped scores, head size 256
    ]:
        constexprs, options = attention_constexprs(dtype, group, head_size, max_query_len, block_size, softcap,
                                                   arch)
        yield paged_attention._mixed_batch_kernel, dtype, constexprs, options
    four_warps = dict(num_warps=4)
    for softcap in (0.0, 50.0):
        split = dict(GROUP=4, BLOCK_M=16, HEAD_SIZE=96, HEAD_PAD=128, BLOCK_SIZE=16, PARTITION_SIZE=512,
                     TILE_N=flash_decode.TILE_N, UPCAST_DOT=False, DOT_PRECISION="tf32", KV_FP8=False,
                     SOFTCAP=softcap)
        yield flash_decode._partition_kernel, torch.bfloat16, split, four_warps
    yield flash_decode._reduce_kernel, torch.bfloat16, dict(HEAD_SIZE=96, HEAD_PAD=128, PARTITION_SIZE=512,
                                                            NUM_PARTITIONS=64, PARTITIONS_PAD=64), dict(num_warps=2)
    for mul_weight in (False, True):  # the gate|up GEMM over tokens, the weighted down GEMM over pairs
        yield fused_moe._grouped_gemm_kernel, torch.bfloat16, dict(
            TOP_K=1 if mul_weight else 2, MUL_ROUTING_WEIGHT=mul_weight, BLOCK_M=fused_moe.BLOCK_M, BLOCK_N=64,
            BLOCK_K=64, UPCAST_DOT=False, DOT_PRECISION="tf32"), four_warps
    yield kv_cache._write_kv_kernel, torch.float16, dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_SIZE=128, HEAD_PAD=128,
                                                        BLOCK_SIZE=16, BLOCK_T=2, KV_FP8=False, FP8_MAX=0.0,
                                                        MANTISSA=0, MIN_NORMAL=0.0, SUBNORMAL_STEP=0.0), four_warps
    for residual in (True, False):
        yield (rmsnorm._rms_norm_kernel, torch.bfloat16, dict(HAS_RESIDUAL=residual, ROWS=1, HIDDEN_PAD=4096),
               four_warps)
    yield rotary._rotary_kernel, torch.float16, dict(NUM_Q_HEADS=32, Q_HEADS_PAD=32, NUM_K_HEADS=8, K_HEADS_PAD=8,
                                                    HEAD_SIZE=128, HALF=64, HALF_PAD=64, IS_NEOX=True, BLOCK_T=2), \
        four_warps
    sgmv = dict(BLOCK_M=lora_sgmv.BLOCK_M, BLOCK_N=lora_sgmv.BLOCK_N)
    yield (lora_sgmv._shrink_kernel, torch.bfloat16,
           dict(sgmv, BLOCK_K=lora_sgmv.BLOCK_K, UPCAST_DOT=False, DOT_PRECISION="tf32"), four_warps)
    yield lora_sgmv._expand_kernel, torch.bfloat16, dict(sgmv, R_PAD=16, DOT_PRECISION="tf32"), four_warps


def main(shard: int = 0, shards: int = 1) -> int:
    """Compile every ``shards``-th (arch, kernel) pair from ``shard`` on: each compile is single-threaded, so the
    test runs a shard per core."""
    pairs = [(arch, case) for arch in (80, 86, 90) for case in cases(arch)]
    for arch, (kernel, dtype, constexprs, options) in pairs[shard::shards]:
        compiled = triton.compile(source(kernel, dtype, constexprs), target=GPUTarget("cuda", arch, 32),
                                  options=options)
        assert compiled.metadata.shared <= SHARED_MEMORY[arch], f"{kernel.__name__}: too much shared memory"
        assert compiled.asm.get("cubin"), f"{kernel.__name__}: no cubin"
        print(f"sm_{arch} {kernel.__name__} {TYPES[dtype]}: {len(compiled.asm['cubin'])} bytes of cubin, "
              f"{compiled.metadata.shared} bytes of shared memory")
    return 0


if __name__ == "__main__":
    sys.exit(main(*map(int, sys.argv[1:3])))
