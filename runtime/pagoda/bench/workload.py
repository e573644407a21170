"""The synthetic workload shared by the benchmarks: seeded prompt and output lengths."""

import random
from dataclasses import dataclass


@dataclass
class SyntheticRequest:
    prompt_token_ids: list[int]
    output_len: int


def synthetic_requests(num_requests: int = 64, seed: int = 0, prompt_len: tuple[int, int] = (32, 512),
                       output_len: tuple[int, int] = (32, 256), vocab_size: int = 32000,
                       special_ids: set[int] | None = None) -> list[SyntheticRequest]:
    """Random token prompts (no special tokens) with uniform lengths, reproducible from the seed."""
    rng = random.Random(seed)
    special_ids = special_ids or set()
    allowed = [t for t in range(min(vocab_size, 32000)) if t not in special_ids]
    return [SyntheticRequest([rng.choice(allowed) for _ in range(rng.randint(*prompt_len))],
                             rng.randint(*output_len)) for _ in range(num_requests)]
