"""Analytic training FLOPs and model FLOPs utilisation (MFU) for every architecture.

Each architecture describes its layers as `LayerFlopSpec`s (weight matrices with how many
times each is applied per token, attention heads and dims): dense configs get
`dense_layer_spec` per layer; a config with other layers (MoE: router + top-k expert
matrices; mixed sliding/full attention) defines `flop_layers()`.

What is counted: matrix multiplications only, `2*m*n*k` FLOPs each, the convention of
`torch.utils.flop_counter.FlopCounterMode` (norms, rotary, softmax, SiLU, linear biases (a
biased linear is one `addmm`, counted as its matmul) and the embedding lookup are left out;
they are a fraction of a percent at real sizes). A training step
(forward + backward) costs 3x the forward: backward computes a gradient for the matmul's
input and one for its weight, each as large as the forward. LoRA changes this (below).

Per token, per layer (D hidden, H query heads, K key/value heads, E head dim, F MLP size):
    q, k, v, o projections     2*D*(H*E + 2*K*E + H*E)
    SwiGLU (gate, up, down)    2*3*D*F
Attention scores `q @ k^T` and the weighted values `p @ v` cost `2 * 2*H*E` per (query, key)
pair. They are counted per document of a packed row, never across documents: a document of
length L contributes L*L pairs ("square", the default: what a dense kernel computes for the
document, the usual MFU convention, and what the eager attention of our FLOP-counter test
runs) or L*(L+1)/2 pairs with `causal_pairs=True` (only the pairs a causal mask keeps, what
a block-skipping kernel ideally computes). The padded/packed row length never enters: our
CPU path (SDPA with a dense `[T, T]` mask) computes every row's full `T*T` block, but the
cross-document and padding part is waste, and MFU counts useful model FLOPs only.
`executed_step_flops` counts what the kernels execute instead (full rows, padding included);
the trainer reports both, as `mfu` and `hfu`.

Output projection: our loss (`posttrain.ops.losses.causal_lm_loss`) drops positions whose
label is -100 before projecting, so the projection costs `2*D*V` per loss token only (V the
real vocabulary, not the padded embedding rows), x3 for training (`chunked_cross_entropy`
runs exactly three matmuls per chunk: logits, grad of hidden, grad of weight). Pass
`num_loss_tokens`; it defaults to every token carrying a loss.

LoRA (`lora=LoraSpec(rank, targets)`): a frozen matmul costs its forward, plus the backward
to its input only when that input needs a gradient (no weight gradient); the adapter's `A`
(in -> r) and `B` (r -> out) cost forward + weight gradient, plus the backward to their
input where it is needed (always for `B`). With frozen embeddings the first layer's input
needs no gradient, so what in it does not depend on an adapter has no backward at all; the
count follows that dataflow through each layer (attention input -> q/k/v -> attention ->
o -> residual -> MLP input -> gate/up/router -> down -> residual), which makes it exact
against `FlopCounterMode`. The output projection is trained only with `lora.train_output`
(and then, if tied, so is the embedding, and every input needs its gradient).

`doc_lengths` is a list of rows, each a list of document lengths (the real tokens); build it
from a batch with `doc_lengths_from_doc_ids` (padding, `doc_id == -1`, left out unless
`include_padding=True`, which counts it as documents, as the hardware computes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from posttrain.catalog import PEAK_FLOPS  # noqa: F401  (the known devices; re-exported)
# the architectures' FLOP descriptions (re-exported: callers import them from here too)
from posttrain.models.flops import LORA_TARGETS, LayerFlopSpec, LoraSpec, Matmul, dense_layer_spec  # noqa: F401
from posttrain.ops.attention import row_runs

@dataclass
class StepFlops:
    """Training FLOPs of one step (forward + backward), by part, and the tokens they cover."""

    linear: float  # q/k/v/o and MLP projections, all layers
    attention: float  # scores and weighted values, per document
    output: float  # output projection over the loss tokens
    num_tokens: int  # tokens counted (the real ones unless padding was passed as documents)
    num_loss_tokens: int
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.output

    @property
    def per_token(self) -> float:
        return self.total / self.num_tokens if self.num_tokens else 0.0


def layer_flop_specs(config) -> list[LayerFlopSpec]:
    """One spec per decoder layer: `config.flop_layers()` when the architecture's config
    defines it (MoE, sliding-window or otherwise non-dense layers), else the dense spec for
    each of `num_hidden_layers` layers."""
    if hasattr(config, "flop_layers"):
        return list(config.flop_layers())
    return [dense_layer_spec(config)] * config.num_hidden_layers


def _attention_pairs(lengths: Sequence[int], causal_pairs: bool, window: int | None) -> int:
    """(query, key) pairs attention computes over documents of `lengths` (see module docstring)."""
    if not causal_pairs:
        return sum(n * n for n in lengths)
    total = 0
    for n in lengths:
        if window is None or window >= n:
            total += n * (n + 1) // 2
        else:  # the first `window` queries see 1..window keys, the rest see `window` each
            total += window * (window + 1) // 2 + (n - window) * window
    return total


def step_flops(
    config,
    doc_lengths: Sequence[Sequence[int]],
    num_loss_tokens: int | None = None,
    lora: LoraSpec | None = None,
    causal_pairs: bool = False,
    backward: bool = True,
    output_size: int | None = None,
) -> StepFlops:
    """FLOPs of one training step over documents `doc_lengths` (rows of lengths).

    `backward=False` gives the forward alone. `output_size`: the width of the output head
    (default the vocabulary; 1 for a reward model's value head, applied at its
    `num_loss_tokens` scored positions). See the module docstring for what is counted.
    """
    lengths = [int(n) for row in doc_lengths for n in row]
    if any(n < 0 for n in lengths):
        raise ValueError(f"negative document length in {doc_lengths}")
    tokens = sum(lengths)
    loss_tokens = tokens if num_loss_tokens is None else int(num_loss_tokens)
    if not 0 <= loss_tokens <= tokens:
        raise ValueError(f"num_loss_tokens {loss_tokens} outside [0, {tokens}]")

    weights_trained = lora is None
    targets = set(lora.targets) if lora is not None else set()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # does the first layer's input (the embedding output) need a gradient?
    needs_grad = lora is None or (lora.train_output and tied)

    linear = attention = 0.0
    pairs_total = 0
    for spec in layer_flop_specs(config):
        layer = _layer_step_flops(spec, lengths, causal_pairs, backward, weights_trained, targets,
                                  lora.rank if lora is not None else 0, needs_grad)
        linear += tokens * layer.linear_per_token
        attention += layer.attention
        pairs_total += layer.pairs
        needs_grad = layer.output_needs_grad

    out_factor = 1.0
    if backward:
        out_factor += float(needs_grad)  # gradient to the final hidden states
        out_factor += float(lora is None or lora.train_output)  # gradient of the projection
    width = config.vocab_size if output_size is None else int(output_size)
    output = out_factor * 2.0 * config.hidden_size * width * loss_tokens
    return StepFlops(linear=linear, attention=attention, output=output, num_tokens=tokens,
                     num_loss_tokens=loss_tokens,
                     parts={"linear_per_token": linear / tokens if tokens else 0.0,
                            "attention_pairs": float(pairs_total)})


# which activation each unified matmul reads: the layer input (through the attention norm),
# the attention output, the MLP input (residual stream after attention) or the MLP hidden
_READS = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "o": "attn_out",
          "gate": "mlp_in", "up": "mlp_in", "router": "mlp_in", "down": "mlp_mid"}


@dataclass
class _LayerFlops:
    linear_per_token: float
    attention: float
    pairs: int
    output_needs_grad: bool


def _layer_step_flops(spec: LayerFlopSpec, lengths: list[int], causal_pairs: bool, backward: bool,
                      weights_trained: bool, targets: set[str], rank: int, input_needs_grad: bool) -> _LayerFlops:
    """One layer's FLOPs, given whether its input needs a gradient; see the module docstring."""
    names = {m.name for m in spec.matmuls}
    unknown = names - set(_READS)
    if unknown:
        raise ValueError(f"matmuls {sorted(unknown)} have no known place in the layer's dataflow")
    adapted = lambda name: name in targets  # noqa: E731
    # which activations need a gradient (only matters when backward and weights are frozen)
    q, k, v = (input_needs_grad or adapted(n) for n in "qkv")
    attn_out = q or k or v
    mlp_in = input_needs_grad or attn_out or adapted("o")
    mlp_mid = mlp_in or adapted("gate") or adapted("up")
    layer_out = mlp_in or mlp_mid or adapted("down")
    needs = {"attn_in": input_needs_grad, "attn_out": attn_out, "mlp_in": mlp_in, "mlp_mid": mlp_mid}

    per_token = 0.0
    for m in spec.matmuls:
        base = 2.0 * m.n_in * m.n_out * m.per_token
        per_token += base
        a_fwd = 2.0 * rank * m.n_in * m.per_token if adapted(m.name) else 0.0
        b_fwd = 2.0 * rank * m.n_out * m.per_token if adapted(m.name) else 0.0
        per_token += a_fwd + b_fwd
        if not backward:
            continue
        if weights_trained:
            per_token += base  # weight gradient
        if needs[_READS[m.name]]:
            per_token += base + a_fwd  # gradient to the input, through the base and A
        per_token += a_fwd + 2.0 * b_fwd  # A's and B's weight gradients, B's input gradient

    pairs = _attention_pairs(lengths, causal_pairs, spec.window)
    score, value = 2.0 * spec.num_heads * spec.qk_dim * pairs, 2.0 * spec.num_heads * spec.v_dim * pairs
    attention = score + value
    if backward:
        attention += score * (q + k)  # dq, dk from the scores
        attention += value * ((q or k) + v)  # d(probabilities), dv from the weighted values
    return _LayerFlops(per_token, attention, pairs, layer_out if not weights_trained else True)


def flops_per_token(
    config,
    doc_lengths: Sequence[Sequence[int]] | None = None,
    seq_len: int | None = None,
    num_loss_tokens: int | None = None,
    lora: LoraSpec | None = None,
    causal_pairs: bool = False,
) -> float:
    """Training FLOPs per token: for the documents `doc_lengths`, or, without them, for one
    document of `seq_len` tokens (every token carrying a loss unless `num_loss_tokens`)."""
    if doc_lengths is None:
        if seq_len is None:
            raise ValueError("give doc_lengths or seq_len")
        doc_lengths = [[seq_len]]
    return step_flops(config, doc_lengths, num_loss_tokens, lora, causal_pairs).per_token


def doc_lengths_from_doc_ids(doc_ids_BT: torch.Tensor, include_padding: bool = False) -> list[list[int]]:
    """Lengths of the runs of equal document ids in each row (`-1` = padding, left out
    unless `include_padding`). Documents of a packed row are contiguous runs."""
    return [[n for doc, n in row if include_padding or doc != -1] for row in row_runs(doc_ids_BT)]


def batch_step_flops(config, batch: dict[str, torch.Tensor], lora: LoraSpec | None = None,
                     causal_pairs: bool = False, include_padding: bool = False,
                     num_loss_tokens: int | None = None, output_size: int | None = None) -> StepFlops:
    """`step_flops` for a packed batch (`doc_ids`, `labels` as in `causal_lm_loss`). A batch
    without `labels` (pair batches) gives the positions its loss projects as `num_loss_tokens`
    (`Objective.projected_positions`)."""
    num_loss = int((batch["labels"] != -100).sum()) if num_loss_tokens is None else int(num_loss_tokens)
    lengths = doc_lengths_from_doc_ids(batch["doc_ids"], include_padding=include_padding)
    return step_flops(config, lengths, num_loss, lora, causal_pairs, output_size=output_size)


def executed_step_flops(config, batch: dict[str, torch.Tensor], lora: LoraSpec | None = None,
                        num_loss_tokens: int | None = None, output_size: int | None = None,
                        attention: str = "sdpa") -> StepFlops:
    """The FLOPs the CPU kernels really execute for a batch, beside the useful ones MFU counts
    (`batch_step_flops`): every slot of the `[B, T]` batch goes through the linear layers,
    padding included. Attention as `attention` (the backend of `posttrain.ops.attention`)
    computes it: "sdpa", the dense masked call, computes each row's full `T x T` score block
    whatever the documents and windows (the mask only zeroes entries); "documents" computes
    each run of the row (a document, or the padding) on its own, `L x L` (counted as MFU
    counts a document: the causal half is not subtracted); "flex", block-sparse over 128 x 128
    tiles, is counted as "documents" (it also computes the masked part of the tiles that
    straddle a document's edge). The output projection is the same
    (our loss projects the loss tokens only). Hardware FLOPs utilisation (HFU) is these over
    the peak; HFU >= MFU, and the gap is what packing-aware kernels could save."""
    B, T = batch["doc_ids"].shape
    num_loss = int((batch["labels"] != -100).sum()) if num_loss_tokens is None else int(num_loss_tokens)
    if attention in ("documents", "flex"):
        lengths = doc_lengths_from_doc_ids(batch["doc_ids"], include_padding=True)
    elif attention == "sdpa":
        lengths = [[T]] * B
    else:
        raise ValueError(f"attention must be 'sdpa', 'documents' or 'flex', got {attention!r}")
    return step_flops(config, lengths, num_loss, lora, output_size=output_size)


def peak_flops(device: str | float | int, table: dict[str, float] | None = None) -> float:
    """Peak FLOP/s: a number passes through; a name (e.g. "h100-sxm/bf16") is looked up in
    `table` (default `PEAK_FLOPS`). CPUs have no standard peak: give a number."""
    if isinstance(device, (int, float)) and not isinstance(device, bool):
        if device <= 0:
            raise ValueError(f"peak FLOP/s must be positive, got {device}")
        return float(device)
    table = PEAK_FLOPS if table is None else table
    if device not in table:
        raise ValueError(f"no peak FLOP/s known for {device!r}; known: {sorted(table)}. Pass a number instead")
    return table[device]


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak (0..1)."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return tokens_per_s * flops_per_token / peak_flops


def mfu_from_step(step: StepFlops, step_time_s: float, peak: float, num_devices: int = 1) -> float:
    """MFU of a step that took `step_time_s` on `num_devices` devices of peak `peak` each."""
    return step.total / step_time_s / (peak * num_devices)


__all__: Iterable[str] = (
    "LayerFlopSpec", "LoraSpec", "Matmul", "PEAK_FLOPS", "StepFlops", "batch_step_flops", "dense_layer_spec",
    "executed_step_flops",
    "layer_flop_specs", "doc_lengths_from_doc_ids",
    "flops_per_token", "mfu", "mfu_from_step", "peak_flops", "step_flops",
)
