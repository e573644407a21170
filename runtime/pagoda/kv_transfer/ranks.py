"""A KV connector across the ranks of a TP/PP engine: every rank's handshake metadata gathered on the driver (the
side channel serves them by rank), and one step's loads merged over the ranks (a load finished when it finished on
every rank), so that the scheduler side sees one output per step as with one rank."""

from __future__ import annotations

import torch.distributed as dist

from pagoda.kv_transfer.base import KVConnectorOutput


def gather_handshake_metadata(metadata: dict, group) -> list[dict] | None:
    """Every rank calls this once its KV cache is registered; global rank 0 gets every rank's metadata, by
    global rank (group: the whole world, gloo; None is the default group), the others None."""
    is_driver = dist.get_rank() == 0
    gathered = [None] * dist.get_world_size(group) if is_driver else None
    dist.gather_object(metadata, gathered, dst=0, group=group)
    return gathered


def merge_step_output(output: KVConnectorOutput | None, metadata, parallel, is_last_stage: bool
                      ) -> KVConnectorOutput | None:
    """This step's output merged over this stage's TP ranks and the stages before (their merge rides with the
    schedule, in metadata.upstream). Every rank of the step calls this when the step had loads (metadata is not
    None: the same schedule reaches every rank). The last stage gets the whole merge; an earlier one leaves it
    in metadata.upstream for the next stage and gets None."""
    parts = [output]
    if parallel.tp_size > 1:
        parts = [None] * parallel.tp_size
        dist.all_gather_object(parts, output, group=parallel.tp_group)
    merged = KVConnectorOutput.merge([*parts, metadata.upstream])
    if not is_last_stage:
        metadata.upstream = merged
        return None
    return merged or None
