"""`--reasoning-parser openai_gptoss`: gpt-oss's Harmony channels split into reasoning (analysis) and content
(final, commentary), whole or streamed in deltas cut anywhere, with a tokenizer whose markers are special
tokens as gpt-oss's are."""

import pytest
from checkpoints import write_tokenizer

from pagoda import SamplingParams
from pagoda.entrypoints.openai.harmony_reasoning import MARKERS
from pagoda.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, reasoning_parser

OUTPUT = ("<|channel|>analysis<|message|>The user greets. Answer briefly.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello, my name is Pagoda.<|return|>")
REASONING, CONTENT = "The user greets. Answer briefly.", "Hello, my name is Pagoda."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("harmony-tok")
    write_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    return tok


@pytest.fixture(scope="module")
def parser(tokenizer):
    assert "openai_gptoss" in REASONING_PARSERS
    return reasoning_parser("openai_gptoss", tokenizer)


def prompt_ids(tokenizer, text="<|start|>user<|message|>Hi<|end|><|start|>assistant"):
    return tokenizer.encode(text, add_special_tokens=False)


def test_analysis_is_reasoning_and_final_is_content(parser, tokenizer):
    assert parser.split(OUTPUT, prompt_ids(tokenizer)) == (REASONING, CONTENT)


def test_the_markers_reach_the_parser_only_with_special_tokens_kept(parser, tokenizer):
    """The markers are special tokens: detokenized as the server does by default they vanish, so the parser
    turns skip_special_tokens off, and on the text so decoded it splits as on the text itself."""
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    assert "<|channel|>" not in tokenizer.decode(ids, skip_special_tokens=True)
    assert parser.output_params(SamplingParams()).skip_special_tokens is False
    assert parser.split(tokenizer.decode(ids, skip_special_tokens=False), prompt_ids(tokenizer)) == (REASONING, CONTENT)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 11])
def test_streamed_in_deltas_cut_anywhere(parser, tokenizer, step):
    splitter = parser.splitter(prompt_ids(tokenizer))
    streamed = ""
    for end in range(step, len(OUTPUT) + step, step):
        text = OUTPUT[:end]
        streamed += splitter.feed(text, final=end >= len(OUTPUT))
        assert "<|" not in splitter.content and "<|" not in streamed
    assert (streamed, splitter.content) == (REASONING, CONTENT)


def test_tool_call_commentary_and_several_analysis_messages(parser, tokenizer):
    text = ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|> Second."
            "<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
            '{"city": "Paris"}<|call|>')
    assert parser.split(text, prompt_ids(tokenizer)) == ("First. Second.", '{"city": "Paris"}')


def test_a_prompt_that_opens_the_final_channel_makes_everything_content(parser, tokenizer):
    prompt = prompt_ids(tokenizer, "<|start|>assistant<|channel|>final<|message|>")
    assert parser.prompt_ends_reasoning(prompt)
    assert parser.split("Paris.<|return|>", prompt) == (None, "Paris.")
    prompt = prompt_ids(tokenizer, "<|start|>assistant<|channel|>analysis<|message|>")
    assert not parser.prompt_ends_reasoning(prompt)
    assert parser.split("Thinking.<|end|><|start|>assistant<|channel|>final<|message|>Paris.", prompt) == \
        ("Thinking.", "Paris.")


def test_an_output_without_harmony_is_content(parser, tokenizer):
    assert parser.split("Hello there", prompt_ids(tokenizer)) == (None, "Hello there")


def test_reasoning_tokens_are_the_analysis_bodies(parser, tokenizer):
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    assert parser.count_reasoning_tokens(ids, prompt_ids(tokenizer)) == \
        len(tokenizer.encode(REASONING, add_special_tokens=False))
    assert not parser.grammar_waits(prompt_ids(tokenizer))


def test_a_tokenizer_without_the_markers_is_refused_by_flag(tmp_path):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss: the model's tokenizer has no <\\|start\\|>"):
        reasoning_parser("openai_gptoss", AutoTokenizer.from_pretrained(tmp_path))
