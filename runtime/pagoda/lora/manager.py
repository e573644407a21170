"""The worker's adapters: max_loras device slots and an LRU of up to max_cpu_loras host copies. Each step
the model runner hands over its sequences' adapters and row counts; the manager makes sure each of them
sits in a slot (reading it from the host cache, or from disk, and evicting the least recently used slot
the step does not need) and tells the LoRA layers which rows belong to which slot."""

import logging
import time
from collections import OrderedDict

import torch

from pagoda.config.configs import LoRAConfig
from pagoda.lora.adapter import load_adapter
from pagoda.lora.layers import attach
from pagoda.lora.ops import RowGroups
from pagoda.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.device = device
        self.rows, self.layers = attach(model, config.max_loras, config.max_lora_rank, dtype, device)
        if not self.layers:
            raise ValueError(f"enable_lora: {type(model).__name__} has no projection LoRA can target")
        self.segments = device.type == "cuda"  # the Triton kernels walk row segments
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.host: OrderedDict[int, dict] = OrderedDict()  # adapter id -> its tensors by module, LRU first
        self.num_loads = 0  # from disk

    def prepare(self, adapters: list[LoRARequest | None], num_rows: list[int],
                keep_rows: torch.Tensor | None = None) -> dict[int, str]:
        """adapters[i] runs num_rows[i] consecutive rows of this step (the scheduled order). Returns the
        adapters that could not be loaded (id -> why): their rows run without them, their requests fail."""
        wanted = {a.lora_int_id: a for a in adapters if a is not None}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters, more than max_loras={self.config.max_loras}")
        failed = {}
        for adapter in wanted.values():
            try:  # checked by the engine, but its files may have changed since
                self._ensure_slot(adapter, wanted)
            except Exception as e:  # noqa: BLE001 - this adapter's requests fail, the step goes on
                failed[adapter.lora_int_id] = f"LoRA adapter {adapter.lora_name!r} could not be loaded: {e}"
                logger.error("%s", failed[adapter.lora_int_id])
        row_slots: list[int] = []
        for adapter, n in zip(adapters, num_rows, strict=True):
            ok = adapter is not None and adapter.lora_int_id not in failed
            row_slots += [self.slot_of[adapter.lora_int_id] if ok else -1] * n
        self.rows.all = RowGroups.from_row_slots(row_slots, self.device, self.segments)
        self.rows.row_slots = (torch.tensor(row_slots, dtype=torch.int32)
                               if self.rows.all.groups and self.device.type == "cpu" else None)
        self.rows.kept_row_slots = None
        if keep_rows is not None and self.rows.all.groups:
            kept = [row_slots[i] for i in keep_rows.tolist()]
            self.rows.kept = RowGroups.from_row_slots(kept, self.device, self.segments)
            if self.rows.row_slots is not None:
                self.rows.kept_row_slots = torch.tensor(kept, dtype=torch.int32)
        else:
            self.rows.kept = RowGroups(0, [])
        return failed

    def _ensure_slot(self, adapter: LoRARequest, wanted: dict) -> None:
        adapter_id = adapter.lora_int_id
        if adapter_id in self.slot_of:
            self.slot_of.move_to_end(adapter_id)
            self._host_copy(adapter)  # keeps the host LRU in step with use
            return
        used = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:  # the least recently used slot this step does not need
            victim = next(i for i in self.slot_of if i not in wanted)
            slot = self.slot_of.pop(victim)
        weights = self._host_copy(adapter)
        by_layer: dict[str, dict] = {}
        for module, ab in weights.items():
            prefix, _, target = module.rpartition(".")
            by_layer.setdefault(prefix, {})[target] = ab
        for name, layer in self.layers.items():
            prefix = name.rpartition(".")[0]
            layer.set_slot(slot, by_layer.get(prefix, {}))
        self.slot_of[adapter_id] = slot

    def _host_copy(self, adapter: LoRARequest) -> dict:
        adapter_id = adapter.lora_int_id
        weights = self.host.get(adapter_id)
        if weights is not None:
            self.host.move_to_end(adapter_id)
            return weights
        started = time.perf_counter()
        weights = load_adapter(adapter.lora_path)
        self.num_loads += 1
        logger.info("LoRA adapter %s (id %d) read from %s in %.0f ms", adapter.lora_name, adapter_id,
                    adapter.lora_path, 1000 * (time.perf_counter() - started))
        self.host[adapter_id] = weights
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return weights

    def remove(self, adapter_id: int) -> None:
        """Forget an adapter (unloaded): its slot frees, its host copy goes."""
        self.slot_of.pop(adapter_id, None)
        self.host.pop(adapter_id, None)
