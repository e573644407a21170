"""`LLM`: offline batched generation, vLLM-compatible."""

import dataclasses
import itertools

from tqdm.auto import tqdm

from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagoda.errors import InvalidParam
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.worker.loader.generation_config import default_sampling_params

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineArgs)}


class LLM:
    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto", seed: int = 0,
                 **kwargs):
        unknown = set(kwargs) - _ENGINE_FIELDS
        if unknown:
            raise TypeError(f"LLM() got unknown arguments: {', '.join(sorted(unknown))}")
        kwargs.setdefault("disable_log_stats", True)  # as vLLM's LLM: no periodic stats lines offline
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, seed=seed, **kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop worker processes and release the process group, shared memory and ports. Idempotent;
        also runs on `with LLM(...) as llm:` exit and when the object is garbage-collected."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() samples with when given no SamplingParams: the model's generation_config.json
        values (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) unless the engine
        runs with generation_config="vllm"."""
        return SamplingParams(**default_sampling_params(self.engine.config.model))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Run prompts (strings, token-id dicts, or one of them) to completion; outputs in input order.
        lora_request: a LoRARequest for every prompt, or a list of them (None: the base model), one per prompt."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        # validate everything before starting anything
        processed = [self.engine.process_prompt(p, sp) for p, sp in zip(prompts, params)]
        loras = [self.engine.loras.resolve(lora) for lora in loras]
        ids = []
        for (text, token_ids), sp, lora in zip(processed, params, loras):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, text, sp, prompt_token_ids=token_ids, lora_request=lora)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding: one forward pass over it, nothing sampled (see PoolingParams).
        lora_request: as generate()'s; the hidden states are then the adapter's."""
        outputs = self.generate(prompts, pooling_params or PoolingParams(), use_tqdm, lora_request)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding), o.prompt_token_ids)
                for o in outputs]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             continue_final_message: bool = False):
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template.
        continue_final_message: the output continues the last message (an assistant prefill) instead of
        starting a new turn; it needs add_generation_prompt=False, as vLLM's."""
        if continue_final_message and add_generation_prompt:
            raise InvalidParam("continue_final_message", "continue_final_message and add_generation_prompt "
                                                         "cannot both be true")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            if not tokenizer.chat_template and not chat_template:
                raise ValueError("this model's tokenizer has no chat template: pass chat_template=")
            token_ids = tokenizer.apply_chat_template(conversation, chat_template=chat_template,
                                                      add_generation_prompt=add_generation_prompt, tokenize=True,
                                                      continue_final_message=continue_final_message)
            if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):
                token_ids = token_ids["input_ids"]
            prompts.append({"prompt_token_ids": list(token_ids),
                            "prompt": tokenizer.decode(token_ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for request_id in request_ids:
                    self.engine.abort_request(request_id)
                raise
        return [finished[r] for r in request_ids]
