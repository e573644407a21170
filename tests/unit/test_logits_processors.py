"""logit_bias, allowed_token_ids and bad_words on a batch's logits tensor; the scheduler skipping the
prefix cache for requests that score their prompt."""

import pytest
import torch

from pagoda.sample.logits_processors import apply_logits_processors, banned_next_tokens, tokenize_bad_words
from pagoda.sampling_params import SamplingParams

VOCAB = 10


def test_a_batch_without_processors_is_returned_untouched():
    logits = torch.randn(3, VOCAB)
    assert apply_logits_processors(logits, [SamplingParams()] * 3, [[], [1], [2]]) is logits


def test_each_row_gets_its_own_processors_in_one_tensor():
    logits = torch.zeros(4, VOCAB)
    params = [SamplingParams(logit_bias={3: 5.0, 4: -2.5}),
              SamplingParams(),
              SamplingParams(allowed_token_ids=[1, 2]),
              SamplingParams(bad_words_token_ids=[[7], [5, 6]])]
    out = apply_logits_processors(logits, params, [[], [], [], [1, 5]])
    assert out is not logits and torch.equal(logits, torch.zeros(4, VOCAB))  # a copy unless in_place
    assert out[0, 3] == 5.0 and out[0, 4] == -2.5 and out[0].abs().sum() == 7.5
    assert torch.equal(out[1], torch.zeros(VOCAB))
    assert torch.isfinite(out[2]).tolist() == [i in (1, 2) for i in range(VOCAB)]
    assert out[3, 7] == float("-inf") and out[3, 6] == float("-inf")  # 6 follows the generated 5
    assert torch.isfinite(out[3]).sum() == VOCAB - 2


def test_in_place_writes_into_the_given_tensor():
    logits = torch.zeros(1, VOCAB)
    assert apply_logits_processors(logits, [SamplingParams(logit_bias={1: 1.0})], [[]], in_place=True) is logits
    assert logits[0, 1] == 1.0


@pytest.mark.parametrize(("output", "banned"), [([], [9]), ([1], [9]), ([1, 2], [9, 3]), ([2], [9])])
def test_bad_words_ban_the_last_token_after_the_prefix(output, banned):
    assert banned_next_tokens([[9], [1, 2, 3]], output) == banned


class _Tokenizer:
    """Whole words, as a BPE tokenizer writes them: " word" is one token unless the word is unknown."""

    vocab = {"dog": 1, " dog": 2, "hot": 3, " ": 4, "big": 5, " big": 6, "cat": 7}

    def encode(self, text, add_special_tokens=False):
        ids = []
        for i, word in enumerate(text.split(" ")):
            if i:
                ids += [self.vocab[" " + word]] if " " + word in self.vocab else [self.vocab[" "]]
                if " " + word in self.vocab:
                    continue
            if word:
                ids.append(self.vocab[word])
        return ids


def test_bad_words_are_tokenized_with_and_without_a_leading_space():
    assert tokenize_bad_words(_Tokenizer(), ["dog"]) == [[1], [2]]
    # " hot" would be a lone space then "hot": the space alone is never banned
    assert tokenize_bad_words(_Tokenizer(), ["hot"]) == [[3]]
    assert tokenize_bad_words(_Tokenizer(), ["big cat"]) == [[5, 4, 7], [6, 4, 7]]  # " cat" is not a token


def test_uses_logits_processors():
    assert not SamplingParams().uses_logits_processors
    assert not SamplingParams(logit_bias={}).uses_logits_processors
    assert SamplingParams(allowed_token_ids=[1]).uses_logits_processors
    assert SamplingParams(logit_bias={1: 0.5}).uses_logits_processors


def test_a_request_scoring_its_prompt_computes_it_whole_despite_the_prefix_cache():
    from pagoda.config import SchedulerConfig
    from pagoda.core.block_manager import BlockManager
    from pagoda.core.scheduler import Scheduler
    from pagoda.core.sequence import Sequence

    sched = Scheduler(SchedulerConfig(8, 32, True, 10_000), BlockManager(64, 4, True))
    first = Sequence("a", list(range(12)), SamplingParams(max_tokens=4))
    sched.add(first)
    sched.step_done(sched.schedule())
    scored = Sequence("b", list(range(14)), SamplingParams(max_tokens=4, prompt_logprobs=0))
    plain = Sequence("c", list(range(14)), SamplingParams(max_tokens=4))
    sched.add(scored)
    sched.add(plain)
    by_id = {s.seq_id: s for s in sched.schedule().scheduled}
    assert (by_id[scored.seq_id].num_computed_tokens, by_id[scored.seq_id].num_new_tokens) == (0, 14)
    assert by_id[plain.seq_id].num_computed_tokens == 12  # the others still hit the cache
