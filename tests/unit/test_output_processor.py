"""Output processing without a model: a real tokenizer, tokens fed one at a time as the core would."""

import pytest
from checkpoints import write_tokenizer
from transformers import AutoTokenizer

from pagoda.core.runner_output import SampledToken
from pagoda.core.sequence import Sequence
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.outputs import RequestMetrics
from pagoda.engine.request_state import RequestState
from pagoda.engine.stop_checker import Stop
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def run(tokenizer, text: str, **params):
    """Feed `text`'s tokens one by one; returns the request state, the output and the stop decision."""
    prompt = tokenizer.encode("Hi")
    sp = SamplingParams(max_tokens=100, logprobs=1, **params)
    seq = Sequence("r", prompt, sp)
    state = RequestState("r", "Hi", prompt, sp, RequestMetrics(0.0))
    state.add_seq(seq)
    processor = OutputProcessor(tokenizer, eos_token_ids={tokenizer.eos_token_id}, max_model_len=512)
    stop = None
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        seq.append_token(token_id)
        stop = processor.process_token(state, seq, SampledToken(token_id, -0.5, 1, [token_id], [-0.5]))
        if stop is not None:
            break
    return state, state.outputs[seq.seq_id], stop


def test_text_grows_and_multibyte_characters_are_never_split(tokenizer):
    state, out, stop = run(tokenizer, "héllo 東京 🙂")
    assert stop is None and out.detok.text == "héllo 東京 🙂"
    assert len(out.logprobs) == len(state.seqs[0].output_token_ids)
    assert out.cumulative_logprob == pytest.approx(-0.5 * len(out.logprobs))


def test_a_stop_string_cuts_the_text_and_names_itself(tokenizer):
    _, out, stop = run(tokenizer, "Paris is the capital of France.", stop=["capital"])
    assert stop == Stop("stop", "capital", "Paris is the ")
    assert out.detok.text == "Paris is the "


def test_eos_stops_and_the_text_excludes_it(tokenizer):
    _, out, stop = run(tokenizer, "hello" + tokenizer.eos_token)
    assert stop == Stop("stop") and out.detok.text == "hello"


def test_running_output_holds_back_a_possible_stop_string(tokenizer):
    state, _, stop = run(tokenizer, "hello EN", stop=["END"])
    assert stop is None
    assert state.to_output().outputs[0].text == "hello "  # "EN" might begin "END"
