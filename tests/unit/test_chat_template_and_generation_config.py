"""`--chat-template` (a file or the template itself) and the default sampling parameters the model's
generation_config.json gives (`--generation-config auto|vllm|DIR`)."""

import argparse
import json

import pytest

from pagoda.config import ModelConfig
from pagoda.worker.loader.generation_config import default_sampling_params

pytestmark = pytest.mark.unit


def _serve_parser():
    from pagoda.entrypoints.openai.cli_args import add_serve_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.error = lambda message: (_ for _ in ()).throw(SystemExit(message))
    add_serve_arguments(parser)
    return parser


def test_chat_template_flag_takes_a_file_or_a_template(tmp_path):
    from pagoda.entrypoints.openai.cli_args import split_args

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    _, server = split_args(_serve_parser().parse_args(["m", "--chat-template", str(tmp_path / "t.jinja")]))
    assert server.chat_template == template
    _, server = split_args(_serve_parser().parse_args(["m", "--chat-template", template]))
    assert server.chat_template == template
    with pytest.raises((SystemExit, argparse.ArgumentError)) as err:
        _serve_parser().parse_args(["m", "--chat-template", str(tmp_path / "missing.jinja")])
    assert "--chat-template" in str(err.value)


def test_generation_config_flag_reaches_the_engine_args():
    from pagoda.entrypoints.openai.cli_args import split_args

    assert split_args(_serve_parser().parse_args(["m"]))[0].generation_config == "auto"
    assert split_args(_serve_parser().parse_args(["m", "--generation-config", "vllm"]))[0].generation_config == "vllm"


def _model(path, mode="auto") -> ModelConfig:
    return ModelConfig(path=str(path), tokenizer_path=str(path), served_model_name="m", hf_config=None,
                       dtype="float32", max_model_len=64, generation_config=mode)


def test_defaults_are_the_keys_the_file_writes(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 20, "do_sample": True, "eos_token_id": 2}))
    assert default_sampling_params(_model(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 20}
    assert default_sampling_params(_model(tmp_path, "vllm")) == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 5}))
    assert default_sampling_params(_model(tmp_path, str(other))) == {"top_k": 5}


def test_missing_or_invalid_files_give_no_defaults(tmp_path):
    assert default_sampling_params(_model(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    assert default_sampling_params(_model(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text("not json")
    assert default_sampling_params(_model(tmp_path)) == {}
