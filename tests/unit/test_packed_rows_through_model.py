"""Rows from the real packer through the real model: packing changes nothing per document."""

import torch

from posttrain.data.chat import TokenizedSample
from posttrain.data.packer import iter_batches, pack_samples
from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.losses import causal_lm_loss
from posttrain.verify.logits import randomize_weights_


def random_samples(vocab_size: int, lengths: list[int], seed: int) -> list[TokenizedSample]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(3, vocab_size, (n,), generator=gen).tolist()
        mask = (torch.rand(n, generator=gen) < 0.5).long().tolist()
        mask[-1] = 1
        samples.append(TokenizedSample(ids, mask))
    return samples


def alone_batch(sample: TokenizedSample) -> dict:
    """One document as its own row: what packing must be equivalent to."""
    rows, _ = pack_samples([sample], row_length=len(sample.input_ids), pad_id=0)
    return next(iter_batches(rows, batch_size=1))


def test_packed_loss_and_logits_equal_each_document_alone():
    config = tiny_config("qwen3")
    model = randomize_weights_(build_model(config, seed=0), seed=1).eval()
    samples = random_samples(config.vocab_size, [9, 23, 5, 14, 30, 3, 11], seed=2)
    rows, stats = pack_samples(samples, row_length=40, pad_id=0)
    assert stats.num_rows < len(samples)  # rows really hold several documents

    with torch.no_grad():
        packed_loss = sum(causal_lm_loss(model, b)[0] for b in iter_batches(rows, batch_size=2))
        alone_loss = sum(causal_lm_loss(model, alone_batch(s))[0] for s in samples)
        assert torch.allclose(packed_loss, alone_loss, rtol=1e-5)

        batch = next(iter_batches(rows, batch_size=1))
        hidden = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
        logits = model.compute_logits(hidden)[0]
        doc_ids = batch["doc_ids"][0]
        for doc in range(int(doc_ids.max()) + 1):
            where = (doc_ids == doc).nonzero().flatten()
            ids = batch["input_ids"][:, where]
            alone = model.compute_logits(model(ids, torch.arange(len(where))[None], torch.zeros_like(ids)))[0]
            assert (logits[where] - alone).abs().max() <= 1e-5
