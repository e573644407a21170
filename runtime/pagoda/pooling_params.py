"""What an embedding request asks for (torch-free: it crosses processes with the scheduler's output)."""

from dataclasses import dataclass

from pagoda.errors import InvalidParam

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """`last`: the final hidden state of the prompt's last token (what a decoder LM's next-token prediction
    reads, and vLLM's default for decoder models); `mean`: the average over every prompt token. `normalize`
    scales the vector to unit L2 norm (vLLM's default), so a dot product is the cosine similarity."""

    pooling_type: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidParam("pooling_type", f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                               f"got {self.pooling_type!r}")

    @property
    def needs_every_token(self) -> bool:
        """Mean pooling reads every prompt token's hidden state, so no prefix may come from the cache."""
        return self.pooling_type == "mean"
