"""Semantic IDs: residual k-means codes (deterministic, hierarchical), collisions resolved by one
more level and counted, code tokens added to a text model (old logits unchanged), and decoding
constrained to the catalogue: sampled, greedy and beam-searched answers are all real items."""

import numpy as np
import pytest
import torch

from posttrain.data.semantic_ids import SemanticIDs, TokenTrie, assign_semantic_ids, residual_kmeans
from posttrain.models.architectures import build_model, tiny_config
from posttrain.models.vocab import extend_vocabulary
from posttrain.rl.constrained import allowed_mask, trie_beam_search
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.native import NativeEngine


def clustered(n_per: int = 20, clusters: int = 4, dim: int = 6, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim)) * 5
    return np.concatenate([c + rng.normal(size=(n_per, dim)) * 0.1 for c in centres]).astype(np.float32)


def test_residual_kmeans_is_deterministic_and_hierarchical():
    x = clustered()
    codes = residual_kmeans(x, levels=2, codebook_size=4, seed=1)
    assert codes.shape == (80, 2) and codes.min() >= 0 and codes.max() < 4
    assert torch.equal(codes, residual_kmeans(x, levels=2, codebook_size=4, seed=1))
    # level 0 recovers the four clusters exactly: each cluster has one first code
    first = codes[:, 0].view(4, 20)
    assert all(len(set(row.tolist())) == 1 for row in first) and len(set(first[:, 0].tolist())) == 4
    # the residual level splits within a cluster
    assert len(set(codes[:20, 1].tolist())) > 1


def test_collisions_get_a_level_and_are_counted(tmp_path):
    x = np.repeat(clustered(n_per=1, clusters=3), [3, 1, 2], axis=0)  # identical features collide
    ids = [10, 11, 12, 20, 30, 31]
    semantic = assign_semantic_ids(ids, x, levels=2, codebook_size=3, seed=0)
    assert semantic.dedup_level and semantic.levels == 3 and semantic.collisions == 5
    assert len(set(semantic.codes.values())) == 6
    assert sorted(c[-1] for c in semantic.codes.values()) == [0, 0, 0, 1, 1, 2]
    assert "<c_2>" in semantic.tokens() and "<c_3>" not in semantic.tokens()
    text = semantic.item_text(11)
    assert semantic.parse_item(text) == 11 and semantic.parse_item(f" {text}\n") == 11
    assert semantic.parse_item(text + "<a_0>") is None and semantic.parse_item("item 11") is None
    again = SemanticIDs.load(semantic.save(tmp_path / "ids.json"))
    assert again.codes == semantic.codes and again.collisions == 5
    clean = assign_semantic_ids([1, 2, 3, 4], clustered(n_per=1, clusters=4), levels=2, codebook_size=4)
    assert not clean.dedup_level and clean.collisions == 0 and clean.levels == 2


def small_setup():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 40)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    model = build_model(tiny_config("qwen3", vocab_size=40), seed=0).eval()
    semantic = assign_semantic_ids(list(range(100, 130)), clustered(n_per=6, clusters=5), levels=2, codebook_size=4)
    prompt = tokenizer.encode("w3 w4 w5", add_special_tokens=False)
    with torch.no_grad():
        before = model.compute_logits(model(torch.tensor([prompt]), torch.arange(3)[None], torch.zeros(1, 3,
                                                                                                    dtype=torch.long)))
    extend_vocabulary(model, tokenizer, semantic.tokens(), init="normal", seed=0)  # distinct rows: no ties
    with torch.no_grad():
        after = model.compute_logits(model(torch.tensor([prompt]), torch.arange(3)[None], torch.zeros(1, 3,
                                                                                                   dtype=torch.long)))
    assert torch.equal(after[..., :40], before)  # the text model's old logits are unchanged
    trie = semantic.token_trie(tokenizer, end_ids=[tokenizer.eos_token_id])
    return tokenizer, model, semantic, trie, prompt


def test_constrained_sampling_and_beam_search_give_only_catalogue_items():
    tokenizer, model, semantic, trie, prompt = small_setup()
    assert trie.size == 30
    engine = NativeEngine(model, tokenizer=tokenizer)
    sampled = SamplingConfig(n=16, temperature=1.5, max_new_tokens=6, stop_token_ids=(tokenizer.eos_token_id,),
                             seed=3, allowed=trie)
    free = SamplingConfig(n=16, temperature=1.5, max_new_tokens=6, stop_token_ids=(tokenizer.eos_token_id,), seed=3)
    for config, must_be_valid in ((sampled, True), (free, False)):
        completions = engine.generate([prompt, prompt[:2]], config)
        items = [semantic.parse_item(tokenizer.decode(c.content_ids)) for group in completions for c in group]
        if must_be_valid:
            assert all(i is not None for i in items), items
            assert all(c.finish_reason == "stop_token" for group in completions for c in group)
        else:  # an untrained model left free spells few real items: the constraint is what makes them valid
            assert sum(i is not None for i in items) < len(items)
    greedy = engine.generate([prompt], SamplingConfig(temperature=0, max_new_tokens=6, allowed=trie,
                                                      stop_token_ids=(tokenizer.eos_token_id,)))[0][0]
    top = trie_beam_search(model, [prompt, prompt[:1]], trie, beam_width=8)
    full = trie_beam_search(model, [prompt], trie, beam_width=30)[0]  # every item: exact
    assert all(len(found) == 8 for found in top)
    assert all(value in semantic.codes for found in top for value, _ in found)
    scores = [s for _, s in top[0]]
    assert scores == sorted(scores, reverse=True) and len({v for v, _ in top[0]}) == 8
    assert len(full) == 30
    # beams as wide as the catalogue are exact: they equal every item scored by teacher forcing
    exact = {}
    for item in semantic.codes:
        ids = prompt + tokenizer.encode(semantic.item_text(item), add_special_tokens=False) + [tokenizer.eos_token_id]
        with torch.no_grad():
            logp = torch.log_softmax(model.compute_logits(model(torch.tensor([ids]), torch.arange(len(ids))[None],
                                                                torch.zeros(1, len(ids), dtype=torch.long))), -1)
        exact[item] = sum(float(logp[0, t - 1, ids[t]]) for t in range(len(prompt), len(ids)))
    assert sorted(exact, key=exact.get, reverse=True) == [v for v, _ in full]
    assert all(abs(exact[v] - score) < 1e-4 for v, score in full)
    assert semantic.parse_item(tokenizer.decode(greedy.content_ids)) is not None


def test_allowed_mask_and_trie():
    trie = TokenTrie()
    trie.add([1, 2, 9], "x")
    trie.add([1, 3, 9], "y")
    mask = allowed_mask(trie, [[], [1], [1, 3], [5]], vocab_size=10)
    assert mask[0].nonzero().flatten().tolist() == [1]
    assert mask[1].nonzero().flatten().tolist() == [2, 3]
    assert mask[2].nonzero().flatten().tolist() == [9]
    assert bool(mask[3].all())  # left the trie: unconstrained
    assert trie.value([1, 3, 9]) == "y" and trie.value([1, 3]) is None
    with pytest.raises(ValueError, match="already in the trie"):
        trie.add([1, 2, 9], "z")
