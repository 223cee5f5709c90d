"""A dense decoder's single-token decode step through the fused CPU kernels.

Eager torch runs a decode step's layer as ~65 small ops (norms as five ops each, q/k norms,
rotary as eight, the cache writes, views and copies), each paying a dispatch and a pass over
memory; at generation's batch sizes that costs as much as the layer's matrix products. Here a
dense block (`posttrain.models.decoder.DecoderBlock` with `GroupedQueryAttention`, `RMSNorm`
and `SwiGLU`: Llama and Qwen3) takes one step in 12 calls: its linear maps (a plain
`nn.Linear` as the functional call; LoRA adapters and hooked modules through their own call),
the rest in `posttrain.ops.decode_kernel`:

    h = add_rms_norm(x, attention_norm, + the previous block's MLP output)
    o = attend_step(wq(h), wk(h), wv(h))   # q/k norm, rotary, cache write, attention
    h = add_rms_norm(x, ffn_norm, + wo(o))
    pending = w_down(silu_mul(w_gate(h), w_up(h)))

and after the last block the final norm adds the pending MLP output. Residual sums are kept in
place in `x`, which must be the step's own (the embedding's fresh output).

The same function as `DecoderBlock.forward` in float32, in other summation orders (norm sums,
the attention's dot products): logits agree to ~1e-6, and greedy decoding matches transformers
token for token (tests/unit/test_rollout_native.py, tests/unit/test_fused_decode.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.kv_cache import LayerKV
from posttrain.models.layers import GroupedQueryAttention, RMSNorm, SwiGLU
from posttrain.ops import decode_kernel
from posttrain.ops.attention import AttentionMask


def block_fusable(block: nn.Module) -> bool:
    """Whether a `DecoderBlock`'s parts are the dense ones this step knows."""
    attention = block.attention
    norms = (block.attention_norm, block.ffn_norm)
    head_norms = (attention.q_norm, attention.k_norm) if type(attention) is GroupedQueryAttention else ()
    return (type(attention) is GroupedQueryAttention and type(block.feed_forward) is SwiGLU
            and all(type(norm) is RMSNorm for norm in norms)
            and (head_norms == (None, None)
                 or (all(type(norm) is RMSNorm for norm in head_norms) and head_norms[0].eps == head_norms[1].eps)))


def applies(x_BD: torch.Tensor, blocks: Sequence[nn.Module], final_norm: nn.Module) -> bool:
    """Whether `decode_step` takes this step: float32 on the CPU without gradients, the kernels
    built, every block fusable and the final norm an `RMSNorm`."""
    return (x_BD.dtype == torch.float32 and x_BD.device.type == "cpu" and not torch.is_grad_enabled()
            and decode_kernel.load() is not None and type(final_norm) is RMSNorm
            and all(block_fusable(block) for block in blocks))


def _checked(result: torch.Tensor | None, what: str) -> torch.Tensor:
    if result is None:  # `applies` said yes: a kernel refusing now is a bug, not a fallback
        raise RuntimeError(f"fused decode step: {what} refused inputs that applies() accepted")
    return result


# torch's registries of hooks that every module call runs (`nn.modules.module.register_module_forward_hook`)
_GLOBAL_HOOKS = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)


def _linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`; a plain `nn.Linear` (no hooks of its own or global ones, `forward` not
    replaced on the instance) as the functional call, skipping the module call's machinery
    (~5 us a call, 28 calls a step). Anything else (LoRA, a hooked module) through its call."""
    if (type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)
            and "forward" not in module.__dict__ and not (_GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1])):
        return F.linear(x, module.weight, module.bias)
    return module(x)


def decode_step(blocks: Sequence[nn.Module], kv_layers: Sequence[LayerKV], x_BD: torch.Tensor,
                rope: Sequence[tuple[torch.Tensor, torch.Tensor]], masks: Sequence[AttentionMask],
                final_norm: RMSNorm) -> torch.Tensor:
    """The final-normed hidden states `[B, D]` of one token per row through `blocks` (module
    docstring); `rope[i]` is block i's `(cos_BTE, sin_BTE)` with `T == 1`, `masks[i]` its cached
    mask, `kv_layers[i]` its cache layer. `x_BD` is overwritten. Call only where `applies`."""
    pending_BD = None
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # `[B, E]` rotary tables, sliced once per kind
    for block, kv, (cos_BTE, sin_BTE), mask in zip(blocks, kv_layers, rope, masks):
        attention, mlp = block.attention, block.feed_forward
        if id(cos_BTE) not in tables:
            tables[id(cos_BTE)] = (cos_BTE[:, 0], sin_BTE[:, 0])
        cos_BE, sin_BE = tables[id(cos_BTE)]
        norm = block.attention_norm
        h_BD = _checked(decode_kernel.add_rms_norm(x_BD, norm.weight, norm.eps, pending_BD), "add_rms_norm")
        q_norm, k_norm = attention.q_norm, attention.k_norm
        o_BX = _checked(kv.attend_step(
            _linear(attention.wq, h_BD), _linear(attention.wk, h_BD), _linear(attention.wv, h_BD), cos_BE, sin_BE,
            mask, attention.scale, attention.n_kv_heads, None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight, 0.0 if q_norm is None else q_norm.eps), "attend_step")
        norm = block.ffn_norm
        h_BD = _checked(decode_kernel.add_rms_norm(x_BD, norm.weight, norm.eps, _linear(attention.wo, o_BX)),
                        "add_rms_norm")
        gate_BF = _checked(decode_kernel.silu_mul(_linear(mlp.w_gate, h_BD), _linear(mlp.w_up, h_BD)), "silu_mul")
        pending_BD = _linear(mlp.w_down, gate_BF)
    return _checked(decode_kernel.add_rms_norm(x_BD, final_norm.weight, final_norm.eps, pending_BD), "add_rms_norm")
