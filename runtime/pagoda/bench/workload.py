"""The synthetic workload shared by the benchmarks: seeded prompt and output lengths, and the checks of the flags
that set them."""

import argparse
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


def check_workload_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--num-requests >= 1 and length ranges 1 <= MIN <= MAX, else a CLI error naming the flag."""
    if args.num_requests < 1:
        parser.error(f"--num-requests must be >= 1; got {args.num_requests}")
    for name in ("prompt_len", "output_len"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            parser.error(f"--{name.replace('_', '-')} MIN MAX needs 1 <= MIN <= MAX; got {low} {high}")
