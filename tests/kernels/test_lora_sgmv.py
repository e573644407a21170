"""The LoRA SGMV shrink/expand kernels against the torch path (pagoda.lora.ops.add_lora_torch) on batches
mixing adapters, the base model, one-row (decode) and long (prefill) segments, fused sub-outputs and ranks
below the slots' padded rank."""

import pytest
import torch

from pagoda.kernels.lora_sgmv import lora_expand, lora_shrink
from pagoda.lora.ops import RowGroups, add_lora_torch

pytestmark = pytest.mark.kernels


def batch(device, dtype, row_slots, in_size, sub_sizes, slots=3, rank=16, used_rank=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_sub = len(sub_sizes)
    a = torch.zeros(slots, n_sub * rank, in_size)
    b = torch.zeros(slots, sum(sub_sizes), rank)
    for i in range(n_sub):  # zero past each adapter's own rank, as the manager writes them
        a[:, i * rank : i * rank + used_rank] = torch.randn(slots, used_rank, in_size, generator=g) * 0.3
    b[:, :, :used_rank] = torch.randn(slots, sum(sub_sizes), used_rank, generator=g) * 0.3
    x = torch.randn(len(row_slots), in_size, generator=g)
    y = torch.randn(len(row_slots), sum(sub_sizes), generator=g)
    offsets = [sum(sub_sizes[:i]) for i in range(n_sub)]
    to = dict(device=device, dtype=dtype)
    return x.to(**to), y.to(**to), a.to(**to), b.to(**to), list(zip(offsets, sub_sizes, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row_slots,in_size,sub_sizes", [
    ([0, -1, 1, 2, 0, -1, 1], 64, [64, 16, 16]),  # decode: one row per sequence, q/k/v fused
    ([1] * 20 + [-1] * 5 + [0] * 3 + [1] * 17, 96, [128, 128]),  # prefill chunks, gate/up fused
    ([-1, -1, 2, 2], 40, [24]),  # sizes off the tiles, one sub-output (o/down)
    ([-1] * 6, 64, [32]),  # the base model only: nothing changes
], ids=["decode-qkv", "prefill-gate-up", "odd-sizes", "base-only"])
def test_sgmv_equals_torch_path(device, dtype, row_slots, in_size, sub_sizes):
    x, y, a, b, subs = batch(device, dtype, row_slots, in_size, sub_sizes)
    torch_groups = RowGroups.from_row_slots(row_slots, torch.device(device), with_segments=False)
    expected = add_lora_torch(x.float(), y.float().clone(), a.float(), b.float(), 16, subs, torch_groups)
    groups = RowGroups.from_row_slots(row_slots, torch.device(device), with_segments=True)
    if not groups.groups:
        assert groups.seg_starts is None  # the layer hook returns y untouched
        return
    shrunk = lora_shrink(x, a, groups.seg_starts, groups.seg_slots)
    got = lora_expand(y.clone(), shrunk, b, groups.seg_starts, groups.seg_slots, 16, subs)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(got.float(), expected, **tol)
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])  # the base model's rows are never written


def test_bad_arguments_are_named(device):
    x, y, a, b, subs = batch(device, torch.float32, [0, 1], 32, [32])
    groups = RowGroups.from_row_slots([0, 1], torch.device(device), with_segments=True)
    with pytest.raises(ValueError, match="lora_shrink: a must be"):
        lora_shrink(x, a[:, :, :16], groups.seg_starts, groups.seg_slots)
    with pytest.raises(ValueError, match="lora_expand: s must be"):
        lora_expand(y, torch.zeros(2, 3, device=device), b, groups.seg_starts, groups.seg_slots, 16, subs)
    with pytest.raises(ValueError, match="seg_starts must be"):
        lora_shrink(x, a, groups.seg_starts[:-1], groups.seg_slots)
