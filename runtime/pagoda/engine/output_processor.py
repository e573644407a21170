"""Output processing: each new token's logprobs and text (incremental detokenization), the stop check,
and the RequestOutput a caller sees. Owns the tokenizer's side of generation; knows nothing of blocks,
schedulers or the model."""

from pagoda.core.runner_output import SampledToken
from pagoda.core.sequence import Sequence
from pagoda.engine.detokenizer import detokenize_incrementally, flush
from pagoda.engine.outputs import Logprob
from pagoda.engine.request_state import RequestState
from pagoda.engine.stop_checker import Stop, check_stop


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process_token(self, state: RequestState, seq: Sequence, token: SampledToken) -> Stop | None:
        """`token` was just appended to `seq`: record its logprobs and text; returns why it stops, if it does."""
        out = state.outputs[seq.seq_id]
        params = seq.params
        if out.logprobs is not None:
            out.logprobs.append(self._logprobs(token))
            out.cumulative_logprob += token.logprob
        new_text = detokenize_incrementally(self.tokenizer, seq.token_ids, out.detok, params.skip_special_tokens)
        stop = check_stop(seq, out.detok.text, len(new_text), self.eos_token_ids, self.max_model_len)
        if stop is not None:
            if stop.text is not None:  # a stop string cut the text
                out.detok.text = stop.text
            else:  # the text so far may end in a character still waiting for its last bytes
                flush(self.tokenizer, seq.token_ids, out.detok, params.skip_special_tokens)
        return stop

    def process_prompt_logprobs(self, state: RequestState, start: int, scored: list[SampledToken]) -> None:
        """Prompt tokens from position `start` on were scored. A recomputed prefill (after a preemption, or
        a fork's) scores positions again: each is kept once."""
        if state.prompt_logprobs is None:
            return
        for position, token in enumerate(scored, start=start):
            if position == len(state.prompt_logprobs):
                state.prompt_logprobs.append(self._logprobs(token))

    def _logprobs(self, token: SampledToken) -> dict[int, Logprob]:
        entry = {token.token_id: Logprob(token.logprob, token.rank, self.tokenizer.decode([token.token_id]))}
        for rank, (tid, lp) in enumerate(zip(token.top_token_ids or [], token.top_logprobs or []), start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, self.tokenizer.decode([tid]))
        return entry
