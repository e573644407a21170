"""Speculative decoding parts without a model: the config, the n-gram proposer, the scheduler's draft
slots, and the rejection sampler's exactness."""

import pytest
import torch

from pagoda.config import EngineArgs, SchedulerConfig, SpeculativeConfig, create_engine_config
from pagoda.core.block_manager import BlockManager
from pagoda.core.runner_output import ModelRunnerOutput, SampledToken
from pagoda.core.scheduler import Scheduler
from pagoda.core.sequence import Sequence
from pagoda.errors import InvalidParam
from pagoda.sample.rejection_sampler import RejectionSampler
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.ngram_proposer import NgramProposer, can_speculate
from pagoda.worker.input_batch import InputBatch

pytestmark = pytest.mark.unit


# --- config --------------------------------------------------------------------------------------

def test_config_parses_vllm_dicts():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 2})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 3, 2)
    c = SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 2})
    assert (c.method, c.model) == ("draft_model", "/some/draft")
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 7})
    assert c.prompt_lookup_max == 7 and c.prompt_lookup_min == 7
    with pytest.raises(dataclasses_error()):
        c.num_speculative_tokens = 3  # frozen


def dataclasses_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("raw,key", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "3"}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     "prompt_lookup_min"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "eagle"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "model"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ("ngram", "JSON object"),
])
def test_bad_configs_name_the_key(raw, key):
    with pytest.raises(InvalidParam) as err:
        SpeculativeConfig.from_dict(raw)
    assert err.value.param == "speculative_config" and key in str(err.value)


def test_bad_config_is_refused_before_the_model_loads():
    with pytest.raises(InvalidParam) as err:
        create_engine_config(EngineArgs(model="/does/not/exist", speculative_config={"method": "ngram"}))
    assert "num_speculative_tokens" in str(err.value)


# --- n-gram proposer -----------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_longest_latest_match():
    proposer = NgramProposer(3, 1, 3)
    #            a  b  c  d  e  x  b  c  d  f  g  y  b  c  d
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2, 3, 4]
    assert proposer.propose(tokens, 10) == [6, 7, 8]  # "2 3 4" last seen before 6 7 8
    assert proposer.propose(tokens, 2) == [6, 7]
    assert proposer.propose([1, 2, 3, 4], 5) == []  # no earlier occurrence of any suffix
    assert NgramProposer(3, 2, 3).propose([5, 1, 7, 1], 5) == []  # a 1-token match is below the minimum
    assert NgramProposer(3, 1, 3).propose([5, 1, 7, 1], 5) == [7, 1]
    assert NgramProposer(4, 1, 2).propose([1, 2, 3, 1, 2], 5) == [3, 1, 2]


def test_requests_that_cannot_speculate():
    assert can_speculate(SamplingParams(), 0)
    assert not can_speculate(SamplingParams(logprobs=2), 5)
    assert not can_speculate(SamplingParams(presence_penalty=0.5), 5)
    assert not can_speculate(SamplingParams(repetition_penalty=1.2), 5)
    assert not can_speculate(SamplingParams(min_tokens=4, max_tokens=10), 3)
    assert can_speculate(SamplingParams(min_tokens=4, max_tokens=10), 4)
    assert not can_speculate(SamplingParams(structured_outputs={"choice": ["a", "b"]}), 0)
    # verification applies the logits processors
    assert can_speculate(SamplingParams(logit_bias={5: 3.0}, allowed_token_ids=[1, 2, 3], bad_words=["no"]), 0)


# --- scheduler and blocks ------------------------------------------------------------------------

def ngram_scheduler(num_blocks=32, block_size=4, k=4, budget=64):
    bm = BlockManager(num_blocks, block_size, True)
    spec = SpeculativeConfig("ngram", k, prompt_lookup_max=3, prompt_lookup_min=1)
    return Scheduler(SchedulerConfig(8, budget, True, 10_000), bm, spec)


def test_drafts_get_slots_and_rejected_ones_are_released():
    sched = ngram_scheduler()
    bm = sched.block_manager
    seq = Sequence("r", [1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=50))
    sched.add(seq)
    out = sched.schedule()  # the prompt
    assert out.scheduled[0].num_draft_tokens == 0
    sched.step_done(out)
    seq.append_token(3)  # ... 1 2 3: "1 2 3" occurred before, followed by 4 5 1 2
    out = sched.schedule()
    s = out.scheduled[0]
    assert s.draft_token_ids == [4, 5, 1, 2] and s.num_draft_tokens == 4 and s.num_new_tokens == 5
    assert s.new_token_ids == [3]  # the runner never keeps drafts
    assert len(bm.block_table(seq)) == 3  # 8 tokens + 4 drafts = 12 slots
    # the target accepted 1 draft (4) and sampled 9 instead of the second (5)
    sched.step_done(out, ModelRunnerOutput(verified={seq.seq_id: [SampledToken(4), SampledToken(9)]}))
    assert seq.num_computed_tokens == 9  # the last token and the accepted draft
    assert len(bm.block_table(seq)) == 3  # tokens 0..9 (the 9 appended next) fill 3 blocks of 4
    seq.append_token(4), seq.append_token(9)
    out = sched.schedule()
    assert out.scheduled[0].num_computed_tokens == 9 and out.scheduled[0].new_token_ids == [4, 9]
    sched.step_done(out, ModelRunnerOutput(verified={seq.seq_id: [SampledToken(1)]} if out.scheduled[0]
                                           .num_draft_tokens else {}))
    sched.finish(seq, "stop")
    bm.check_no_leaks()


def test_all_rejected_releases_the_draft_blocks():
    sched = ngram_scheduler(block_size=4, k=6)
    bm = sched.block_manager
    seq = Sequence("r", [1, 2, 3, 4, 5, 6, 7, 1], SamplingParams(max_tokens=50))
    sched.add(seq)
    sched.step_done(sched.schedule())
    seq.append_token(2)
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [3, 4, 5, 6, 7, 1]
    assert len(bm.block_table(seq)) == 4  # 9 tokens + 6 drafts
    free_before = bm.num_free_blocks
    sched.step_done(out, ModelRunnerOutput(verified={seq.seq_id: [SampledToken(8)]}))
    assert len(bm.block_table(seq)) == 3 and bm.num_free_blocks == free_before + 1
    sched.finish(seq, "stop")
    bm.check_no_leaks()


def test_the_runner_learns_the_block_that_replaces_a_rejected_drafts_block():
    # the runner keeps each sequence's table and learns only the blocks past those it was sent: a table cut
    # by rejected drafts must be sent again from the cut, or the runner keeps the released block, which the
    # pool gives to another sequence (KV written over another's) while the prefix cache hashes the new one
    sched = ngram_scheduler(block_size=4, k=6)
    bm = sched.block_manager
    runner = InputBatch(4, torch.device("cpu"))
    seq = Sequence("r", [1, 2, 3, 4, 5, 6, 7, 1], SamplingParams(max_tokens=50))
    sched.add(seq)
    out = sched.schedule()
    runner.apply_deltas(out)
    sched.step_done(out)
    seq.append_token(2)
    out = sched.schedule()  # 9 tokens + 6 drafts: 4 blocks
    runner.apply_deltas(out)
    released = bm.block_table(seq)[3]
    sched.step_done(out, ModelRunnerOutput(verified={seq.seq_id: [SampledToken(8)]}))  # all rejected
    assert len(bm.block_table(seq)) == 3
    other = Sequence("o", [50, 51, 52, 53], SamplingParams(max_tokens=50))
    bm.free_queue.move_to_end(released, last=False)  # the pool's next block: the released one
    assert bm.allocate(other, 4) == [] and bm.block_table(other) == [released]
    for token in (8, 9, 10, 11):  # decodes (no n-gram matches) until a fourth block again: another one
        seq.append_token(token)
        out = sched.schedule()
        runner.apply_deltas(out)
        assert runner.seqs[seq.seq_id].block_table == bm.block_table(seq)
        sched.step_done(out)
    assert len(bm.block_table(seq)) == 4 and released not in bm.block_table(seq)
    sched.finish(seq, "stop")
    bm.free(other)
    bm.check_no_leaks()


def test_drafts_stop_at_max_tokens_and_the_budget():
    sched = ngram_scheduler(k=5, budget=3)
    seq = Sequence("r", [1, 2, 3, 4, 1, 2, 3, 4, 1], SamplingParams(max_tokens=50))
    sched.add(seq)
    while seq.num_computed_tokens < seq.num_tokens:
        sched.step_done(sched.schedule())
    seq.append_token(2)
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [3, 4]  # budget 3: the token and 2 drafts
    sched = ngram_scheduler(k=5)
    seq = Sequence("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=3))
    sched.add(seq)
    sched.step_done(sched.schedule())
    seq.append_token(3)
    out = sched.schedule()
    assert out.scheduled[0].num_draft_tokens == 1  # 1 output so far; 1 draft + 1 sampled = max_tokens


def test_no_room_for_drafts_decodes_without_them():
    sched = ngram_scheduler(num_blocks=3, block_size=4, k=4)
    seq = Sequence("r", [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5], SamplingParams(max_tokens=50))
    sched.add(seq)
    sched.step_done(sched.schedule())
    seq.append_token(6)  # 12 tokens fill the 3 blocks: the drafts would need a 4th
    out = sched.schedule()
    assert out.scheduled[0].num_draft_tokens == 0 and out.scheduled[0].num_new_tokens == 1
    assert sched.num_preemptions == 0


# --- rejection sampler ---------------------------------------------------------------------------

CHI2_CRITICAL_DF4 = 18.47  # chi-square with 4 degrees of freedom at p = 0.001


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


P0 = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05])
P1 = torch.tensor([0.05, 0.10, 0.20, 0.30, 0.35])
Q = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40])  # the draft's distribution: far from P0


def run_sampler(num_seqs, drafts, draft_probs, seed=1234):
    gen = torch.Generator().manual_seed(seed)
    # k = 1: the target's distributions after the last token (P0) and after the draft (P1)
    target = torch.stack([P0, P1]).repeat(num_seqs, 1)
    return RejectionSampler(gen)(target, drafts, draft_probs, [False] * num_seqs, [None] * num_seqs)


@pytest.mark.parametrize("dense", ["all", "none", "half"], ids=["draft-model", "point-mass", "mixed"])
def test_rejection_sampling_keeps_the_target_distribution(dense):
    num_seqs = 40_000
    gen = torch.Generator().manual_seed(7)
    sampled = torch.multinomial(Q, num_seqs, replacement=True, generator=gen).tolist()
    # a draft model's draft, or an n-gram one (always token 0, whatever the target thinks; probs None);
    # "half": every other sequence of each kind in one batch
    is_dense = [dense == "all" or (dense == "half" and i % 2 == 0) for i in range(num_seqs)]
    drafts = [d if dense_row else 0 for d, dense_row in zip(sampled, is_dense)]
    draft_probs = None if dense == "none" else [Q.unsqueeze(0) if dense_row else None for dense_row in is_dense]
    runs = run_sampler(num_seqs, [[d] for d in drafts], draft_probs)
    first = torch.tensor([r[0] for r in runs])
    assert chi_square(first, P0) < CHI2_CRITICAL_DF4
    # where the draft was accepted the next token comes from the target after it
    second = torch.tensor([r[1] for r in runs if len(r) == 2])
    assert len(second) > 5_000 and chi_square(second, P1) < CHI2_CRITICAL_DF4
    for kind, expected in ((True, float(torch.minimum(P0, Q).sum())), (False, float(P0[0]))):
        rows = [r for r, dense_row in zip(runs, is_dense) if dense_row == kind]
        if rows:
            assert abs(sum(len(r) == 2 for r in rows) / len(rows) - expected) < 0.015


def test_the_chi_square_check_catches_a_wrong_formula():
    """Resampling from p itself after a rejection (instead of from max(0, p - q)) is biased: the same
    check on its output must fail, so the test above can."""
    num_seqs = 40_000
    gen = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(Q, num_seqs, replacement=True, generator=gen)
    accept = torch.rand(num_seqs, generator=gen) < (P0[drafts] / Q[drafts]).clamp(max=1)
    resampled = torch.multinomial(P0, num_seqs, replacement=True, generator=gen)
    wrong = torch.where(accept, drafts, resampled)
    assert chi_square(wrong, P0) > CHI2_CRITICAL_DF4


def test_greedy_accepts_exactly_the_argmax_prefix():
    target = torch.zeros(4, 5)
    target[0, 2] = target[1, 3] = target[2, 1] = target[3, 4] = 1.0  # one-hot: argmax 2, 3, 1, 4
    sampler = RejectionSampler(torch.Generator().manual_seed(0))
    assert sampler(target, [[2, 3, 0]], None, [True], [None]) == [[2, 3, 1]]
    assert sampler(target, [[2, 3, 1]], None, [True], [None]) == [[2, 3, 1, 4]]
    assert sampler(target, [[0, 3, 1]], None, [True], [None]) == [[2]]


def test_seeded_rows_reproduce():
    target = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    runs = []
    for _ in range(2):
        sampler = RejectionSampler(torch.Generator().manual_seed(len(runs) + 100))  # a different shared stream
        runs.append(sampler(target, [[1, 2]], None, [False], [torch.Generator().manual_seed(42)]))
    assert runs[0] == runs[1]


# --- metrics -------------------------------------------------------------------------------------

def test_spec_decode_metrics_are_published_only_when_on():
    from pagoda.engine.outputs import EngineStats
    from pagoda.entrypoints.openai.metrics import ServerMetrics

    stats = EngineStats(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
                        spec_decode_num_accepted_tokens=12, spec_decode_accepted_per_pos=[7, 4, 1])
    text = ServerMetrics("m", lambda: stats).render().decode()
    for line in ['pagoda:spec_decode_num_drafts_total{model_name="m"} 10.0',
                 'pagoda:spec_decode_num_draft_tokens_total{model_name="m"} 30.0',
                 'pagoda:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0',
                 'pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 7.0',
                 'pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0']:
        assert line in text
    assert "spec_decode" not in ServerMetrics("m", lambda: EngineStats()).render().decode()


def test_stats_line_reports_acceptance_since_the_previous_line():
    from pagoda.engine.outputs import EngineStats
    from pagoda.engine.stats_logger import StatsLogger

    now = [0.0]
    logger = StatsLogger(5.0, clock=lambda: now[0])
    now[0] = 10.0
    line = logger.log(EngineStats(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30,
                                  spec_decode_num_accepted_tokens=15, spec_decode_accepted_per_pos=[8, 5, 2]))
    assert "mean acceptance length 2.50" in line and "draft acceptance rate 50.0%" in line
    assert "accepted 1.5 tokens/s" in line and "per-position acceptance rate 0.80, 0.50, 0.20" in line
    now[0] = 20.0
    line = logger.log(EngineStats(spec_decode_num_drafts=20, spec_decode_num_draft_tokens=60,
                                  spec_decode_num_accepted_tokens=15, spec_decode_accepted_per_pos=[8, 5, 2]))
    assert "draft acceptance rate 0.0%" in line and "per-position acceptance rate 0.00, 0.00, 0.00" in line
    assert "Spec decode" not in StatsLogger(5.0).log(EngineStats())


def test_serve_flag_errors_name_the_flag(capsys):
    from pagoda.entrypoints.cli import main

    for value, message in [('{"method": "ngram"}', "--speculative-config: num_speculative_tokens"),
                           ('{"method": "ngram", "num_speculative_tokens": 2, "x": 1}', "--speculative-config: unknown key 'x'"),
                           ("[1, 2]", "argument --speculative-config: invalid JSON object"),
                           ("{bad json", "argument --speculative-config: invalid JSON object")]:
        with pytest.raises(SystemExit) as err:
            main(["serve", "--speculative-config", value])
        assert err.value.code == 2 and message in capsys.readouterr().err
