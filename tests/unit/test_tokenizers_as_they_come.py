"""Tokenizers as they come (`posttrain.data.tokenizer`): the pad fallback of a tokenizer without
a pad token, exact packing when the pad token is eos, and one BOS where the chat template
writes it. Real tokenizer files from ../shared/data/tokenizers (skipped when absent); the
Llama-3-style tokenizer is built here from the GPT-2 files, in the test's temporary directory."""

from __future__ import annotations

import functools
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.config.model_sections import ModelConfig
from posttrain.data.chat import TokenizedSample, render_conversation, render_prompt
from posttrain.data.packer import iter_batches, pack_samples
from posttrain.data.preference import render_pair
from posttrain.data.records import PreferenceRecord
from posttrain.data.tokenizer import choose_pad_token, load_tokenizer, pad_record, unused_special_token
from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.losses import causal_lm_loss
from posttrain.recipes.start import model_config_for
from posttrain.verify.logits import randomize_weights_

BOS = "<|begin_of_text|>"
PAD_NAMED = "<|finetune_right_pad_id|>"
RESERVED = ["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"]
# Llama 3's chat template in miniature: it writes the BOS itself (no blank line after a header:
# GPT-2's merges split "\n\n" differently at the end of a prompt than before an answer)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>' }}{%- endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4+4?"},
        {"role": "assistant", "content": "8"}]


@pytest.fixture
def tokenizers(shared_data):
    return shared_data / "tokenizers"


@functools.cache
def gpt2_backend(directory: str) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory).backend_tokenizer.to_str()


def llama3_style(tokenizers, out_dir, specials=(BOS, "<|end_of_text|>", *RESERVED, PAD_NAMED), template=LLAMA3_TEMPLATE,
                 model_pad_token_id=None):
    """A tokenizer shaped like Llama 3.1 Instruct's, from the GPT-2 files: BOS, eos `<|eot_id|>`,
    reserved special tokens, no pad token, a post-processor that prepends the BOS to every
    encoded text and a chat template that writes it too. Saved to `out_dir` (and a config.json
    naming `model_pad_token_id`, when given)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(gpt2_backend(str(tokenizers / "gpt2")))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in
                                (*specials, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")])
    bos = backend.token_to_id(BOS)
    backend.post_processor = TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                special_tokens=[(BOS, bos)])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token="<|eot_id|>",
                            chat_template=template).save_pretrained(str(out_dir))
    if model_pad_token_id is not None:
        (out_dir / "config.json").write_text(json.dumps({"pad_token_id": model_pad_token_id}))
    return out_dir


def test_a_tokenizer_with_a_pad_token_keeps_it(tokenizers):
    tokenizer = load_tokenizer(str(tokenizers / "qwen2.5"))
    assert pad_record(tokenizer) == {"token": "<|endoftext|>", "id": 151643, "source": "tokenizer"}


def test_gpt2_pads_with_eos_unless_its_model_names_a_special_token(tokenizers, tmp_path):
    gpt2 = str(tokenizers / "gpt2")
    plain = load_tokenizer(gpt2)
    assert pad_record(plain) == {"token": "<|endoftext|>", "id": 50256, "source": "eos"}
    model = tmp_path / "model"
    model.mkdir()
    # a model config naming a plain vocabulary token ("!" is id 0) is not taken: it would become special
    (model / "config.json").write_text(json.dumps({"pad_token_id": 0}))
    tokenizer = load_tokenizer(gpt2, model=model)
    assert tokenizer.pad_choice.source == "eos"
    assert tokenizer("Hi! <|endoftext|>").input_ids == plain("Hi! <|endoftext|>").input_ids == [17250, 0, 220, 50256]
    (model / "config.json").write_text(json.dumps({"pad_token_id": 50256}))
    assert load_tokenizer(gpt2, model=model).pad_choice.source == "model_config"
    unpickled = pickle.loads(pickle.dumps(plain))  # Ray sends the tokenizer to the workers
    assert unpickled.pad_token_id == 50256 and unpickled.pad_choice == plain.pad_choice


def test_llama3_style_fallback_order(tokenizers, tmp_path):
    llama = load_tokenizer(str(llama3_style(tokenizers, tmp_path / "a")))
    assert llama.pad_choice.source == "unused_special" and llama.pad_token == PAD_NAMED
    reserved = load_tokenizer(str(llama3_style(tokenizers, tmp_path / "b", specials=(BOS, *RESERVED))))
    assert reserved.pad_token == RESERVED[0] and reserved.pad_choice.source == "unused_special"
    # the model's own pad id (here in the config.json beside the tokenizer files) comes first
    second = reserved.convert_tokens_to_ids(RESERVED[1])
    named = load_tokenizer(str(llama3_style(tokenizers, tmp_path / "c", model_pad_token_id=second)))
    assert (named.pad_token_id, named.pad_choice.source) == (second, "model_config")
    # a special token the chat template uses is never taken, nor any token without pad/reserved in its name
    uses = load_tokenizer(str(llama3_style(tokenizers, tmp_path / "d", template=LLAMA3_TEMPLATE + PAD_NAMED)))
    assert uses.pad_token == RESERVED[0]
    bare = load_tokenizer(str(llama3_style(tokenizers, tmp_path / "e", specials=(BOS, "<|end_of_text|>"))))
    assert unused_special_token(bare) is None and bare.pad_choice.source == "eos" and bare.pad_token == "<|eot_id|>"
    assert choose_pad_token(bare).source == "tokenizer"  # once set, the pad is the tokenizer's own


def test_padding_with_eos_is_exact():
    """Rows packed with eos as the pad token hold what rows packed with a distinct pad id hold:
    the same labels (every document's final eos still trained), positions, document ids and
    real tokens; and the loss through a model is bitwise the same."""
    config = tiny_config("qwen3")
    eos, other_pad = config.eos_token_id, 7
    gen = torch.Generator().manual_seed(0)
    samples = []
    for n in (9, 17, 5, 12, 21):
        ids = torch.randint(10, config.vocab_size, (n,), generator=gen).tolist() + [eos]
        samples.append(TokenizedSample(ids, [0] * (n // 2) + [1] * (n - n // 2 + 1)))
    with_eos, _ = pack_samples(samples, row_length=32, pad_id=eos)
    with_other, _ = pack_samples(samples, row_length=32, pad_id=other_pad)
    real = with_eos.doc_ids >= 0
    assert (~real).any()  # the rows really hold padding
    for name in ("labels", "position_ids", "doc_ids"):
        assert np.array_equal(getattr(with_eos, name), getattr(with_other, name)), name
    assert np.array_equal(with_eos.input_ids[real], with_other.input_ids[real])
    assert (with_eos.labels == eos).sum() == len(samples)  # each document's eos is a target
    model = randomize_weights_(build_model(config, seed=0), seed=1).eval()
    with torch.no_grad():
        for a, b in zip(iter_batches(with_eos, batch_size=2), iter_batches(with_other, batch_size=2)):
            assert torch.equal(causal_lm_loss(model, a)[0], causal_lm_loss(model, b)[0])


def test_pair_rows_with_eos_as_pad_are_exact():
    """Preference rows (tree rows: DPO, reward models; RL rows are written the same way) with
    eos as the pad token: every field but the padding's input ids equals the distinct-pad rows,
    and each response's final eos stays a target and the place its score is read."""
    from posttrain.data.pair_packer import PairPacker
    from posttrain.data.preference import PairSample, pair_layout

    eos = 1
    rng = np.random.default_rng(0)
    pairs = [PairSample(rng.integers(10, 250, 4).tolist(), rng.integers(10, 250, 3).tolist() + [eos], [1] * 4,
                        rng.integers(10, 250, 5).tolist() + [eos], [1] * 6, pair_id=i) for i in range(5)]

    def batch(pad_id):
        packer = PairPacker(40, pad_id)
        documents = iter(pair_layout(p) for p in pairs)
        plans = list(iter(lambda: packer.next_plan(documents), None))
        rows = packer.empty_rows(len(plans))
        for r, plan in enumerate(plans):
            packer.write_plan(rows, r, plan)
        return PairPacker.batch_tensors(rows)

    with_eos, with_other = batch(eos), batch(7)
    real = with_eos["doc_ids"] >= 0
    assert (~real).any() and set(with_eos) == set(with_other)
    for name in set(with_eos) - {"input_ids"}:
        assert torch.equal(with_eos[name], with_other[name]), name
    assert torch.equal(with_eos["input_ids"][real], with_other["input_ids"][real])
    assert int((with_eos["target_ids"] == eos).sum()) == 2 * len(pairs)
    assert bool((with_eos["input_ids"].flatten()[with_eos["score_pos"]] == eos).all())


def test_a_random_init_model_gets_no_pad_id_that_is_eos(tokenizers):
    """Gemma 3 and GPT-OSS leave the embedding row of `pad_token_id` untrained: a model built for
    a tokenizer padding with eos names no pad id (transformers' classifier would skip eos too)."""
    gpt2 = load_tokenizer(str(tokenizers / "gpt2"))
    model = ModelConfig(arch="gemma3_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    config = model_config_for(model, gpt2)
    assert config.pad_token_id is None and config.eos_token_id == 50256
    qwen = load_tokenizer(str(tokenizers / "qwen2.5"))
    assert model_config_for(model, qwen).pad_token_id == 151643


def test_llama3_template_gives_one_bos(tokenizers, tmp_path):
    """The template writes `<|begin_of_text|>` and the tokenizer's post-processor would add a
    second one to any encoded text: conversations, prompts and pairs carry exactly one."""
    tokenizer = load_tokenizer(str(llama3_style(tokenizers, tmp_path / "llama")))
    bos = tokenizer.bos_token_id
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tokenizer(text).input_ids[:2] == [bos, bos]  # what encoding the rendered text with special tokens does
    sample = render_conversation(tokenizer, CHAT)
    assert sample.input_ids == list(tokenizer.apply_chat_template(CHAT, tokenize=True)["input_ids"])
    assert sample.input_ids.count(bos) == 1 and sample.input_ids[0] == bos
    trained = tokenizer.decode([i for i, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert trained == "5<|eot_id|>8<|eot_id|>"
    prompt = render_prompt(tokenizer, CHAT[:2])
    assert prompt.count(bos) == 1 and sample.input_ids[:len(prompt)] == prompt
    pair = render_pair(tokenizer, PreferenceRecord(CHAT[:2], [{"role": "assistant", "content": "5"}],
                                                   [{"role": "assistant", "content": "6"}], "pairs", 1))
    assert (pair.prompt_ids + pair.chosen_ids).count(bos) == 1 and bos not in pair.rejected_ids


def test_a_recipe_tokenizer_takes_its_starting_models_pad_id(tokenizers, tmp_path):
    from posttrain.config import load_sft_config
    from posttrain.steps.paths import load_recipe_tokenizer

    start = tmp_path / "start"
    start.mkdir()
    (start / "config.json").write_text(json.dumps({"pad_token_id": 50256}))
    tiny = Path(__file__).resolve().parents[2] / "configs" / "sft" / "tiny.yaml"
    overrides = {"tokenizer.name_or_path": str(tokenizers / "gpt2"), "model.init": "pretrained",
                 "model.name_or_path": str(start)}
    assert load_recipe_tokenizer(load_sft_config(tiny, overrides=overrides), tmp_path).pad_choice.source == \
        "model_config"
    assert load_recipe_tokenizer(load_sft_config(tiny, overrides={"tokenizer.name_or_path": str(tokenizers / "gpt2")}),
                                 tmp_path).pad_choice.source == "eos"  # a random init has no model config
