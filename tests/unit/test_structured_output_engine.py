"""Structured outputs offline, on a tiny random checkpoint (garbage unconstrained): every constrained output
parses and validates, greedy and sampled, n > 1, mixed with free requests in one batch, across preemption."""

import json
import re

import jsonschema
import pytest

from pagoda.entrypoints.llm import LLM
from pagoda.errors import InvalidParam
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "ok", "kind", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["Paris", "San Francisco", "Kubernetes"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # a small KV cache so a batch of long outputs preempts and recomputes
    with LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, max_num_seqs=16,
             kv_cache_memory=0.002) as llm:
        yield llm


def _check(spec: StructuredOutputsParams, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice, text


def _check_tokens(llm, spec, completion):
    """Every token is one the grammar allowed after the ones before it (an output that max_tokens cut is a
    prefix of the language; a finished one ends where the grammar may)."""
    matcher = llm.engine.executor.runner._grammar_backend().matcher(spec)
    assert all(matcher.accept(token) for token in completion.token_ids), completion
    assert matcher.is_terminated == (completion.finish_reason == "stop"), completion


SPECS = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
         StructuredOutputsParams(choice=CHOICES)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_always_match_in_a_mixed_batch(llm, temperature):
    prompts, params = [], []
    for i in range(3):
        for spec in SPECS:
            prompts.append(f"Hello {i}")
            params.append(SamplingParams(structured_outputs=spec, max_tokens=200, temperature=temperature,
                                         seed=i, n=2 if i == 1 else 1))
        prompts.append(f"free {i}")  # a free request in the same batch
        params.append(SamplingParams(max_tokens=30, temperature=temperature, seed=i, ignore_eos=True))
    outputs = llm.generate(prompts, params)
    for out, p in zip(outputs, params):
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            if p.structured_outputs is None:
                assert len(completion.token_ids) == 30
                continue
            _check_tokens(llm, p.structured_outputs, completion)
            if temperature > 0:
                # sampled from a random model: it may not close a string within max_tokens, and its byte tokens
                # may form invalid UTF-8, which the grammar counts in bytes and the decoded text as U+FFFD each
                continue
            assert completion.finish_reason == "stop", completion
            _check(p.structured_outputs, completion.text)


def test_json_object_and_grammar(llm):
    grammar = 'root ::= "yes" | "no" | ("maybe " [0-9])'
    outs = llm.generate(["a", "b"], [
        SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True), max_tokens=200, seed=3),
        SamplingParams(structured_outputs=StructuredOutputsParams(grammar=grammar), max_tokens=20, seed=3)])
    json_out = outs[0].outputs[0]
    _check_tokens(llm, StructuredOutputsParams(json_object=True), json_out)
    if json_out.finish_reason == "stop":  # sampled from a random model: it may not close a string in time
        assert isinstance(json.loads(json_out.text), dict)
    assert re.fullmatch(r"yes|no|maybe [0-9]", outs[1].outputs[0].text)


@pytest.mark.parametrize("kwargs", [{}, {"json": SCHEMA, "regex": "a"}, {"choice": []}, {"choice": ["a", 1]},
                                    {"json": 5}, {"regex": ""}, {"json_object": "yes"}])
def test_malformed_constraints_are_refused_at_construction(kwargs):
    with pytest.raises(InvalidParam) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == "structured_outputs"


def test_a_constraint_that_does_not_compile_names_its_field(llm):
    for spec in [StructuredOutputsParams(json={"type": "nonsense"}, field="response_format"),
                 StructuredOutputsParams(regex="(unclosed", field="guided_regex"),
                 StructuredOutputsParams(grammar="root ::= undefined_rule", field="structured_outputs")]:
        with pytest.raises(InvalidParam) as e:
            llm.generate(["x"], SamplingParams(structured_outputs=spec))
        assert e.value.param == spec.field
        assert ".cc:" not in str(e.value), e.value  # the grammar engine's log prefix is not for clients


def test_sampling_params_takes_a_dict_and_refuses_ignore_eos():
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert p.structured_outputs.regex == "a+"
    with pytest.raises(InvalidParam, match="structured_outputs"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(InvalidParam) as e:
        SamplingParams(structured_outputs={"regex": "a"}, ignore_eos=True)
    assert e.value.param == "ignore_eos"


def test_matchers_follow_sequences_through_preemption(llm, tiny_llama_dir):
    # 10 blocks of 16 tokens and four outputs of dozens of tokens each: sequences are preempted, recomputed,
    # and their matchers rebuilt from their tokens; the outputs are those of a run without preemption
    spec = StructuredOutputsParams(regex=r"[0-9]{100}")
    prompts = [f"Numbers {i}:" for i in range(4)]
    params = [SamplingParams(structured_outputs=spec, max_tokens=120, temperature=0.0) for _ in prompts]
    with LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=160,
             kv_cache_memory=10 * 8192 / 2**30) as small:
        tight = small.generate(prompts, params)
        assert small.engine.get_stats().num_preemptions > 0
    roomy = llm.generate(prompts, params)
    for a, b in zip(tight, roomy):
        assert re.fullmatch(spec.regex, a.outputs[0].text) and a.outputs[0].finish_reason == "stop"
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
