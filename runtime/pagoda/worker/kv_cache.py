"""The paged KV cache of one model's attention layers: its blocks, the host pool swapped-out blocks go to,
and the block moves a step asks for (swap out, swap in, copy-on-write copies).

With KV cache groups (``core.kv_cache_groups``) there is one tensor per slot, not per layer: a group's j-th layer
writes into slot j, so a block holds ``group_size`` layers of the one group that owns it. Swaps and copies move a
block in every slot, whichever group owns it."""

import logging

import torch

from pagoda.config.configs import kv_block_bytes

logger = logging.getLogger(__name__)


def _planes(layer) -> int:
    """2 (a key and a value per KV head), or 1 for a layer that caches one latent row per token (MLA)."""
    return getattr(layer, "kv_planes", 2)


class PagedKVCache:
    def __init__(self, attention_layers: list, block_size: int, dtype: torch.dtype, device: torch.device,
                 calculate_kv_scales: bool = False, groups=None):
        self.attention_layers = attention_layers
        self.groups = groups  # a core.kv_cache_groups.KVCacheGroups, or None: a tensor per layer
        self.slot_layers = attention_layers  # the layer whose shape each cache tensor has
        if groups is not None:
            self.slot_layers = _check_groups(attention_layers, groups)
        self.calculate_kv_scales = calculate_kv_scales  # an fp8 cache's scales calibrated on the first batch
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.caches: list[torch.Tensor] = []  # one per layer
        self.swap_caches: list[torch.Tensor] = []  # host copies of swapped-out blocks, one per layer

    def bytes_per_block(self) -> int:
        return sum(kv_block_bytes(self.block_size, layer.num_kv_heads, layer.head_size, self.dtype.itemsize, 1,
                                  _planes(layer)) for layer in self.slot_layers)

    def _blocks(self, num_blocks: int, device, pin_memory: bool = False, zeroed: bool = True) -> list[torch.Tensor]:
        # head-major in memory, [2, num_blocks, num_kv_heads, block_size, head_size], so one head's block is
        # contiguous (long copies when decode gathers it); the attention backends see it through the
        # [2, num_blocks, block_size, num_kv_heads, head_size] view and honour its strides
        make = torch.zeros if zeroed else torch.empty
        return [make(_planes(layer), num_blocks, layer.num_kv_heads, self.block_size, layer.head_size,
                     dtype=self.dtype, device=device, pin_memory=pin_memory).transpose(2, 3)
                for layer in self.slot_layers]

    def allocate(self, num_blocks: int) -> None:
        self.caches = self._blocks(num_blocks, self.device)
        if self.groups is None:
            for layer, cache in zip(self.attention_layers, self.caches):
                layer.kv_cache = cache
                layer.calculate_kv_scales = self.calculate_kv_scales
            return
        for index, (group, slot) in self.groups.placement().items():
            layer = self.attention_layers[index]
            layer.kv_cache, layer.kv_group = self.caches[slot], group
            layer.calculate_kv_scales = self.calculate_kv_scales

    def allocate_swap_space(self, num_swap_blocks: int) -> None:
        """The host pool, laid out as the device cache. Pinned on a GPU (asynchronous copies); on a CPU a
        separate tensor pool. torch.empty: pages are committed only when a block is first swapped out."""
        self.swap_caches = []
        if num_swap_blocks == 0:
            return
        self.swap_caches = self._blocks(num_swap_blocks, "cpu", pin_memory=self.device.type == "cuda", zeroed=False)
        logger.info("swap space: %d blocks, %.2f GiB of host memory", num_swap_blocks,
                    num_swap_blocks * self.bytes_per_block() / 2**30)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs."""
        device_ids = torch.tensor([p[0] for p in pairs], device=self.device)
        host_ids = torch.tensor([p[1] for p in pairs])
        for cache, host in zip(self.caches, self.swap_caches):
            host[:, host_ids] = cache[:, device_ids].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        host_ids = torch.tensor([p[0] for p in pairs])
        device_ids = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache, host in zip(self.caches, self.swap_caches):
            cache[:, device_ids] = host[:, host_ids].to(self.device, non_blocking=True)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(source block, destination block) pairs."""
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache in self.caches:
            cache[:, dst] = cache[:, src]


def _check_groups(attention_layers: list, groups) -> list:
    """The layers that give the slots' shapes (the first group's); every layer's block must be alike, and its window
    the group's."""
    placement = groups.placement()
    if len(placement) != len(attention_layers):
        raise ValueError(f"KV cache groups name {len(placement)} layers, the model has {len(attention_layers)}")
    shapes = {(layer.num_kv_heads, layer.head_size, _planes(layer)) for layer in attention_layers}
    if len(shapes) > 1:
        raise ValueError(f"the hybrid KV cache manager needs every attention layer's KV block alike, got {shapes}: "
                         "pass --disable-hybrid-kv-cache-manager")
    for index, (group, _) in placement.items():
        if attention_layers[index].sliding_window != groups.groups[group].window:
            raise ValueError(f"layer {index}'s window {attention_layers[index].sliding_window} is not its KV cache "
                             f"group's ({groups.groups[group].window})")
    return [attention_layers[i] for i in groups.groups[0].layers] + \
        [attention_layers[0]] * (groups.group_size - len(groups.groups[0].layers))
