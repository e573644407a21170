"""The wire format of `POST /v1/embeddings` (OpenAI's, with vLLM's pooling extras)."""

import time
from typing import Literal

from pydantic import Field

from pagoda.entrypoints.openai.protocol import OpenAIModel, PositiveInt64, PromptInput
from pagoda.pooling_params import POOLING_TYPES


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt64 | None = None  # only the model's own hidden size: no Matryoshka truncation
    user: str | None = None
    # extras: how the final hidden states become one vector
    pooling_type: Literal[POOLING_TYPES] = "last"  # type: ignore[valid-type]
    normalize: bool = True


class EmbeddingData(OpenAIModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32, as OpenAI's encoding_format


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
