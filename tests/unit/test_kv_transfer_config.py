"""kv_transfer_config (vLLM's keys) and kv_transfer_params: malformed values are refused naming the field."""

import pytest

from pagoda.config import EngineArgs
from pagoda.config.kv_transfer import KVTransferConfig, parse_kv_transfer_params
from pagoda.errors import InvalidParam
from pagoda.sampling_params import SamplingParams

GOOD = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [3, 4], "remote_host": "p",
        "remote_port": 5600}


def test_vllm_json_parses():
    config = KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}')
    assert config.kv_role == "kv_consumer" and config.is_consumer and not config.is_producer
    assert config.side_channel()[1] == 5600  # vLLM's default


@pytest.mark.parametrize("raw, field", [
    ("{", "kv_transfer_config"),
    ({"kv_connector": "LMCacheConnector"}, "kv_transfer_config.kv_connector"),
    ({"kv_connector": "NixlConnector", "kv_role": "both"}, "kv_transfer_config.kv_role"),
    ({"kv_connector": "NixlConnector", "kv_rol": "kv_both"}, "kv_transfer_config.kv_rol"),
    ({"kv_connector": "NixlConnector", "kv_connector_extra_config": []},
     "kv_transfer_config.kv_connector_extra_config"),
])
def test_malformed_config_names_the_field(raw, field):
    with pytest.raises(InvalidParam) as e:
        KVTransferConfig.parse(raw)
    assert e.value.param == field


def test_engine_args_refuse_data_parallel_by_name():
    with pytest.raises(InvalidParam, match="data_parallel_size") as e:
        EngineArgs(model="m", data_parallel_size=2, kv_transfer_config={"kv_connector": "NixlConnector"}).validate()
    assert e.value.param == "kv_transfer_config"


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                      dict(tensor_parallel_size=2, pipeline_parallel_size=2)])
def test_engine_args_accept_tensor_and_pipeline_parallel(parallel):
    EngineArgs(model="m", kv_transfer_config={"kv_connector": "NixlConnector"}, **parallel).validate()


def test_params_parse():
    assert parse_kv_transfer_params({"do_remote_decode": True}).do_remote_decode
    params = parse_kv_transfer_params({**GOOD, "tp_size": 1})  # keys it does not know are ignored, as vLLM's
    assert params.remote_block_ids == (3, 4) and params.remote_port == 5600


@pytest.mark.parametrize("change, field", [
    ({"remote_block_ids": "3,4"}, "kv_transfer_params.remote_block_ids"),
    ({"remote_block_ids": [-1]}, "kv_transfer_params.remote_block_ids"),
    ({"remote_port": "5600"}, "kv_transfer_params.remote_port"),
    ({"remote_port": 70000}, "kv_transfer_params.remote_port"),
    ({"remote_host": ""}, "kv_transfer_params.remote_host"),
    ({"remote_engine_id": None}, "kv_transfer_params.remote_engine_id"),
    ({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill"),
    ({"do_remote_decode": True}, "kv_transfer_params"),
])
def test_malformed_params_name_the_field(change, field):
    with pytest.raises(InvalidParam) as e:
        SamplingParams(kv_transfer_params={**GOOD, **change})
    assert e.value.param == field


def test_params_need_one_output():
    with pytest.raises(InvalidParam) as e:
        SamplingParams(n=2, kv_transfer_params={"do_remote_decode": True})
    assert e.value.param == "kv_transfer_params"


def test_serve_flag_reaches_engine_args():
    import argparse

    from pagoda.entrypoints.openai.cli_args import add_serve_arguments, split_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    ns = parser.parse_args(["m", "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'])
    engine, _ = split_args(ns)
    assert engine.kv_transfer_config == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}


def test_request_field_is_checked_by_name():
    from pagoda.entrypoints.openai.protocol import CompletionRequest

    request = CompletionRequest(model="m", prompt="x", kv_transfer_params={**GOOD, "remote_port": "x"})
    with pytest.raises(InvalidParam) as e:
        request.sampling_params(1, None)
    assert e.value.param == "kv_transfer_params.remote_port"
