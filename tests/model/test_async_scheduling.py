"""--async-scheduling: step N+1 is scheduled while step N runs (the runner on its own thread), decodes on the
token N samples. The tokens must be exactly the synchronous engine's, whatever ends a request (max_tokens,
a stop string, a stop token, an abort), with seeds, penalties, n > 1, prompts in chunks and a small cache."""

import pytest

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.model

PROMPTS = ["Hello", "Paris is the capital of", "one two three four five six seven eight nine ten",
           "The quick brown fox", "a b c", "In 1492", "Once upon a time there was", "x", "Pick one:"]


def mixed_params():
    return [
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0),
        SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0),  # its only token is its prompt's end
        SamplingParams(max_tokens=20, ignore_eos=True, seed=7, temperature=0.9, top_k=20),
        SamplingParams(max_tokens=16, ignore_eos=True, seed=3, temperature=1.0, repetition_penalty=1.3,
                       frequency_penalty=0.5),
        SamplingParams(max_tokens=30, temperature=0.0, stop=["e"]),  # ends on a stop string mid-run
        SamplingParams(max_tokens=9, ignore_eos=True, seed=11, n=3, temperature=1.0),  # forks at its prompt's end
        SamplingParams(max_tokens=25, temperature=0.0, min_tokens=3, stop_token_ids=[5, 9, 17]),
        SamplingParams(max_tokens=6, ignore_eos=True, seed=5, temperature=0.8, min_p=0.1, logprobs=2),
        # a grammar's next mask needs the token before: this one is never scheduled ahead, the rest are
        SamplingParams(max_tokens=40, seed=2, temperature=1.0,
                       structured_outputs=StructuredOutputsParams(choice=["alpha beta", "gamma", "delta epsilon"])),
    ]


def run(model_dir, async_scheduling: bool, **engine_kwargs):
    with LLM(str(model_dir), dtype="float32", kv_cache_memory=0.02, async_scheduling=async_scheduling,
             **engine_kwargs) as llm:
        assert llm.engine.core.async_scheduling == async_scheduling
        outs = llm.generate(PROMPTS, mixed_params(), use_tqdm=False)
        llm.engine.block_manager.check_no_leaks()
        timer = llm.engine.core.timer
        return [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outs], timer


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}],
                         ids=["default", "chunks-and-few-slots"])
def test_async_scheduling_gives_the_synchronous_engines_tokens(tiny_llama_dir, engine_kwargs):
    sync, _ = run(tiny_llama_dir, False, **engine_kwargs)
    ahead, timer = run(tiny_llama_dir, True, **engine_kwargs)
    assert ahead == sync
    assert timer.num_steps > 0 and timer.num_gaps > 0


def test_async_scheduling_with_an_abort_and_a_cache_that_runs_out(tiny_llama_dir):
    """A request aborted while its next step is already scheduled, and preemption under a tiny cache: the
    others' tokens are the synchronous engine's and no block leaks."""
    def outputs(async_scheduling):
        with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.002, block_size=16,
                 async_scheduling=async_scheduling) as llm:
            engine = llm.engine
            params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(str(i), prompt, params)
            done, steps = {}, 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
                steps += 1
                if steps == 5:
                    engine.abort_request("3")
            engine.block_manager.check_no_leaks()
            return {k: v for k, v in done.items() if k != "3"}, engine.get_stats().num_preemptions

    sync, _ = outputs(False)
    ahead, preemptions = outputs(True)
    assert ahead == sync and len(ahead) == len(PROMPTS) - 1


def test_async_scheduling_runs_all_of_the_runner_on_its_thread(tiny_llama_dir, monkeypatch):
    """Loading, profiling, the cache and every batch on the one thread that runs the batches: a second thread
    running torch's parallel regions would give the process a second OpenMP team, and libgomp's waiting threads
    would then sleep between a step's regions instead of spinning (executor/uni.py)."""
    import threading

    from pagoda.executor import uni

    seen: dict[str, set[str]] = {}
    for name in ("__init__", "determine_num_blocks", "allocate_kv_cache", "execute"):
        def traced(self, *args, _original=getattr(uni.ModelRunner, name), _name=name, **kwargs):
            seen.setdefault(_name, set()).add(threading.current_thread().name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(uni.ModelRunner, name, traced)
    with LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.02, async_scheduling=True) as llm:
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert set(seen) == {"__init__", "determine_num_blocks", "allocate_kv_cache", "execute"}
    threads = set().union(*seen.values())
    assert len(threads) == 1 and next(iter(threads)).startswith("pagoda-runner"), seen
