"""A random scheduling workload for the block-manager tests: sequences arrive, fork (n=2), finish or stop early
while a checking runner executes every step; at the end whatever is live is aborted and the caller checks leaks."""

from pagoda.core.sequence import Sequence
from pagoda.sampling_params import SamplingParams


def seq(n, start=0, max_tokens=100, n_out=1):
    return Sequence("r", list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, n=n_out))


def run_random_workload(sched, runner, block_manager, rng, steps, new_seq):
    """Runs `steps` steps; new_seq(step) makes an arriving sequence. Returns (the longest sequence's tokens, the
    peak of used blocks)."""
    live, longest, peak = [], 0, 0
    for step in range(steps):
        if rng.random() < 0.25 and len(live) < 8:
            s = new_seq(step)
            sched.add(s)
            live.append(s)
        out = sched.schedule()
        runner.execute(out)
        sched.step_done(out)
        for s in out.scheduled:
            parent = sched.get(s.seq_id)
            if s.num_samples and parent is not None:
                parent.append_token(rng.randrange(50))
                for index in range(1, s.num_samples):
                    child = sched.fork(parent, index)
                    child.token_ids[-1] = rng.randrange(50)
                    live.append(child)
                parent.pending_forks = 0
        assert sched.running or not (sched.waiting or sched.swapped)  # progress is always possible
        for s in list(live):
            longest = max(longest, s.num_tokens)
            if s.num_output_tokens >= s.params.max_tokens or rng.random() < 0.02:
                sched.finish(s, "length")
                live.remove(s)
        peak = max(peak, block_manager.num_used_blocks)
    for s in live:
        sched.finish(s, "abort")
    sched.schedule()
    return longest, peak
