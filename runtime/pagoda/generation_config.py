"""What the model's generation config says about generating: the tokens that end a sequence."""

from pagoda.config import EngineConfig


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
