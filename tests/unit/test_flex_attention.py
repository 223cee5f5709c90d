"""FlexAttention, the CUDA training backend, checked on the CPU where it can run (forward, no
gradients: torch has no FlexAttention backward on CPU): its block masks follow the same rule
as the dense masks, its outputs match dense SDPA on packed, tree and windowed rows (with and
without GPT-OSS sinks), and a model whose device picks "flex" builds no dense `[B, 1, T, T]`
mask anywhere in its forward (the seam `select_backend`, faked to say "flex" on the CPU).
`make gpu-check` runs the same comparisons with gradients, in fp32 and bf16, on a GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import posttrain.ops.attention as attention
from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.attention import (build_attention_mask, choose_backend, document_attention, flex_bucket_length,
                                    select_backend)
from posttrain.ops.sink_attention import sink_attention

FP32_TOLERANCE = 1e-5  # the bound for Flex against dense SDPA in float32


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    with warnings.catch_warnings():  # eager FlexAttention says it is slow; it is the CPU reference here
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        yield


def packed_rows(gen: torch.Generator, B: int, T: int) -> torch.Tensor:
    """Rows of consecutive documents of random lengths (1..90) with trailing padding (-1)."""
    doc_ids_BT = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        at, doc, end = 0, 0, T - int(torch.randint(0, T // 5, (), generator=gen))
        while at < end:
            n = min(int(torch.randint(1, 90, (), generator=gen)), end - at)
            doc_ids_BT[b, at:at + n] = doc
            at, doc = at + n, doc + 1
    return doc_ids_BT


def tree_rows(T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of preference-pair trees (a trunk, then branches 1 and 2, positions continuing
    from the trunk in each branch) and padding: `(doc_ids, branch_ids, position_ids)`."""
    doc, branch, pos = (torch.full((2, T), fill, dtype=torch.long) for fill in (-1, 0, 0))
    for b, pieces in enumerate([[(0, 30, 25, 40), (1, 20, 50, 10)], [(0, 70, 35, 35)]]):
        at = 0
        for d, trunk, first, second in pieces:
            doc[b, at:at + trunk + first + second] = d
            pos[b, at:at + trunk] = torch.arange(trunk)
            branch[b, at + trunk:at + trunk + first] = 1
            pos[b, at + trunk:at + trunk + first] = torch.arange(trunk, trunk + first)
            branch[b, at + trunk + first:at + trunk + first + second] = 2
            pos[b, at + trunk + first:at + trunk + first + second] = torch.arange(trunk, trunk + second)
            at += trunk + first + second
    return doc, branch, pos


def mask_cases(T: int) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(0)
    doc, branch, pos = tree_rows(T)
    return {
        "packed": dict(doc_ids_BT=packed_rows(gen, 3, T)),
        "windowed": dict(doc_ids_BT=packed_rows(gen, 3, T), window=17),
        "tree": dict(doc_ids_BT=doc, branch_ids_BT=branch),
        "tree_windowed": dict(doc_ids_BT=doc, branch_ids_BT=branch, position_ids_BT=pos, window=23),
    }


@pytest.mark.parametrize("case", ["packed", "windowed", "tree", "tree_windowed"])
@pytest.mark.parametrize("T", [200, 256])
def test_flex_forward_matches_dense_sdpa_in_float32(case, T):
    kwargs = mask_cases(T)[case]
    B = kwargs["doc_ids_BT"].shape[0]
    gen = torch.Generator().manual_seed(1)
    q_BHTE, k_BKTE, v_BKTE = (torch.randn(B, heads, T, 16, generator=gen) for heads in (4, 2, 2))
    dense = build_attention_mask(backend="sdpa", **kwargs)
    flex = build_attention_mask(backend="flex", **kwargs)
    assert flex.backend == "flex" and flex.dense_B1TT is None and flex.padded_length == 256
    expected = document_attention(q_BHTE, k_BKTE, v_BKTE, dense, scale=0.3)
    got = document_attention(q_BHTE, k_BKTE, v_BKTE, flex, scale=0.3)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= FP32_TOLERANCE
    sinks_H = torch.randn(4, generator=gen)
    expected = sink_attention(q_BHTE, k_BKTE, v_BKTE, sinks_H, dense)
    got = sink_attention(q_BHTE, k_BKTE, v_BKTE, sinks_H, flex)
    assert (got - expected).abs().max().item() <= FP32_TOLERANCE


def test_block_mask_skips_tiles_that_hold_no_allowed_pair():
    """Rows of two 512-token documents: the block mask must mark the cross-document tiles and
    the tiles above the diagonal empty (that is what makes the kernel block-sparse)."""
    doc_ids_BT = torch.tensor([[0] * 512 + [1] * 512])
    mask = build_attention_mask(doc_ids_BT, backend="flex")
    dense_tiles = mask.block_mask.to_dense()[0, 0]  # [query tiles, key tiles]: 1 where computed
    tiles = 1024 // 128
    expected = torch.zeros(tiles, tiles, dtype=dense_tiles.dtype)
    for doc in range(2):
        span = slice(doc * 4, doc * 4 + 4)
        expected[span, span] = torch.ones(4, 4, dtype=dense_tiles.dtype).tril()
    assert torch.equal(dense_tiles, expected)


def test_bucket_lengths_bound_the_compiled_shapes():
    assert [flex_bucket_length(T) for T in (1, 128, 129, 1000, 1024, 1025, 4096, 4097)] == \
        [128, 128, 256, 1024, 1024, 2048, 4096, 5120]


def test_cuda_devices_pick_flex_and_cpus_keep_their_backends():
    assert select_backend("cuda") == "flex" and select_backend("cuda:1") == "flex"
    assert select_backend("cpu") == "documents"
    doc_ids_BT = torch.zeros(1, 8, dtype=torch.long)
    assert choose_backend(doc_ids_BT)[0] in ("documents", "sdpa")


@pytest.mark.parametrize("model_type", ["qwen3", "gpt_oss"])
def test_a_model_on_a_flex_device_builds_no_dense_mask(monkeypatch, model_type):
    """The seam: a device whose `select_backend` says "flex" (CUDA; faked here on the CPU) takes
    every training-forward mask through `flex_block_mask`; the dense builder is never called,
    and the hidden states equal the CPU backends' (float32, relative to their norm)."""
    model = build_model(tiny_config(model_type, initializer_range=0.2), seed=0).eval()
    gen = torch.Generator().manual_seed(2)
    doc_ids_BT = packed_rows(gen, 2, 150)
    input_ids_BT = torch.randint(0, model.config.vocab_size, doc_ids_BT.shape, generator=gen)
    position_ids_BT = torch.zeros_like(doc_ids_BT)
    for b in range(2):
        for doc in doc_ids_BT[b].unique():
            where = doc_ids_BT[b] == doc
            position_ids_BT[b, where] = torch.arange(int(where.sum()))
    with torch.no_grad():
        expected = model(input_ids_BT, position_ids_BT, doc_ids_BT)

    def no_dense_mask(*args, **kwargs):
        raise AssertionError("a dense [B, 1, T, T] mask was built on a flex device")

    monkeypatch.setattr(attention, "select_backend", lambda device: "flex")
    monkeypatch.setattr(attention, "document_causal_mask", no_dense_mask)
    built = []
    real_flex_block_mask = attention.flex_block_mask
    monkeypatch.setattr(attention, "flex_block_mask", lambda *a, **k: built.append(1) or real_flex_block_mask(*a, **k))
    with torch.no_grad():
        got = model(input_ids_BT, position_ids_BT, doc_ids_BT)
    assert built, "the forward built no flex block mask"
    # through every layer: float32 rounding relative to the hidden states' size
    assert ((got - expected).norm() / expected.norm()).item() <= FP32_TOLERANCE


def test_cuda_without_flex_and_other_devices_take_the_per_document_backend(monkeypatch):
    """Flex is CUDA's; devices nobody measured (mps, xpu) and CUDA without FlexAttention take
    the backend `choose_backend` applies to CPU rows: one causal SDPA call per document (the
    varlen fallback) for plain document masks, a masked call for windows and trees."""
    assert select_backend("mps") == "documents" and select_backend("xpu") == "documents"
    monkeypatch.setattr(attention, "flex_available", lambda: False)
    assert select_backend("cuda") == "documents"



def test_windowed_masks_are_unchanged_by_the_shifted_comparison():
    """The window rule compares against a shifted index (no `[T, T]` integer temporary): the
    same mask as the row-distance definition, for plain rows and for trees (positions)."""
    gen = torch.Generator().manual_seed(5)
    doc_ids_BT = packed_rows(gen, 2, 96)
    T = doc_ids_BT.shape[1]
    q_TT, k_TT = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for window in (1, 7, 40):
        expected_BTT = (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :]) & (k_TT <= q_TT) & (q_TT - k_TT < window)
        assert torch.equal(attention.document_causal_mask(doc_ids_BT, window)[:, 0], expected_BTT)
