"""vLLM 0.32's admission knobs, as one scheduler step applies them (SchedulerConfig's fields; flags in
docs/server.md):

- ``max_num_active_seqs``: the sequences running at once (default ``max_num_seqs``);
- ``max_num_scheduled_tokens``: the tokens a step computes (default ``max_num_batched_tokens``);
- ``long_prefill_token_threshold``: a prompt's tokens a step at most, with chunked prefill, except while it is the
  only request (nobody to starve); ``long_prefill_token_threshold_adaptive`` floors it at the step's fair share,
  its tokens over the requests;
- ``watermark`` and ``reserve_full_isl``: the KV blocks a waiting or preempted sequence must leave free to be
  admitted while others run: a share of the cache, and the blocks the rest of a new prompt will take after this
  step's chunk (so a long prompt is not admitted only to preempt others, or be preempted, chunks later; counted
  for one KV cache group, the full-attention layers', where a hybrid model's windowed groups take fewer);
- ``prefill_schedule_interval``: prompts compute only every Nth step while decodes run (vLLM's cadence for
  data-parallel ranks, whose steps then carry prompts together).

A lone request is never held back by them: with nothing else running nobody is starved or crowded out, and each
step makes progress.
"""

from dataclasses import dataclass

from pagoda.config import SchedulerConfig


@dataclass(frozen=True)
class StepLimits:
    active_seqs: int
    step_tokens: int
    long_prefill_threshold: int  # 0: no cap
    adaptive_threshold: bool
    chunked_prefill: bool
    watermark_blocks: int
    reserve_full_isl: bool
    prefill_interval: int

    @classmethod
    def of(cls, config: SchedulerConfig, num_blocks: int) -> "StepLimits":
        return cls(active_seqs=config.max_num_active_seqs or config.max_num_seqs,
                   step_tokens=config.max_num_scheduled_tokens or config.max_num_batched_tokens,
                   long_prefill_threshold=config.long_prefill_token_threshold,
                   adaptive_threshold=config.long_prefill_token_threshold_adaptive,
                   chunked_prefill=config.enable_chunked_prefill,
                   watermark_blocks=int(config.watermark * num_blocks),
                   reserve_full_isl=config.reserve_full_isl,
                   prefill_interval=config.prefill_schedule_interval)

    def prompt_cap(self, remaining: int, num_requests: int) -> int:
        """The most tokens a sequence with `remaining` to compute may take this step, among `num_requests`
        waiting or running."""
        threshold = self.long_prefill_threshold
        if remaining <= 1 or not threshold or not self.chunked_prefill or num_requests <= 1:
            return remaining
        if self.adaptive_threshold:
            threshold = max(threshold, self.step_tokens // num_requests)
        return min(remaining, threshold)

    def blocks_kept_free(self, others_running: bool, block_size: int = 1, prompt_tokens: int = 0,
                         tokens_after_step: int = 0) -> int:
        """The free blocks an admission must leave while others run: the watermark, and for a new prompt
        (prompt_tokens > 0) with reserve_full_isl the blocks its tokens past this step's will take."""
        if not others_running:
            return 0
        rest = 0
        if self.reserve_full_isl and prompt_tokens > tokens_after_step:
            rest = -(-prompt_tokens // block_size) - -(-tokens_after_step // block_size)
        return self.watermark_blocks + rest

    def off_cadence(self, step_index: int) -> bool:
        """Whether step `step_index` is one where prompts wait while decodes run (prefill_schedule_interval)."""
        return self.prefill_interval > 1 and step_index % self.prefill_interval != 0
