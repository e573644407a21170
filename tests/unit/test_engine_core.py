"""The engine core's pure parts without a model: stop conditions, hold-back of stop strings, forking for
n > 1 and finishing, over a scripted executor that plays the model runner's part."""

import pytest

from pagoda.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagoda.core.runner_output import ModelRunnerOutput, SampledToken
from pagoda.core.sequence import Sequence
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.stop_checker import Stop, check_stop, find_stop_string, hold_back_chars, visible_text
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

EOS = {2}


def seq_with(output: list[int], **params) -> Sequence:
    seq = Sequence("r", [10, 11, 12], SamplingParams(**params))
    for token in output:
        seq.append_token(token)
    return seq


@pytest.mark.parametrize("output, params, text, new, expected", [
    ([5, 2], {}, "ab", 1, Stop("stop")),
    ([5, 2], {"ignore_eos": True}, "ab", 1, None),
    ([2], {"min_tokens": 2}, "a", 1, None),  # eos before min_tokens does not stop
    ([5, 7], {"stop_token_ids": [7]}, "ab", 1, Stop("stop", 7)),
    ([5, 6, 7], {"max_tokens": 3}, "abc", 1, Stop("length")),
    ([5, 6], {"stop": ["b"]}, "ab", 1, Stop("stop", "b", "a")),
    ([5, 6], {"stop": ["b"], "include_stop_str_in_output": True}, "ab", 1, Stop("stop", "b", "ab")),
    ([5, 6], {"stop": ["xy"]}, "axyz", 2, Stop("stop", "xy", "a")),  # the new text completes the stop string
    ([5, 6], {"stop": ["a"]}, "ab", 1, None),  # only windows reaching into the new text are searched
])
def test_check_stop(output, params, text, new, expected):
    assert check_stop(seq_with(output, **params), text, new, EOS, max_model_len=100) == expected


def test_the_context_length_stops_a_sequence():
    seq = seq_with([5, 6], max_tokens=None)
    assert check_stop(seq, "ab", 1, EOS, max_model_len=5) == Stop("length")
    assert check_stop(seq, "ab", 1, EOS, max_model_len=6) is None


def test_hold_back_of_stop_strings():
    params = SamplingParams(stop=["END", "x"])
    assert hold_back_chars(params) == 2
    assert visible_text("hello EN", 2, finished=False) == "hello "
    assert visible_text("hello EN", 2, finished=True) == "hello EN"
    assert visible_text("E", 2, finished=False) == ""
    assert find_stop_string("hello END", 1, params) == Stop("stop", "END", "hello ")


class ScriptedExecutor:
    """Plays the model runner: every sequence that samples gets the next scripted token."""

    pipeline_depth = 1

    def __init__(self, tokens: list[int]):
        self.tokens = iter(tokens)
        self.batches = []

    def submit(self, out):
        self.batches.append(out)
        result = ModelRunnerOutput()
        for s in out.scheduled:
            for _ in range(s.num_samples):
                result.sampled.setdefault(s.seq_id, []).append(SampledToken(next(self.tokens)))
        return result

    def wait(self, handle):
        return handle


def core_with(tokens, num_blocks=16) -> EngineCore:
    """The engine core over the real config type; no checkpoint: the scripted executor plays the model."""
    from transformers import LlamaConfig

    hf_config = LlamaConfig(num_hidden_layers=2)  # full attention: no window
    config = EngineConfig(
        model=ModelConfig(path="scripted", tokenizer_path="scripted", served_model_name="scripted",
                          hf_config=hf_config, dtype="float32", max_model_len=64),
        cache=CacheConfig(block_size=4, enable_prefix_caching=True, gpu_memory_utilization=0.9,
                          kv_cache_memory_gib=None),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
                                  max_model_len=64),
        parallel=ParallelConfig(), device="cpu", attention_backend="torch", seed=0)
    return EngineCore(config, ScriptedExecutor(tokens), num_blocks)


def test_n_outputs_fork_at_the_end_of_the_prompt_and_share_its_blocks():
    core = core_with([100, 101, 102, 200, 201, 202])
    seq = Sequence("r", list(range(6)), SamplingParams(n=3))
    core.add(seq)
    step = core.step()
    assert [child.index for _, child in step.forks] == [1, 2]
    assert [(s.index, t.token_id) for s, t in step.new_tokens] == [(0, 100), (1, 101), (2, 102)]
    children = [child for _, child in step.forks]
    assert all(c.token_ids[:6] == seq.token_ids[:6] for c in children)
    # the prompt's full block is shared by all three, copy-on-write
    table = core.block_manager.block_table(seq)
    assert all(core.block_manager.block_table(c)[0] == table[0] for c in children)
    step = core.step()  # one decode for each of the three
    assert sorted(t.token_id for _, t in step.new_tokens) == [200, 201, 202]
    for s in [seq, *children]:
        core.finish(s, "stop")
    core.step()
    assert not core.has_unfinished()
    core.block_manager.check_no_leaks()


def test_a_sequence_finished_while_its_step_ran_gets_no_token():
    core = core_with([1, 2, 3])
    seq = Sequence("r", [7, 8], SamplingParams())
    core.add(seq)
    scheduled = core.schedulers[0].schedule()
    core.schedulers[0].in_flight.clear()
    core.finish(seq, "abort")
    step = core._update(core.schedulers[0], ModelRunnerOutput(sampled={scheduled.scheduled[0].seq_id:
                                                                       [SampledToken(5)]}))
    assert step.new_tokens == [] and seq.num_output_tokens == 0
