"""A tiny Llama checkpoint that thinks: its greedy output is a scripted `<think>…</think>` then an answer.

The tokenizer is the tests' byte-level BPE plus `<think>` and `</think>` as single tokens (as DeepSeek-R1's
and Qwen3's), and a chat template that, like Qwen3's, writes an empty, closed think block into the prompt
when `enable_thinking` is false. The weights make the next token a function of the current one: attention and
MLP outputs are zero, so the last hidden state is the current token's embedding, and the LM head row of each
scripted successor is its predecessor's embedding direction. The engine runs the model for real; only the
weights are chosen."""

from pathlib import Path

from checkpoints import write_tokenizer

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}"
)
REASONING = "Hello, my name"  # what the model thinks (tokens of the BPE all distinct)
SERVED_NAME = "thinker"  # its name in the tests' shared server (tests/server/conftest.py)
MAX_STORED_RESPONSES = 4  # that server's --max-stored-responses, small enough for a test to run past it
ANSWER = "San Francisco"  # what it answers after the thinking


def write_thinking_model(out: Path, hidden: int = 64, scale: float = 4.0) -> Path:
    """out: the checkpoint directory. Greedy (and, at these logits, sampled) output after the chat template's
    generation prompt: `<think>` REASONING `</think>` ANSWER, then the end of turn."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(["<think>", "</think>"])  # added, not special: the text keeps them, as Qwen3's
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(out)
    think, end_think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    last_prompt_token = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)[-1]
    chain = [last_prompt_token, think, *tok.encode(REASONING, add_special_tokens=False), end_think,
             *tok.encode(ANSWER, add_special_tokens=False), tok.eos_token_id]
    assert len(set(chain)) == len(chain), "each scripted token needs its own successor"

    config = AutoConfig.for_model(
        "llama", vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=tok.eos_token_id, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # the residual stream stays the current token's embedding
        embed = model.get_input_embeddings().weight
        embed.normal_()
        head = model.lm_head.weight
        head.zero_()
        for current, following in zip(chain, chain[1:]):
            # after the final norm the hidden state is embed[current] / rms: this row scores scale * sqrt(hidden)
            head[following] = scale * embed[current] / embed[current].norm()
        # with thinking off the prompt ends in </think>: the answer follows, as after the scripted thinking
    model.save_pretrained(out)
    return out
