"""How each architecture describes its FLOPs to `posttrain.train.mfu`: the weight matrices of
a decoder layer (`Matmul`, `LayerFlopSpec`, `dense_layer_spec`) and LoRA's shape
(`LoraSpec`). These live with the models so that model code never imports `train/`; the
counting itself is `posttrain.train.mfu`'s."""

from __future__ import annotations

from dataclasses import dataclass


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters of rank `rank` on the unified module names in `targets`."""

    rank: int
    targets: tuple[str, ...] = LORA_TARGETS
    train_output: bool = False  # whether the output projection is trained (else frozen)

    def __post_init__(self) -> None:
        unknown = set(self.targets) - set(LORA_TARGETS)
        if unknown or self.rank <= 0:
            raise ValueError(f"LoraSpec needs rank > 0 and targets from {LORA_TARGETS}, got {self}")


@dataclass(frozen=True)
class Matmul:
    """One weight matrix of a layer: `n_in -> n_out`, applied `per_token` times per token
    (1 for dense layers; top-k for each routed-expert matrix of an MoE layer)."""

    name: str  # unified name: q, k, v, o, gate, up, down, router, ... (LoRA targets match it)
    n_in: int
    n_out: int
    per_token: float = 1.0


@dataclass(frozen=True)
class LayerFlopSpec:
    """What one decoder layer multiplies: its weight matrices, and its attention's query heads
    and head dims (`qk_dim` for scores, `v_dim` for weighted values). `window` (sliding-window
    layers) bounds the keys a query attends to in the `causal_pairs` count; the default
    "square" count is a dense kernel's `L*L` per document either way."""

    matmuls: tuple[Matmul, ...]
    num_heads: int
    qk_dim: int
    v_dim: int
    window: int | None = None


def dense_layer_spec(config) -> LayerFlopSpec:
    """The spec of a Llama-style dense layer (GQA attention + gated MLP) from config fields."""
    D, F = config.hidden_size, config.intermediate_size
    H, K, E = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    matmuls = (Matmul("q", D, H * E), Matmul("k", D, K * E), Matmul("v", D, K * E), Matmul("o", H * E, D),
               Matmul("gate", D, F), Matmul("up", D, F), Matmul("down", F, D))
    return LayerFlopSpec(matmuls, num_heads=H, qk_dim=E, v_dim=E)
