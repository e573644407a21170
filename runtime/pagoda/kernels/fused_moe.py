"""Mixture-of-experts matmuls as one grouped GEMM over tokens sorted by expert (as vLLM's ``fused_moe``).

Each token picks top_k experts; its (token, choice) pairs are flattened (pair p = token * top_k + choice),
sorted by expert, and each expert's run of pairs is padded to a multiple of BLOCK_M with a sentinel, so
every BLOCK_M rows of the sorted list belong to one expert (``align_by_expert``). One launch then multiplies
every block of rows by its expert's weight: the weights of an expert are read once per block of its rows,
never per token, and experts no token chose cost nothing.

``fused_experts`` is the whole expert MLP: gate|up GEMM, act(gate) * up, down GEMM weighted by the routing
weights, and the sum over each token's choices.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import check_device, check_tensor, is_interpreted, require

BLOCK_M = 16  # rows of one expert per program (tl.dot's smallest M)


@triton.jit
def _grouped_gemm_kernel(
    c_ptr,  # [num_pairs, N], row p is pair p's product
    a_ptr,  # [num_rows, K]: row p // TOP_K of a pair p (tokens), or row p (pairs, TOP_K = 1)
    w_ptr,  # [num_experts, N, K]
    sorted_pairs_ptr,  # [num_padded] int32, pairs sorted by expert, num_pairs where padded
    block_experts_ptr,  # [num_padded // BLOCK_M] int32, the expert of each block of sorted rows
    routing_weights_ptr,  # [num_pairs] f32, read when MUL_ROUTING_WEIGHT
    num_pairs,
    N,
    K,
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_cm, stride_cn,
    TOP_K: tl.constexpr,
    MUL_ROUTING_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    a_rows = (pairs // TOP_K).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_base + n[None, :].to(tl.int64) * stride_wn + k[:, None] * stride_wk,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if MUL_ROUTING_WEIGHT:
        acc *= tl.load(routing_weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@dataclass
class ExpertAlignment:
    sorted_pairs: torch.Tensor  # [num_padded] int32: pairs sorted by expert, num_pairs in the padding
    block_experts: torch.Tensor  # [num_padded // BLOCK_M] int32
    num_pairs: int
    tokens_per_expert: torch.Tensor  # [num_experts] int64: pairs routed to each expert


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> ExpertAlignment:
    """expert_ids [T, top_k] (an id outside [0, num_experts): an expert this rank does not hold, skipped) ->
    the pairs sorted by expert, each expert's run padded to a multiple of block_m."""
    flat = expert_ids.flatten().long()
    num_pairs = flat.numel()
    held = (flat >= 0) & (flat < num_experts)
    keyed = torch.where(held, flat, num_experts)  # skipped pairs sort last and are dropped
    order = torch.argsort(keyed, stable=True)
    counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    num_held = int(counts.sum())
    order = order[:num_held]
    experts_sorted = keyed[order]
    slots = padded_start[experts_sorted] + torch.arange(num_held, device=flat.device) - start[experts_sorted]
    num_padded = int(padded.sum())
    sorted_pairs = torch.full((num_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[slots] = order.to(torch.int32)
    block_experts = torch.repeat_interleave(torch.arange(num_experts, device=flat.device, dtype=torch.int32),
                                            padded // block_m)
    return ExpertAlignment(sorted_pairs, block_experts, num_pairs, counts)


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, alignment: ExpertAlignment, top_k: int,
                 routing_weights: torch.Tensor | None = None) -> torch.Tensor:
    """c[p] = a[p // top_k] @ weights[expert of p].T (times routing_weights[p] when given) for every pair p an
    expert of ``weights`` holds; rows of pairs no expert here holds are zero. a [rows, K], weights [E, N, K]
    -> [num_pairs, N] in a's dtype."""
    op = "grouped_gemm"
    check_tensor(op, "a", a, "[rows, K]", (None, None), (torch.float32, torch.float16, torch.bfloat16))
    check_tensor(op, "weights", weights, "[num_experts, N, K]", (None, None, a.shape[1]), a.dtype)
    num_pairs = alignment.num_pairs
    require(a.shape[0] * top_k == num_pairs, op, "a", f"[num_pairs / top_k = {num_pairs // top_k}, K]", a)
    if routing_weights is not None:
        check_tensor(op, "routing_weights", routing_weights, "[num_pairs]", (num_pairs,), torch.float32)
    c = torch.zeros(num_pairs, weights.shape[1], dtype=a.dtype, device=a.device)
    check_device(op, _grouped_gemm_kernel, a=a, weights=weights, sorted_pairs=alignment.sorted_pairs, c=c)
    num_blocks = alignment.sorted_pairs.numel() // BLOCK_M
    if num_blocks == 0:
        return c
    n, k = weights.shape[1], weights.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    upcast = a.dtype == torch.bfloat16 and is_interpreted(_grouped_gemm_kernel)  # see paged_kv.dot_config
    precision = "ieee" if a.dtype == torch.float32 or upcast else "tf32"
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(n, block_n))](
        c, a, weights, alignment.sorted_pairs, alignment.block_experts,
        routing_weights if routing_weights is not None else c, num_pairs, n, k,
        a.stride(0), a.stride(1), *weights.stride(), c.stride(0), c.stride(1),
        TOP_K=top_k, MUL_ROUTING_WEIGHT=routing_weights is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, UPCAST_DOT=upcast, DOT_PRECISION=precision, num_warps=4)
    return c


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, expert_ids: torch.Tensor,
                  routing_weights: torch.Tensor, act_and_mul, alignment: ExpertAlignment | None = None
                  ) -> torch.Tensor:
    """sum over each token's choices of weight * down(act(gate) * up): x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    expert_ids / routing_weights [T, top_k] -> [T, H]. Choices of experts outside [0, E) add nothing."""
    top_k = expert_ids.shape[1]
    alignment = alignment or align_by_expert(expert_ids, w13.shape[0])
    gate_up = grouped_gemm(x, w13, alignment, top_k)  # [T * top_k, 2I]
    down = grouped_gemm(act_and_mul(gate_up), w2, alignment, 1, routing_weights.flatten().float())
    return down.view(x.shape[0], top_k, -1).sum(1)
