"""A dense decoder's single-token decode step through the CPU decode kernels (the
`cpu_kernels` decode backend's step).

Eager torch runs a decode step's layer as ~65 small ops (norms as five ops each, q/k norms,
rotary as eight, the cache writes, views and copies), each paying a dispatch and a pass over
memory; at generation's batch sizes that costs as much as the layer's matrix products. Here a
dense block (`posttrain.models.decoder.DecoderBlock` with `GroupedQueryAttention`, `RMSNorm`
and `SwiGLU`: Llama and Qwen3) takes one step in 12 calls: its linear maps (a plain
`nn.Linear` as the matrix product into a buffer; LoRA adapters and hooked modules through
their own call), the rest in `posttrain.rl.cpu_kernels.kernels`:

    h = add_rms_norm(x, attention_norm, + the previous block's MLP output)
    o = attend_step(wq(h), wk(h), wv(h))   # q/k norm, rotary, cache write, attention
    h = add_rms_norm(x, ffn_norm, + wo(o))
    pending = w_down(silu_mul(w_gate(h), w_up(h)))

and after the last block the final norm adds the pending MLP output. Residual sums are kept in
place in `x`, which must be the step's own (the embedding's fresh output).

At a few hundred rows a step's Python costs as much as its arithmetic, so what the step reads
from the modules (weights, norms, flags) and the buffers the plain linear maps write are
gathered once per cache into a `_Plan` (kept in `KVCache.derived`, shared by the caches
`fork` and `select` make), and each layer's attention goes through a prepared kernel call
(`KernelLayerKV.attend_step`: the step runs on a `KernelKVCache`). From a cache's second step
on, a plain model's whole step is one C call (`_StepProgram`: the same sgemm torch's matrix
product calls, with the same arguments, so the same bits). Measured at one row, where a step
is all overhead: 1.43 ms a step before, 0.70 ms with the plan, 0.51 ms with the program (the
decode loop's own savings included).

The same function as `DecoderBlock.forward` in float32, in other summation orders (norm sums,
the attention's dot products): logits agree to ~1e-6, and greedy decoding matches transformers
token for token (tests/unit/test_fused_decode.py, tests/unit/test_rollout_native.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.decoder import DecoderBlock
from posttrain.models.kv_cache import KVCache
from posttrain.models.layers import GroupedQueryAttention, RMSNorm, SwiGLU
from posttrain.ops.attention import AttentionMask
from posttrain.rl.cpu_kernels import kernels
from posttrain.rl.cpu_kernels.cache import KernelKVCache, KernelLayerKV


def block_fusable(block: nn.Module) -> bool:
    """Whether a block is a `DecoderBlock` with the dense parts this step knows."""
    if type(block) is not DecoderBlock:
        return False
    attention = block.attention
    norms = (block.attention_norm, block.ffn_norm)
    head_norms = (attention.q_norm, attention.k_norm) if type(attention) is GroupedQueryAttention else ()
    return (type(attention) is GroupedQueryAttention and type(block.feed_forward) is SwiGLU
            and all(type(norm) is RMSNorm for norm in norms)
            and (head_norms == (None, None)
                 or (all(type(norm) is RMSNorm for norm in head_norms) and head_norms[0].eps == head_norms[1].eps)))


def applies(x_BD: torch.Tensor, blocks: Sequence[nn.Module], final_norm: nn.Module,
            cache: KVCache | None = None) -> bool:
    """Whether `decode_step` takes this step: float32 on the CPU without gradients, the kernels
    built, every block fusable and the final norm an `RMSNorm`; with `cache`, a `KernelKVCache`,
    and the blocks' check is made once for it (and the caches `fork` and `select` make from it)."""
    if not (x_BD.dtype == torch.float32 and x_BD.device.type == "cpu" and not torch.is_grad_enabled()
            and kernels.load() is not None and (cache is None or isinstance(cache, KernelKVCache))):
        return False
    plan = None if cache is None else cache.derived.get(_PLAN)
    if plan is not None and plan.blocks is blocks and plan.final_norm is final_norm:
        return True
    return type(final_norm) is RMSNorm and all(block_fusable(block) for block in blocks)


def _checked(result: torch.Tensor | None, what: str) -> torch.Tensor:
    if result is None:  # `applies` said yes: a kernel refusing now is a bug, not a fallback
        raise RuntimeError(f"fused decode step: {what} refused inputs that applies() accepted")
    return result


# torch's registries of hooks that every module call runs (`nn.modules.module.register_module_forward_hook`)
_GLOBAL_HOOKS = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)
_PLAN = "fused_step_plan"  # the `KVCache.derived` key of a cache's `_Plan`


def _plain_linear(module: nn.Module) -> bool:
    """A plain `nn.Linear`: no hooks of its own or global ones, `forward` not replaced on the
    instance. Its call is then the matrix product alone (~5 us of module machinery saved a
    call, 28 calls a step); anything else (LoRA, a hooked module) runs through its call."""
    return (type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)
            and "forward" not in module.__dict__ and not (_GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]))


class _Map:
    """One linear map of a block, as the step runs it: a plain `nn.Linear` as `x @ weight.T
    (+ bias)` into a buffer of the step's batch size (the same product as `F.linear`, bitwise),
    anything else through its module call (a new tensor). The weight is read through a view
    made here: updates in place are seen at once, a replaced tensor from the next plan on."""

    __slots__ = ("module", "plain", "buffered", "weight_T", "bias", "buffers")

    def __init__(self, module: nn.Module):
        self.module, self.plain, self.buffered, self.buffers = module, _plain_linear(module), False, {}
        self.weight_T = module.weight.t() if self.plain else None
        self.bias = module.bias if self.plain else None

    def __call__(self, x_BI: torch.Tensor) -> torch.Tensor:
        if not self.plain:
            return self.module(x_BI)
        if not self.buffered:
            return F.linear(x_BI, self.weight_T.t(), self.bias)
        B = x_BI.shape[0]
        out_BO = self.buffers.get(B)
        if out_BO is None:
            out_BO = self.buffers[B] = x_BI.new_empty((B, self.weight_T.shape[1]))
        if self.bias is None:
            return torch.mm(x_BI, self.weight_T, out=out_BO)
        return torch.addmm(self.bias, x_BI, self.weight_T, out=out_BO)


class _BlockPlan:
    """What the step reads from one block, read once per cache instead of ~40 module attribute
    lookups a step."""

    __slots__ = ("attention_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "buffered",
                 "q_norm", "k_norm", "head_eps", "scale", "n_kv_heads")

    def __init__(self, block: nn.Module):
        attention, mlp = block.attention, block.feed_forward
        self.attention_norm, self.ffn_norm = block.attention_norm, block.ffn_norm
        self.wq, self.wk, self.wv, self.wo = (_Map(m) for m in (attention.wq, attention.wk, attention.wv, attention.wo))
        self.w_gate, self.w_up, self.w_down = (_Map(m) for m in (mlp.w_gate, mlp.w_up, mlp.w_down))
        maps = (self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down)
        # buffers only where no module call (a hook, an adapter) could keep a reference to one
        self.buffered = all(m.plain for m in maps)
        for m in maps:
            m.buffered = self.buffered
        self.q_norm, self.k_norm = attention.q_norm, attention.k_norm
        self.head_eps = 0.0 if self.q_norm is None else self.q_norm.eps
        self.scale, self.n_kv_heads = attention.scale, attention.n_kv_heads


class _Plan:
    """The step's view of the model for one cache (and the caches `fork` and `select` make from
    it, which share its `derived` tables): the blocks' parts, and where each plain linear map
    writes. Hooks added or modules swapped while a cache is in use are seen by the next cache
    (the next generate call); in-place weight updates at once."""

    def __init__(self, blocks: Sequence[nn.Module], final_norm: RMSNorm):
        self.blocks, self.final_norm = blocks, final_norm
        self.block_plans = [_BlockPlan(block) for block in blocks]
        self.norm_buffers: dict[int, torch.Tensor] = {}
        self.programs: dict[int, _StepProgram | None] = {}  # by batch size; None: the Python path

    def program(self, x_BD: torch.Tensor) -> _StepProgram | None:
        """The whole-step program for this batch size, where it applies."""
        B = x_BD.shape[0]
        if B not in self.programs:
            sgemm = kernels.sgemm_address()
            fits = sgemm is not None and x_BD.is_contiguous() and _StepProgram.fits(self, x_BD)
            self.programs[B] = _StepProgram(self, B, x_BD, sgemm) if fits else None
        return self.programs[B]

    def norm_out(self, like_BD: torch.Tensor) -> torch.Tensor:
        """The buffer the blocks' norms write (the input of the next linear maps)."""
        B = like_BD.shape[0]
        out_BD = self.norm_buffers.get(B)
        if out_BD is None:
            out_BD = self.norm_buffers[B] = like_BD.new_empty(like_BD.shape)
        return out_BD


class _StepProgram:
    """The whole step as one C call (`posttrain_decode_step_f32` in `csrc/decode_step.c`) for
    `B` rows: an argument array of the blocks' weights and norms (addresses held alive by the
    plan's weight views), the step's buffers and, per block, its cache layer's prepared
    attention call, bound to those buffers each step. It calls the same sgemm as `torch.mm`
    with the same arguments and the same kernels, so a step gives the bits of the Python path
    (tests/unit/test_fused_decode.py). Built only where every block is plain (unbiased plain
    `nn.Linear` maps of one shape per kind, contiguous float32 weights) and torch exports its
    sgemm; elsewhere the Python path runs."""

    HEADER = 20  # csrc/decode_step.c: the header's entries, then PER_LAYER per block
    PER_LAYER = 12

    def __init__(self, plan: "_Plan", B: int, like_BD: torch.Tensor, sgemm: int):
        parts = plan.block_plans
        first = parts[0]
        D = like_BD.shape[1]
        HE, KE, F_ = first.wq.weight_T.shape[1], first.wk.weight_T.shape[1], first.w_gate.weight_T.shape[1]
        new = like_BD.new_empty
        self.buffers = {name: new((B, width)) for name, width in
                        (("h", D), ("q", HE), ("k", KE), ("v", KE), ("o", HE), ("proj", D), ("gate", F_),
                         ("up", F_), ("down", D))}
        buf, bits = self.buffers, kernels.float_bits
        final = plan.final_norm.weight
        header = [len(parts), B, D, HE, KE, F_, sgemm, 0, 0,  # 7, 8: the step's input and output, set per step
                  final.data_ptr(), bits(plan.final_norm.eps),
                  *(buf[n].data_ptr() for n in ("h", "q", "k", "v", "o", "proj", "gate", "up", "down"))]
        assert len(header) == self.HEADER
        layers = []
        for part in parts:
            maps = (part.wq, part.wk, part.wv, part.wo, part.w_gate, part.w_up, part.w_down)
            layers += [part.attention_norm.weight.data_ptr(), bits(part.attention_norm.eps),
                       *(m.weight_T.data_ptr() for m in maps),
                       part.ffn_norm.weight.data_ptr(), bits(part.ffn_norm.eps),
                       0]  # the layer's prepared attention call, set per step
        fields = header + layers
        self._fields = (ctypes.c_int64 * len(fields))(*fields)
        self._entry = kernels.load().posttrain_decode_step_f32
        # the norm weights' storage, held alive for the addresses above (the maps' views hold theirs)
        self._norm_weights = [final] + [w for part in parts for w in (part.attention_norm.weight, part.ffn_norm.weight)]
        head_size = KE // first.n_kv_heads
        self.query_heads = [part.wq.weight_T.shape[1] // head_size for part in parts]

    @staticmethod
    def fits(plan: "_Plan", like_BD: torch.Tensor) -> bool:
        parts = plan.block_plans
        if not parts or not all(part.buffered for part in parts):
            return False
        first = parts[0]
        D = like_BD.shape[1]
        shapes = {"wq": first.wq.weight_T.shape, "wk": first.wk.weight_T.shape, "wv": first.wk.weight_T.shape,
                  "w_gate": first.w_gate.weight_T.shape, "w_up": first.w_gate.weight_T.shape}
        for part in parts:
            maps = {name: getattr(part, name) for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
            if any(m.bias is not None or m.weight_T.dtype is not torch.float32 or not m.weight_T.t().is_contiguous()
                   for m in maps.values()):
                return False
            if part.n_kv_heads != first.n_kv_heads or any(maps[name].weight_T.shape != shape
                                                          for name, shape in shapes.items()):
                return False
            if (maps["wq"].weight_T.shape[0] != D or maps["wo"].weight_T.shape != (shapes["wq"][1], D)
                    or maps["w_down"].weight_T.shape != (shapes["w_gate"][1], D)):
                return False
            if any(not w.is_contiguous() or w.dtype is not torch.float32
                   for w in (part.attention_norm.weight, part.ffn_norm.weight)):
                return False
        return plan.final_norm.weight.is_contiguous() and plan.final_norm.weight.dtype is torch.float32

    def run(self, x_BD: torch.Tensor, kv_layers: Sequence[KernelLayerKV], plan: "_Plan",
            rope: Sequence[tuple[torch.Tensor, torch.Tensor]], masks: Sequence[AttentionMask]) -> torch.Tensor | None:
        """The step's final-normed hidden states (a new `[B, D]` tensor), or None (nothing
        done) where a layer has no prepared attention call for this step yet."""
        buf, f = self.buffers, self._fields
        held = []  # the masks as the kernel reads them, alive until the call returns
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # `[B, E]` rotary tables, sliced once per kind
        for index, (part, kv, (cos_BTE, sin_BTE), mask, H) in enumerate(zip(plan.block_plans, kv_layers, rope,
                                                                            masks, self.query_heads)):
            q_norm, k_norm = part.q_norm, part.k_norm
            call = kv.prepared_step(x_BD.shape[0], H, None if q_norm is None else q_norm.weight,
                                    None if k_norm is None else k_norm.weight, part.head_eps, part.scale)
            if call is None or mask.dense_B1TT is None:
                return None
            if id(cos_BTE) not in tables:
                tables[id(cos_BTE)] = (cos_BTE[:, 0], sin_BTE[:, 0])
            cache = kv.cache
            bound = call.bind(buf["q"], buf["k"], buf["v"], *tables[id(cos_BTE)], mask.dense_B1TT,
                              cache.length - cache.offset, buf["o"])
            if bound is None:
                return None
            held.append(bound)
            f[self.HEADER + index * self.PER_LAYER + self.PER_LAYER - 1] = call.address
        out_BD = x_BD.new_empty(x_BD.shape)
        f[7], f[8] = x_BD.data_ptr(), out_BD.data_ptr()
        self._entry(f)
        return out_BD


def _plan(blocks: Sequence[nn.Module], final_norm: RMSNorm, cache: KVCache) -> _Plan:
    plan = cache.derived.get(_PLAN)
    if plan is None or plan.blocks is not blocks or plan.final_norm is not final_norm:
        plan = cache.derived[_PLAN] = _Plan(blocks, final_norm)
    return plan


def _norm(x_BD: torch.Tensor, norm: RMSNorm, delta_BD: torch.Tensor | None, out_BD: torch.Tensor | None,
          what: str) -> torch.Tensor:
    return _checked(kernels.add_rms_norm(x_BD, norm.weight, norm.eps, delta_BD, out_BD), what)


def decode_step(blocks: Sequence[nn.Module], kv_layers: Sequence[KernelLayerKV], x_BD: torch.Tensor,
                rope: Sequence[tuple[torch.Tensor, torch.Tensor]], masks: Sequence[AttentionMask],
                final_norm: RMSNorm) -> torch.Tensor:
    """The final-normed hidden states `[B, D]` of one token per row through `blocks` (module
    docstring); `rope[i]` is block i's `(cos_BTE, sin_BTE)` with `T == 1`, `masks[i]` its cached
    mask, `kv_layers[i]` its cache layer. `x_BD` is overwritten; the result is a new tensor.
    Call only where `applies`."""
    plan = _plan(blocks, final_norm, kv_layers[0].cache)
    program = plan.program(x_BD)
    if program is not None:
        out_BD = program.run(x_BD, kv_layers, plan, rope, masks)
        if out_BD is not None:
            return out_BD
    pending_BD = None
    norm_out_BD = plan.norm_out(x_BD)
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # `[B, E]` rotary tables, sliced once per kind
    for parts, kv, (cos_BTE, sin_BTE), mask in zip(plan.block_plans, kv_layers, rope, masks):
        if id(cos_BTE) not in tables:
            tables[id(cos_BTE)] = (cos_BTE[:, 0], sin_BTE[:, 0])
        cos_BE, sin_BE = tables[id(cos_BTE)]
        h_BD = _norm(x_BD, parts.attention_norm, pending_BD, norm_out_BD if parts.buffered else None, "add_rms_norm")
        q_norm, k_norm = parts.q_norm, parts.k_norm
        o_BX = _checked(kv.attend_step(
            parts.wq(h_BD), parts.wk(h_BD), parts.wv(h_BD), cos_BE, sin_BE, mask, parts.scale, parts.n_kv_heads,
            None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight, parts.head_eps),
            "attend_step")
        h_BD = _norm(x_BD, parts.ffn_norm, parts.wo(o_BX), norm_out_BD if parts.buffered else None, "add_rms_norm")
        gate_BF = _checked(kernels.silu_mul(parts.w_gate(h_BD), parts.w_up(h_BD)), "silu_mul")
        pending_BD = parts.w_down(gate_BF)
    return _norm(x_BD, final_norm, pending_BD, None, "add_rms_norm")
