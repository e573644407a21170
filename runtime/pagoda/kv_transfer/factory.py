"""The connector a kv_transfer_config names, one half per side."""

from pagoda.config.kv_transfer import KVTransferConfig


def create_scheduler_connector(config: KVTransferConfig, block_size: int, tp_size: int = 1, pp_size: int = 1):
    from pagoda.kv_transfer.nixl_connector import NixlConnectorScheduler

    return NixlConnectorScheduler(config, block_size, tp_size, pp_size)


def create_worker_connector(config: KVTransferConfig, block_size: int, rank: int = 0):
    """rank: the worker's global rank (pp_rank * tp_size + tp_rank)."""
    from pagoda.kv_transfer.nixl_connector import NixlConnectorWorker

    return NixlConnectorWorker(config, block_size, rank)
