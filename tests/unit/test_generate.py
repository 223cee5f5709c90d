"""Greedy generation: batching and padding never change results, stop ids end a sequence
(and are not returned), and our tokens equal transformers' greedy `generate` on the
exported checkpoint."""

from __future__ import annotations

import pytest
import torch

from posttrain.eval.generate import greedy_generate, left_pad
from posttrain.models.registry import build_model, save_hf_checkpoint, tiny_config

EOS = 1  # tiny_config's eos_token_id
MAX_NEW = 10


@pytest.fixture(scope="module")
def model():
    # a larger init spread than the default keeps the argmax away from near-ties, so the
    # comparisons test the implementation rather than float rounding
    return build_model(tiny_config(initializer_range=0.2), seed=3).eval()


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 1, 9, 3, 12, 5, 2]
    return [torch.randint(2, 250, (n,), generator=gen).tolist() for n in lengths]


def test_left_pad_layout():
    ids, pos, docs = left_pad([[5, 6, 7], [8]], torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert docs.tolist() == [[0, 0, 0], [-1, -1, 0]]


def test_batched_equals_one_by_one(model, prompts):
    one_by_one = [greedy_generate(model, [p], MAX_NEW, set(), batch_size=1)[0] for p in prompts]
    assert all(len(out) == MAX_NEW for out in one_by_one)
    assert len({tuple(out) for out in one_by_one}) > 1  # the model is not degenerate
    for batch_size in (3, len(prompts)):
        assert greedy_generate(model, prompts, MAX_NEW, set(), batch_size=batch_size) == one_by_one


def test_stop_id_ends_sequence_and_is_excluded(model, prompts):
    free = greedy_generate(model, prompts, MAX_NEW, set(), batch_size=4)
    stop = free[0][3]
    stopped = greedy_generate(model, prompts, MAX_NEW, {stop}, batch_size=4)
    for before, after in zip(free, stopped):
        expected = before[: before.index(stop)] if stop in before else before
        assert after == expected
    assert stopped[0] == free[0][: free[0].index(stop)] and len(stopped[0]) <= 3
    assert greedy_generate(model, prompts[:2], 0, set(), batch_size=2) == [[], []]


def test_matches_transformers_generate(model, prompts, tmp_path):
    from transformers import AutoModelForCausalLM

    save_hf_checkpoint(model, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = greedy_generate(model, prompts, MAX_NEW, {EOS}, batch_size=4)
    for prompt, mine in zip(prompts, ours):
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                              max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=EOS)
        theirs = out[0, len(prompt):].tolist()
        if EOS in theirs:
            theirs = theirs[: theirs.index(EOS)]
        assert mine == theirs, (prompt, mine, theirs)


def test_rejects_empty_prompt(model):
    with pytest.raises(ValueError):
        greedy_generate(model, [[3, 4], []], 4, set(), batch_size=2)
