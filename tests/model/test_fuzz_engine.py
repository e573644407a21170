"""Property-based fuzz of sampling parameters and prompts straight into the engine (no HTTP): whatever a
caller passes, SamplingParams or input processing refuses it with InvalidParam naming a field, or the
request runs to its end; the engine never raises inside a step and no block is left held.

`PAGODA_FUZZ_EXAMPLES` sets the number of examples (default 40; `make fuzz` runs many more)."""

import itertools
import math
import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagoda import SamplingParams
from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.errors import InvalidParam

pytestmark = [pytest.mark.model, pytest.mark.fuzz]

EXAMPLES = int(os.environ.get("PAGODA_FUZZ_EXAMPLES", "40"))
MAX_STEPS = 200

extreme_ints = st.one_of(st.integers(-5, 70), st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1,
                                                                2**64, 10**30, -(10**30)]))
extreme_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3),
                           st.sampled_from([0.0, 1.0, 1e-300, 5e-324, -0.0, 1e308]))
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=3))

# half the examples stay in range (so requests run: seeds near int64's ends, n > 1, stop strings,
# logprobs, penalties), half go anywhere
valid_kwargs = st.fixed_dictionaries({}, optional={
    "n": st.integers(1, 4), "temperature": st.floats(0, 3), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 400),
    "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 5), "seed": st.one_of(st.integers(-(2**63), 2**63 - 4), st.none()),
    "max_tokens": st.integers(1, 24), "min_tokens": st.integers(0, 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "stop_token_ids": st.lists(st.integers(0, 319)),
    "ignore_eos": st.booleans(), "logprobs": st.one_of(st.integers(0, 20), st.none()),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
})
wild_kwargs = st.fixed_dictionaries({}, optional={
    "n": st.one_of(extreme_ints, junk),
    "temperature": st.one_of(extreme_floats, junk),
    "top_p": extreme_floats, "top_k": extreme_ints, "min_p": extreme_floats,
    "presence_penalty": extreme_floats, "frequency_penalty": extreme_floats, "repetition_penalty": extreme_floats,
    "seed": st.one_of(extreme_ints, st.none()),
    "max_tokens": st.one_of(extreme_ints, st.none()), "min_tokens": extreme_ints,
    "stop": st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4), junk),
    "stop_token_ids": st.one_of(st.none(), st.lists(extreme_ints, max_size=4)),
    "ignore_eos": st.one_of(st.booleans(), junk), "logprobs": st.one_of(extreme_ints, st.none()),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
})
sampling_kwargs = st.one_of(valid_kwargs, wild_kwargs)
prompts = st.one_of(
    st.text(min_size=1, max_size=40), st.lists(st.integers(0, 319), min_size=1, max_size=40),
    st.text(max_size=300),  # unicode, control characters, surrogates excluded by hypothesis' default
    st.just(""), st.just("x" * 100_000),
    st.lists(extreme_ints, max_size=40),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(extreme_ints, max_size=40)}),
    st.fixed_dictionaries({"prompt": st.text(max_size=50)}),
    st.just({"neither": 1}), junk,
)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), dtype="float32", max_model_len=64,
                                                   max_num_seqs=8, kv_cache_memory=0.01))
    yield engine
    engine.shutdown()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(kwargs=sampling_kwargs, prompt=prompts)
def test_any_input_is_refused_by_name_or_finishes(engine, kwargs, prompt):
    try:
        params = SamplingParams(**kwargs)
    except InvalidParam as e:
        assert e.param in kwargs, (e.param, kwargs)
        event("refused by SamplingParams")
        return
    for value in (params.temperature, params.top_p, params.min_p, params.repetition_penalty):
        assert math.isfinite(value)
    request_id = f"fuzz-{next(_ids)}"
    try:
        engine.add_request(request_id, prompt, params)
    except InvalidParam as e:
        assert e.param
        event("refused by input processing")
        return
    final = None
    for _ in range(MAX_STEPS):
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
        if final is not None:
            break
    assert final is not None, "the request did not finish"
    assert final.error is None
    event("ran to the end")
    assert len(final.outputs) == params.n
    assert all(c.finish_reason in ("stop", "length") for c in final.outputs)
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_no_leaks()


_ids = itertools.count()
