"""CUDA graphs' arguments: enforce_eager, compilation_config (and `pagoda serve`'s --compilation-config / -O),
the default capture sizes, and graphs on with CUDA, none on a CPU."""

import pytest

from pagoda.config import EngineArgs, create_engine_config
from pagoda.config.compilation import STAND_IN_ENV, capture_sizes, default_capture_sizes
from pagoda.errors import InvalidParam


def test_default_ladder_is_vllms_up_to_max_num_seqs():
    assert default_capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # max_num_seqs itself: every batch has a graph
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(1024)[-1] == 512  # vLLM's largest default


def test_given_sizes_sorted_deduplicated_and_capped_at_max_num_seqs():
    assert capture_sizes({"cudagraph_capture_sizes": [8, 2, 2, 64]}, 16) == (2, 8)
    assert capture_sizes('{"cudagraph_capture_sizes": [4, 1]}', 16) == (1, 4)  # the JSON text of -O
    assert capture_sizes({}, 10) == (1, 2, 4, 8, 10)
    assert capture_sizes({"cudagraph_capture_sizes": []}, 10) == ()


@pytest.mark.parametrize("raw, param", [
    ({"level": 3}, "compilation_config.level"),
    ({"cudagraph_capture_sizes": [1], "cudagraph_mode": "FULL"}, "compilation_config.cudagraph_mode"),
    ({"cudagraph_capture_sizes": [0, 2]}, "compilation_config.cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": "1,2"}, "compilation_config.cudagraph_capture_sizes"),
    ({"cudagraph_capture_sizes": [True]}, "compilation_config.cudagraph_capture_sizes"),
    ([1, 2], "compilation_config"),
    ("{not json", "compilation_config"),
])
def test_unimplemented_keys_and_bad_values_refused_by_name(raw, param):
    with pytest.raises(InvalidParam) as err:
        EngineArgs(compilation_config=raw).validate()
    assert err.value.param == param and param in str(err.value)


def test_graphs_on_with_cuda_only_and_off_with_enforce_eager(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv(STAND_IN_ENV, raising=False)
    model = str(tiny_llama_dir)
    sizes = {"cudagraph_capture_sizes": [1, 2]}
    assert create_engine_config(EngineArgs(model=model, device="cpu")).cudagraph_capture_sizes == ()
    assert create_engine_config(EngineArgs(model=model, device="cpu", compilation_config=sizes)
                                ).cudagraph_capture_sizes == ()
    monkeypatch.setenv(STAND_IN_ENV, "1")  # the CPU rehearses a CUDA device's choice
    assert create_engine_config(EngineArgs(model=model, device="cpu", max_num_seqs=12)
                                ).cudagraph_capture_sizes == (1, 2, 4, 8, 12)
    assert create_engine_config(EngineArgs(model=model, device="cpu", compilation_config=sizes)
                                ).cudagraph_capture_sizes == (1, 2)
    assert create_engine_config(EngineArgs(model=model, device="cpu", compilation_config=sizes, enforce_eager=True)
                                ).cudagraph_capture_sizes == ()


def test_serve_flags(capsys):
    import argparse

    from pagoda.entrypoints.cli import main
    from pagoda.entrypoints.openai.cli_args import add_serve_arguments, split_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for argv in (["-O", '{"cudagraph_capture_sizes": [1, 2]}'],
                 ["--compilation-config", '{"cudagraph_capture_sizes": [1, 2]}']):
        assert split_args(parser.parse_args(argv))[0].compilation_config == {"cudagraph_capture_sizes": [1, 2]}
    engine = split_args(parser.parse_args(["--enforce-eager"]))[0]
    assert engine.enforce_eager and engine.compilation_config is None
    for argv, message in [(["-O", '{"level": 3}'], "compilation-config.level is not supported"),
                          (["--compilation-config", "[1]"], "invalid JSON object")]:
        with pytest.raises(SystemExit) as err:
            main(["serve", *argv])
        assert err.value.code == 2 and message in capsys.readouterr().err
