"""Tiny random Hugging Face checkpoints for tests: a byte-level BPE tokenizer with a chat template,
and Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / Phi-3 models of a few hundred thousand parameters.
Windowed variants have a 16-token window, so every test prompt with its output runs past it."""

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, my name is Pagoda and I serve language models on Kubernetes.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join between steps.",
    "San Francisco is a city in California. Paris is the capital of France.",
    "héllo wörld — unicode: 東京, emoji 🙂, numbers 0123456789.",
]


FIM_TOKENS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]


# prompts of the parity tests against transformers: a short one, a long one, one token, a repeated sentence
PARITY_PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks",
    "a",
    "Continuous batching lets new requests join between steps. " * 3,
]


def write_tokenizer(out: Path, fim: bool = False) -> int:
    """fim: with StarCoder's fill-in-the-middle tokens too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (FIM_TOKENS if fim else [])
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(fast)


WINDOW = 16  # the windowed checkpoints' sliding window

ARCH_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # q/k/v and output projection biases (attention_bias)
    "llama-bias": dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True,
                       tie_word_embeddings=False),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None,
                    tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True, head_dim=16),
    # Mistral v0.1's window on every layer; Qwen2's from max_window_layers on
    "mistral-window": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=WINDOW,
                           tie_word_embeddings=False),
    "qwen2-window": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True,
                         use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    # local (windowed) and global layers alternating, soft-capped scores and logits, GeGLU, (1 + w) norms
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
                   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    # a rope base per layer type, linear scaling on the global layer, q/k norms
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16,
                   query_pre_attn_scalar=16, sliding_window=WINDOW // 2, tie_word_embeddings=True,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1000000.0}}),
    # fused qkv_proj / gate_up_proj tensors, LongRoPE (prompts stay below original_max_position_embeddings)
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", tie_word_embeddings=False,
                 original_max_position_embeddings=256,
                 rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                               "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
    # LongRoPE from position 16 on (short prompts decode past it) and a 16-token window on every layer
    "phi3-long": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", tie_word_embeddings=False,
                      original_max_position_embeddings=16, sliding_window=WINDOW,
                      rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                    "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
    # mixtures of experts: 4 experts, top-2 (Mixtral renormalises the two weights; OLMoE and Qwen2-MoE here
    # do not, Qwen3-MoE does); Qwen2-MoE with its gated shared expert and a dense layer (mlp_only_layers)
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False),
    "qwen2-moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False),
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16,
                      tie_word_embeddings=False),
    "olmoe": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=False, clip_qkv=8.0, tie_word_embeddings=False),
    # sinks, sliding and full layers alternating, YaRN, q/k/v/o biases, biased router, clamped SwiGLU experts
    # (a low limit, so the clamps bite on these random weights)
    "gpt-oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_local_experts=4,
                    num_experts_per_tok=2, head_dim=16, sliding_window=WINDOW, swiglu_limit=1.5,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0}),
    # multi-head latent attention (q_proj, YaRN with mscale), shared + routed experts routed by group, the first
    # layer dense; needs num_kv_heads == num_heads (transformers' MLA expands K and V per head)
    "deepseek-v2": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", kv_lora_rank=32,
                        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=1.5, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                                         "rope_theta": 10000.0}),
    # MLA with q_lora_rank (q_a_proj, its norm, q_b_proj) and interleaved rope; sigmoid routing with the
    # correction bias, grouped top-k, renormalised and scaled
    "deepseek-v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", kv_lora_rank=32,
                        q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        norm_topk_prob=True, rope_interleave=True, tie_word_embeddings=False),
}


# Gemma multiplies its embeddings by sqrt(hidden_size): drawn at the others' size, the input token's embedding
# then swamps every layer's output and the tied LM head repeats the last prompt token forever (greedy parity
# would test nothing). Drawn sqrt(hidden_size) times smaller, they enter the layers at the others' size.
SCALED_EMBEDDINGS = {"gemma2", "gemma3_text"}


def write_tiny_model(out: Path, arch: str = "llama", num_kv_heads: int = 2, num_layers: int = 2,
                     hidden: int = 64, num_heads: int = 4, seed: int = 0, max_positions: int = 512,
                     shards: int = 1, fim: bool = False) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out, fim)
    extra = dict(ARCH_CONFIGS[arch])
    model_type = extra.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
        pad_token_id=0, initializer_range=0.3, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so a wrong wiring shows in the output
        if model_type in SCALED_EMBEDDINGS:
            model.get_input_embeddings().weight.mul_(hidden**-0.5)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):  # strong enough to matter beside the scores
                p.copy_(2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias (a buffer): not all zero
                b.copy_(0.3 * torch.randn_like(b))
    max_shard = None if shards == 1 else f"{sum(p.numel() * 4 for p in model.parameters()) // shards // 1000 + 1}KB"
    model.save_pretrained(out, **({"max_shard_size": max_shard} if max_shard else {}))
    return out


def load_hf_reference(path):
    """The transformers model of a checkpoint, in float32, as the reference for greedy parity tests."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tensors = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    # The reference is the checkpoint's tensors, whatever transformers' loader did: its loader swaps
    # process-wide functions while it runs, and an earlier test's two loads at once once left tie_weights a
    # no-op (lm_head MISSING, initialised afresh). Pagoda's conversions no longer overlap; copy every tensor
    # in and tie lm_head all the same.
    # (experts: transformers 5 stacks and renames them, converting the per-expert tensors as it loads)
    tensors = {k: v for k, v in tensors.items() if ".experts." not in k and ".block_sparse_moe." not in k}
    unknown = model.load_state_dict(tensors, strict=False).unexpected_keys
    assert not unknown, f"{path}: tensors transformers' model does not have: {unknown}"
    if "lm_head.weight" not in tensors:  # a tied checkpoint holds only the embedding
        model.lm_head.weight = model.get_input_embeddings().weight
    return model


def hf_greedy(path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (no EOS stop): the token-for-token reference."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = load_hf_reference(path)
    outs = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def hf_greedy_stepwise(path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation, one token per forward through its own KV cache, without generate()'s
    model-specific input preparation: Phi-3's recomputes the whole sequence with LongRoPE's long factors once
    it passes original_max_position_embeddings, where vLLM and Pagoda keep the cache (each position with its
    own factors), as this loop does."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = load_hf_reference(path)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model(tok(prompt, return_tensors="pt").input_ids, use_cache=True)
            tokens = []
            for _ in range(max_tokens):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            outs.append(tokens)
    return outs


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_lora_adapter(base: Path, out: Path, rank: int, seed: int, targets=tuple(LORA_TARGETS),
                       alpha: float | None = None, **extra) -> Path:
    """A PEFT LoRA adapter of the checkpoint at base, with random non-zero A and B (init_lora_weights=False),
    written by peft itself (adapter_config.json + adapter_model.safetensors)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = load_hf_reference(base)
    torch.manual_seed(seed)
    # targets: module names, or one regex string over the full module names (PEFT's two forms)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=targets if isinstance(targets, str) else list(targets),
                        lora_dropout=0.0, init_lora_weights=False, **extra)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # deltas that change the greedy tokens, but not into noise
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(out)
    return Path(out)


def peft_greedy(base, adapter, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """PeftModel's greedy continuation of each prompt with the adapter (float32; None: the base model)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = load_hf_reference(base)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    outs = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs
