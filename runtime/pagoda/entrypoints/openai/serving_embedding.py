"""`POST /v1/embeddings` for decoder models: each input is one engine request with PoolingParams. The engine
runs its prompt like any prefill (batched with generating requests, chunked, over the paged KV cache; its
blocks are freed when it finishes) and pools the final hidden states instead of sampling."""

import base64

import numpy as np
from fastapi import Request

from pagoda.entrypoints.openai.embedding_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagoda.entrypoints.openai.serving_base import OpenAIServing, cancel_on_disconnect, collect_finals
from pagoda.entrypoints.openai.serving_completion import split_prompts
from pagoda.http.errors import invalid_request
from pagoda.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, request: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        lora_request = self.check_model(request.model)
        hidden_size = self.engine.config.model.hf_config.hidden_size
        if request.dimensions is not None and request.dimensions != hidden_size:
            raise invalid_request(f"dimensions={request.dimensions} is not supported: this model's embeddings "
                                  f"have {hidden_size} dimensions and cannot be shortened", "dimensions")
        inputs = split_prompts(request.input)
        if len(inputs) > self.admission.limit:
            raise invalid_request(f"{len(inputs)} inputs in one request, more than this server admits at once "
                                  f"({self.admission.limit}): split the batch", "input")
        params = PoolingParams(request.pooling_type, request.normalize)
        prompts = [await self.validate_input(p, params) for p in inputs]
        request_id = self.request_id(raw, "embd")
        release = self.admission.acquire(len(prompts), 1, [len(p["prompt_token_ids"]) for p in prompts])
        try:  # an embedding never makes a token: its share of the prefill backlog goes back when it finishes
            streams = [self.generate(p, params, f"{request_id}-{i}", lora_request, admitted=release, index=i)
                       for i, p in enumerate(prompts)]
            finals = await cancel_on_disconnect(raw, collect_finals(streams))
        finally:
            release()
        data = [EmbeddingData(index=i, embedding=encode(final.embedding, request.encoding_format))
                for i, final in enumerate(finals)]
        tokens = sum(len(final.prompt_token_ids) for final in finals)
        return EmbeddingResponse(id=request_id, model=self.model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def validate_input(self, prompt, params: PoolingParams) -> dict:
        try:
            text, token_ids = await self.engine.process_prompt(prompt, params)
        except ValueError as e:  # the engine names `prompt`; this endpoint calls it `input`
            raise invalid_request(str(e).replace("prompt", "input"), "input") from None
        return {"prompt": text, "prompt_token_ids": token_ids}


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
