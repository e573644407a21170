"""The connector a kv_transfer_config names, one half per side."""

from pagoda.config.kv_transfer import KVTransferConfig


def create_scheduler_connector(config: KVTransferConfig, block_size: int):
    from pagoda.kv_transfer.nixl_connector import NixlConnectorScheduler

    return NixlConnectorScheduler(config, block_size)


def create_worker_connector(config: KVTransferConfig, block_size: int):
    from pagoda.kv_transfer.nixl_connector import NixlConnectorWorker

    return NixlConnectorWorker(config, block_size)
