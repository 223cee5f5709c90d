"""Vocabulary extension: new tokens get single ids and initialised rows, old logits are unchanged
bit for bit, the internal vocabulary stays padded to a multiple of 64, and the exported
checkpoint loads in transformers and passes the logit verifier."""

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers

from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config
from posttrain.models.vocab import extend_vocabulary, semantic_id_tokens
from posttrain.verify.logits import randomize_weights_, verify_checkpoint

ARCHS = [("qwen3", False), ("qwen3", True), ("llama", False), ("llama", True)]


def small_tokenizer(size: int = 250) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of exactly `size` ids: `<unk>`, `<eos>`, `w2` .. `w{size-1}`."""
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>"
    )


def random_model(arch: str, tied: bool, seed: int = 0):
    config = tiny_config(arch, tie_word_embeddings=tied)  # vocab_size 250, padded 256
    return randomize_weights_(build_model(config, seed=seed), seed=seed + 1).eval()


@torch.no_grad()
def logits(model, input_ids_BT: torch.Tensor) -> torch.Tensor:
    B, T = input_ids_BT.shape
    positions = torch.arange(T).expand(B, T)
    return model.compute_logits(model(input_ids_BT, positions, torch.zeros_like(input_ids_BT)))


def vocab_weights(model) -> list[torch.Tensor]:
    return [model.tok_embeddings.weight] + ([] if model.output is None else [model.output.weight])


@pytest.mark.parametrize("arch,tied", ARCHS, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in ARCHS])
def test_extend_keeps_old_logits_and_exports(tmp_path, arch, tied):
    model, tokenizer = random_model(arch, tied), small_tokenizer()
    old_ids_BT = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    old_logits = logits(model, old_ids_BT)
    old_weights = [w.detach().clone() for w in vocab_weights(model)]
    old_ptrs = [w.data_ptr() for w in vocab_weights(model)]

    # 250 -> 253 ids: fits in the 256 padded rows, so no reallocation
    special = ["<|im_start|>", "<|im_end|>", "<|item|>"]
    ids = extend_vocabulary(model, tokenizer, special, special=True)
    assert ids == [250, 251, 252] and len(tokenizer) == 253 == model.config.vocab_size
    assert [w.data_ptr() for w in vocab_weights(model)] == old_ptrs
    assert model.config.padded_vocab_size == 256
    mid_weights = [w.detach().clone() for w in vocab_weights(model)]

    # 253 -> 263 ids: crosses 256, so the embedding (and head) grow to 320 rows
    sid = semantic_id_tokens("", 2, 5)
    sid_ids = extend_vocabulary(model, tokenizer, sid)
    assert sid_ids == list(range(253, 263)) and model.config.vocab_size == len(tokenizer) == 263
    V, P = 263, model.config.padded_vocab_size
    assert P == 320 and P % 64 == 0 and P >= V
    for old, mid, new in zip(old_weights, mid_weights, vocab_weights(model)):
        assert new.shape == (P, model.config.hidden_size) and isinstance(new, torch.nn.Parameter)
        assert torch.equal(new[:250], old[:250])  # existing rows bit for bit
        # new rows: the mean of the real rows that existed at each call
        assert torch.equal(new[250:253], old[:250].mean(0, keepdim=True).expand(3, -1))
        assert torch.equal(new[253:V], mid[:253].mean(0, keepdim=True).expand(V - 253, -1))
        assert not new[V:].any()  # padding rows zero
    assert model.tok_embeddings.num_embeddings == P
    if not tied:
        assert model.output.out_features == P
    else:
        assert model.output_weight is model.tok_embeddings.weight

    # (a) existing tokens' logits on old inputs unchanged, bit for bit
    new_logits = logits(model, old_ids_BT)
    assert new_logits.shape[-1] == V
    assert torch.equal(new_logits[..., :250], old_logits)

    # (b) new tokens encode to single ids
    text = "w3 <|im_start|> w7 <a_0> <b_4> <|item|> w9"
    enc = tokenizer(text, add_special_tokens=False).input_ids
    assert enc == [3, 250, 7, 253, 262, 252, 9]

    # give the new rows distinct values so the export/verify checks see every row
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for w in vocab_weights(model):
            w[250:V] = torch.randn(V - 250, w.shape[1], generator=gen) * 0.2

    # (d) export: vocab_size == len(tokenizer), exactly that many rows; transformers loads it
    out = save_hf_checkpoint(model, tmp_path / "ckpt", tokenizer)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(tokenizer)
    rows = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    rows[name] = f.get_slice(name).get_shape()[0]
    assert rows == ({"model.embed_tokens.weight": V} if tied else {"model.embed_tokens.weight": V, "lm_head.weight": V})
    assert len(transformers.AutoTokenizer.from_pretrained(out)) == V

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf_ids_1T = torch.tensor([enc + [260, 1, 251]])
    with torch.no_grad():
        hf_logits = hf.eval()(input_ids=hf_ids_1T).logits
    assert hf_logits.shape[-1] == V
    torch.testing.assert_close(hf_logits, logits(model, hf_ids_1T), atol=1e-4, rtol=0)

    verdict = verify_checkpoint(out)  # random ids over all 263, new ones included
    assert verdict["passed"], verdict
    assert verdict["max_abs_diff"] <= 1e-4


def test_existing_tokens_add_nothing():
    model, tokenizer = random_model("qwen3", False), small_tokenizer()
    first = extend_vocabulary(model, tokenizer, ["<x>", "<y>"], special=True)
    before = [w.detach().clone() for w in vocab_weights(model)]
    ptrs = [w.data_ptr() for w in vocab_weights(model)]

    # tokens of the base vocabulary, tokens added before, and a duplicate within the call
    ids = extend_vocabulary(model, tokenizer, ["w5", "<eos>", "<x>", "<y>", "<x>"], special=True)
    assert ids == [5, 1, *first, first[0]]
    assert len(tokenizer) == model.config.vocab_size == 252
    assert [w.data_ptr() for w in vocab_weights(model)] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(before, vocab_weights(model)))
    assert extend_vocabulary(model, tokenizer, []) == []
    assert len(tokenizer) == 252


def test_duplicates_within_one_call_are_added_once():
    model, tokenizer = random_model("llama", True), small_tokenizer()
    ids = extend_vocabulary(model, tokenizer, ["<z>", "<z>", "<q>"])
    assert ids == [250, 250, 251] and len(tokenizer) == model.config.vocab_size == 252


@pytest.mark.parametrize("tied", [False, True])
def test_normal_init_and_exact_boundary(tied):
    model, tokenizer = random_model("llama", tied), small_tokenizer()
    # 250 -> 256 exactly: the padded size stays 256 (no padding rows left, no reallocation)
    ptr = model.tok_embeddings.weight.data_ptr()
    extend_vocabulary(model, tokenizer, [f"<t{i}>" for i in range(6)], init="normal", seed=0)
    assert model.config.vocab_size == 256 == model.config.padded_vocab_size
    assert model.tok_embeddings.weight.data_ptr() == ptr and model.tok_embeddings.weight.shape[0] == 256
    # 256 -> 257: grows to 320 rows
    old = [w.detach().clone() for w in vocab_weights(model)]
    extend_vocabulary(model, tokenizer, ["<t6>"], init="normal", seed=1)
    for w_old, w in zip(old, vocab_weights(model)):
        assert w.shape[0] == 320 and torch.equal(w[:256], w_old)
        assert w[256].abs().max() > 0 and not w[257:].any()
    # normal rows: N(0, initializer_range), seeded
    big_model, big_tok = random_model("qwen3", tied), small_tokenizer()
    extend_vocabulary(big_model, big_tok, [f"<n{i}>" for i in range(200)], init="normal", seed=3)
    new = big_model.tok_embeddings.weight[250:450]
    assert abs(new.std().item() - big_model.config.initializer_range) < 0.002
    assert abs(new.mean().item()) < 0.002
    assert big_model.config.padded_vocab_size == 512 and not big_model.tok_embeddings.weight[450:].any()


def test_bad_init_is_rejected():
    model, tokenizer = random_model("qwen3", True), small_tokenizer()
    with pytest.raises(ValueError, match="init"):
        extend_vocabulary(model, tokenizer, ["<x>"], init="zeros")
    assert len(tokenizer) == 250


def test_semantic_id_tokens():
    toks = semantic_id_tokens("", 3, 256)
    assert len(toks) == 768 == len(set(toks))
    assert toks[:2] == ["<a_0>", "<a_1>"] and toks[255] == "<a_255>" and toks[256] == "<b_0>" and toks[-1] == "<c_255>"
    assert semantic_id_tokens("sid_", 1, 2) == ["<sid_a_0>", "<sid_a_1>"]
    with pytest.raises(ValueError):
        semantic_id_tokens("", 0, 4)
    with pytest.raises(ValueError):
        semantic_id_tokens("", 2, 0)


def test_real_qwen3_tokenizer_uses_spare_rows_before_growing():
    """Qwen3's config has 151,936 rows for a 151,669-id tokenizer: new ids land in the spare
    rows first (no growth, rows untouched); past 151,936 the model grows."""
    from posttrain.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("builtin:qwen3")
    assert len(tokenizer) == 151_669
    config = tiny_config("qwen3", vocab_size=151_936, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    model = build_model(config, seed=0)
    before = model.tok_embeddings.weight.detach().clone()

    sid = semantic_id_tokens("", 2, 4)
    ids = extend_vocabulary(model, tokenizer, sid, special=True)
    assert ids == list(range(151_669, 151_677)) and model.config.vocab_size == 151_936
    assert torch.equal(model.tok_embeddings.weight, before)
    assert tokenizer("x<a_3><b_0>y", add_special_tokens=False).input_ids[1:3] == [151_672, 151_673]

    more = extend_vocabulary(model, tokenizer, semantic_id_tokens("c", 1, 300))
    assert more[-1] == len(tokenizer) - 1 == 151_976 and model.config.vocab_size == 151_977
    weight = model.tok_embeddings.weight
    assert weight.shape[0] == model.config.padded_vocab_size == 152_000
    assert torch.equal(weight[:151_936], before) and not weight[151_977:].any()
    assert torch.equal(model.output.weight[151_936:151_977],
                       model.output.weight[:151_936].mean(0, keepdim=True).expand(41, -1))
