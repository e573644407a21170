"""What the model's generation config says about generating: the tokens that end a sequence, and the
default sampling parameters (vLLM's `--generation-config auto`)."""

import json
import logging
import os

from pagoda.config import EngineConfig, ModelConfig
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field: the ones vLLM takes as defaults
SAMPLING_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def eos_token_ids_for(config: EngineConfig, tokenizer=None) -> set[int]:
    """Token ids that end a sequence: generation_config.json's eos ids plus the tokenizer's."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path,
                                                       trust_remote_code=config.model.trust_remote_code)
    path, hf_config = config.model.path, config.model.hf_config
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):
        eos = getattr(hf_config, "eos_token_id", None)
    for value in eos if isinstance(eos, list) else [eos]:
        if value is not None:
            ids.add(int(value))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def default_sampling_params(model: ModelConfig) -> dict:
    """SamplingParams fields the model's generation_config.json sets (only the keys it writes), or {} with
    generation_config "vllm". Requests that set a field themselves keep their value."""
    if model.generation_config == "vllm":
        return {}
    folder = model.path if model.generation_config == "auto" else model.generation_config
    try:
        with open(os.path.join(folder, "generation_config.json")) as f:
            written = json.load(f)
    except (OSError, ValueError):
        return {}
    defaults = {field: written[key] for key, field in SAMPLING_DEFAULT_KEYS.items()
                if isinstance(written, dict) and written.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        logger.warning("ignoring %s/generation_config.json's sampling parameters %s: %s", folder, defaults, e)
        return {}
    if defaults:
        logger.info("default sampling parameters from %s/generation_config.json: %s (requests override them; "
                    "--generation-config vllm ignores them)", folder, defaults)
    return defaults
