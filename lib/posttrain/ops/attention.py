"""Document-masked causal attention.

Packed rows hold several documents; a token may attend to key `k` from query `q` iff
`k <= q` and both belong to the same document (`doc_ids[q] == doc_ids[k]`). Padding has
`doc_id == -1`, so padding attends only to earlier padding and no query row is ever fully
masked (the diagonal is always allowed). A document may be a tree (`branch_ids`): a shared
trunk (a preference pair's prompt) and branches (its two responses) that each see the trunk
and themselves, not each other.

Backends (chosen once per forward by `select_backend`, then shared by every layer):
- "documents" (CPU, plain document-causal masks, where it pays: `per_document_pays`; the same
  on CUDA where torch has no FlexAttention, the varlen fallback): one
  `F.scaled_dot_product_attention` call per document with `is_causal=True`, over that
  document's queries and keys only. The masked
  call below computes every row's full `T x T` block (its CPU kernel skips no masked block);
  this computes each document's causal half, `sum(L_i^2) / 2` pairs. The mask still carries
  the dense form for consumers that need it (sink attention, tests). Chosen when the rows'
  documents are contiguous runs (padding included) and there is no window or tree; the sums
  run in another order than the masked call's (float32 outputs agree to ~3e-7, not bitwise).
  Where the trainer compiles model blocks, the per-document loop runs outside the graphs
  (`keep_per_document_loop_out_of_compiled_graphs`).
- "sdpa": `F.scaled_dot_product_attention` with a dense boolean `[B, 1, T, T]` mask. Works
  everywhere, including backward on CPU; memory is O(B*T^2) booleans.
- "decode": a KV cache's single-query steps (`build_cached_attention_mask` with one new token
  per row): the same dense mask, attention as two batched matmuls and a float32 softmax.
  SDPA's CPU kernel is built for blocks of queries and took 1.6 ms per call on one query per
  row where this takes a fraction (bench/rollout.py); inference only. The rollout engine's
  optional `cpu_kernels` decode backend runs these steps in a fused C kernel instead
  (`posttrain.rl.cpu_kernels`: one pass over the keys, one over the values); this is the
  reference.
- "flex" (CUDA; any device for inference): FlexAttention (`torch.nn.attention.flex_attention`)
  over a block-sparse `BlockMask` built from the same rule (`allowed_pairs`):
  document, causal, tree (branch) and window rules, evaluated per 128 x 128 tile, so fully
  masked tiles are skipped and no `[B, 1, T, T]` mask exists (on CUDA the block mask itself
  is built by a compiled kernel). Rows are padded to a shape bucket (`flex_bucket_length`) so
  the compiled kernel is reused across steps instead of recompiling for every new length.
  Attention sinks (GPT-OSS) use its log-sum-exp (`posttrain.ops.sink_attention`). Chosen on
  CUDA by `select_backend`; torch 2.13 has no FlexAttention backward on CPU, so CPU training
  uses "documents" or "sdpa" and CPU runs "flex" only without gradients (tests, parity).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

BACKENDS = ("documents", "sdpa", "decode", "flex")


def allowed_pairs(q_idx: torch.Tensor, k_idx: torch.Tensor, doc_q: torch.Tensor, doc_k: torch.Tensor,
                  window: int | None = None, branch_q: torch.Tensor | None = None,
                  branch_k: torch.Tensor | None = None, pos_q: torch.Tensor | None = None,
                  pos_k: torch.Tensor | None = None) -> torch.Tensor:
    """The attention rule, once, for every backend: whether the query at row index `q_idx` may
    see the key at `k_idx` (broadcastable tensors: whole `[B, T, T]` grids for the dense mask,
    scalars inside FlexAttention's `mask_mod`). `k <= q` and the same document; for tree
    documents (branches given) the key's branch is the trunk (0) or the query's own; with a
    `window`, the query sees itself and the `window - 1` tokens before it, measured in row
    distance for plain documents and in positions for trees (`document_causal_mask`)."""
    allowed = (k_idx <= q_idx) & (doc_q == doc_k)
    if branch_q is not None:
        allowed = allowed & ((branch_k == 0) | (branch_k == branch_q))
        if window is not None:  # pos_q - pos_k < window, without a [T, T] integer temporary
            allowed = allowed & (pos_k > pos_q - window)
    elif window is not None:
        allowed = allowed & (k_idx > q_idx - window)
    return allowed


def _check_mask_inputs(window: int | None, branch_ids_BT: torch.Tensor | None,
                       position_ids_BT: torch.Tensor | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    if window is not None and branch_ids_BT is not None and position_ids_BT is None:
        raise ValueError("a sliding window over tree documents needs position_ids_BT")


def document_causal_mask(doc_ids_BT: torch.Tensor, window: int | None = None,
                         branch_ids_BT: torch.Tensor | None = None,
                         position_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask `[B, 1, T, T]`: `allowed[b, 0, q, k] = k <= q and doc[b, q] == doc[b, k]`.

    With `window` (sliding-window attention), also `q - k < window`: a query sees itself and
    the `window - 1` tokens before it, as transformers' sliding-window layers do. Documents
    are contiguous runs of a row, so the distance in the row is the distance in the document.

    Tree documents (`branch_ids_BT`, e.g. a preference pair whose prompt is shared): branch 0
    is the trunk every token of the document may see; a token of branch `j > 0` sees the trunk
    and earlier tokens of branch `j` only (`branch[k] == 0 or branch[k] == branch[q]`). A
    branch's positions continue from the trunk, so within a tree the window is measured in
    `position_ids_BT` (required with branches and a window), not in row distance. The rule is
    `allowed_pairs`, which FlexAttention's block masks evaluate too.
    """
    _check_mask_inputs(window, branch_ids_BT, position_ids_BT)
    T = doc_ids_BT.shape[1]
    index_T = torch.arange(T, device=doc_ids_BT.device)
    trees = branch_ids_BT is not None
    allowed_BTT = allowed_pairs(
        index_T[:, None], index_T[None, :], doc_ids_BT[:, :, None], doc_ids_BT[:, None, :], window,
        branch_ids_BT[:, :, None] if trees else None, branch_ids_BT[:, None, :] if trees else None,
        position_ids_BT[:, :, None] if trees and window is not None else None,
        position_ids_BT[:, None, :] if trees and window is not None else None)
    return allowed_BTT[:, None, :, :]


def flex_available() -> bool:
    """Whether this torch has FlexAttention (torch >= 2.5)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(device: torch.device | str) -> str:
    """The attention backend for a training forward on `device`: "flex" on CUDA where torch has
    FlexAttention; else "documents" (on CUDA without Flex, the varlen fallback: one causal SDPA
    call per document, flash kernels included), which `build_attention_mask` turns into
    "sdpa" for windows, trees and split documents."""
    if torch.device(device).type == "cuda" and flex_available():
        return "flex"
    return "documents"


# What one more SDPA call (forward + backward) costs on CPU, in (query, key) pairs of a masked
# call: ~60 us against ~5 ns a pair and head, i.e. ~30,000 pair-heads, ~8,000 pairs at 4 heads
# (measured on the AMD EPYC Zen 5 of docs/benchmarks.md, 2 threads, head dims 16-32). Below
# it the loop's calls cost more than the pairs they skip: rows of 128 tokens with documents of
# 20 ran 1.8x slower per document, rows of 1,024 with any documents 2.7-4x faster.
PER_DOCUMENT_CALL_PAIRS = 8_000


def per_document_pays(doc_runs: list[list[int]], T: int) -> bool:
    """Whether the per-document backend should beat one masked call over rows of `T`: the
    pairs it skips (`B * T^2` against each document's causal half) outweigh the fixed cost of
    its calls (`PER_DOCUMENT_CALL_PAIRS` each)."""
    calls = sum(len(lengths) for lengths in doc_runs)
    kept = sum(n * (n + 1) // 2 for lengths in doc_runs for n in lengths)
    return len(doc_runs) * T * T - kept > calls * PER_DOCUMENT_CALL_PAIRS


def choose_backend(doc_ids_BT: torch.Tensor, window: int | None = None,
                   branch_ids_BT: torch.Tensor | None = None) -> tuple[str, list[list[int]] | None]:
    """`(backend, document runs or None)` for a training forward of `doc_ids_BT`: "flex" where
    `select_backend` says so (CUDA), "documents" on CPU for plain document masks where
    `per_document_pays`, else "sdpa". What
    `build_attention_mask` does without an explicit backend, and what the trainer's FLOP
    accounting asks."""
    backend = select_backend(doc_ids_BT.device)
    if backend == "flex":
        return "flex", None
    if backend != "documents" or window is not None or branch_ids_BT is not None:
        return "sdpa", None
    runs = document_runs(doc_ids_BT)
    if runs is None or not per_document_pays(runs, doc_ids_BT.shape[1]):
        return "sdpa", None
    return "documents", runs


def row_runs(doc_ids_BT: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each row's maximal runs of equal document ids, in order, as `(doc_id, length)` (padding
    is id `-1`)."""
    runs = []
    for row_T in doc_ids_BT.tolist():
        row: list[tuple[int, int]] = []
        for doc in row_T:
            if row and row[-1][0] == doc:
                row[-1] = (doc, row[-1][1] + 1)
            else:
                row.append((doc, 1))
        runs.append(row)
    return runs


def document_runs(doc_ids_BT: torch.Tensor) -> list[list[int]] | None:
    """The lengths of each row's documents, in order, when every document of a row (and its
    padding, `-1`) is one contiguous run; None when some id occurs in two runs of a row (the
    dense mask lets those runs see each other; per-document attention would not)."""
    if doc_ids_BT.shape[1] == 0:
        return None
    lengths = []
    for row in row_runs(doc_ids_BT):
        if len({doc for doc, _ in row}) != len(row):
            return None
        lengths.append([n for _, n in row])
    return lengths


@dataclass
class AttentionMask:
    """A document-causal mask prepared once per forward for a given backend."""

    backend: str
    # every backend but "flex": boolean, True where attention is allowed; `[B, 1, T, T]`, or
    # `[B, 1, T, S]` over a KV cache's S slots (`build_cached_attention_mask`)
    dense_B1TT: torch.Tensor | None = None
    window: int | None = None  # sliding window it was built with (None: full causal)
    # "documents": each row's document lengths in order (`document_runs`); they tile the row
    doc_runs: list[list[int]] | None = None
    # "flex": the block-sparse mask over rows padded to `padded_length` (`flex_bucket_length`)
    block_mask: Any = None
    padded_length: int | None = None


def build_attention_mask(doc_ids_BT: torch.Tensor, backend: str | None = None,
                         window: int | None = None, branch_ids_BT: torch.Tensor | None = None,
                         position_ids_BT: torch.Tensor | None = None) -> AttentionMask:
    """Prepare the mask for `doc_ids_BT` (`[B, T]` long, `-1` for padding); `window`,
    `branch_ids_BT` (tree documents) and `position_ids_BT` as in `document_causal_mask`. Models
    with mixed layer types build one mask per type. Without `backend`, `choose_backend` picks
    ("flex" on CUDA, "documents" on CPU where it pays); an explicit "documents" is used wherever
    it is exact, and falls back to "sdpa" for windows, trees and documents split into several
    runs. "flex" masks are block masks (`flex_block_mask`) and carry no dense form; every
    other mask carries `dense_B1TT`."""
    if backend is None:
        backend, runs = choose_backend(doc_ids_BT, window, branch_ids_BT)
    elif backend == "documents":
        runs = document_runs(doc_ids_BT) if window is None and branch_ids_BT is None else None
    elif backend in ("sdpa", "flex"):
        runs = None
    else:
        raise ValueError(f"unknown attention backend {backend!r}; available: {BACKENDS}")
    if backend == "flex":
        block_mask, padded_length = flex_block_mask(doc_ids_BT, window, branch_ids_BT, position_ids_BT)
        return AttentionMask("flex", window=window, block_mask=block_mask, padded_length=padded_length)
    dense_B1TT = document_causal_mask(doc_ids_BT, window, branch_ids_BT, position_ids_BT)
    if runs is not None:
        return AttentionMask("documents", dense_B1TT=dense_B1TT, doc_runs=runs)
    return AttentionMask("sdpa", dense_B1TT=dense_B1TT, window=window)


# FlexAttention's tile: its block masks mark which 128 x 128 (query, key) tiles hold any
# allowed pair (computed) and which hold only allowed pairs (no mask evaluated inside).
FLEX_BLOCK = 128


def flex_bucket_length(T: int) -> int:
    """The row length a FlexAttention call runs at for rows of `T`: the next multiple of 128 up
    to 1,024, then of 1,024. The compiled kernel specialises on the length, so this bounds
    the distinct compilations (packed training rows have one length; RL rows vary) at a
    cost of at most 1,023 padded positions. They join the row's padding document (-1), so the
    tiles where padding sees padding are computed (and discarded); no real token's are."""
    step = FLEX_BLOCK if T <= 1024 else 1024
    return max(step, -(-T // step) * step)


def flex_block_mask(doc_ids_BT: torch.Tensor, window: int | None = None,
                    branch_ids_BT: torch.Tensor | None = None,
                    position_ids_BT: torch.Tensor | None = None) -> tuple[Any, int]:
    """`(BlockMask, padded length)` for FlexAttention: `allowed_pairs` over rows padded to
    `flex_bucket_length(T)` (the added slots are padding, document -1: no real query sees
    them, as keys come after every real position). Off the CPU the mask is built by a compiled
    kernel that evaluates `allowed_pairs` tile by tile; nothing of size `T x T` is allocated."""
    from torch.nn.attention.flex_attention import create_block_mask

    _check_mask_inputs(window, branch_ids_BT, position_ids_BT)
    B, T = doc_ids_BT.shape
    padded = flex_bucket_length(T)

    def pad(ids_BT: torch.Tensor | None, value: int) -> torch.Tensor | None:
        return None if ids_BT is None else F.pad(ids_BT, (0, padded - T), value=value)

    doc_BP, branch_BP = pad(doc_ids_BT, -1), pad(branch_ids_BT, 0)
    pos_BP = pad(position_ids_BT, 0) if branch_ids_BT is not None and window is not None else None

    def mask_mod(b, h, q_idx, k_idx):
        return allowed_pairs(
            q_idx, k_idx, doc_BP[b, q_idx], doc_BP[b, k_idx], window,
            None if branch_BP is None else branch_BP[b, q_idx], None if branch_BP is None else branch_BP[b, k_idx],
            None if pos_BP is None else pos_BP[b, q_idx], None if pos_BP is None else pos_BP[b, k_idx])

    compiled = doc_ids_BT.device.type != "cpu"
    if compiled:
        _allow_flex_recompiles()
    block_mask = create_block_mask(mask_mod, B, None, padded, padded, device=doc_ids_BT.device,
                                   BLOCK_SIZE=FLEX_BLOCK, _compile=compiled)
    return block_mask, padded


_flex_kernels: dict[bool, Any] = {}

# Every (dtype, mask rule, shape bucket, with or without gradients) is a compilation of its own,
# and one process meets several: an RL policy's training forward, its reference's and the
# evaluation's no-grad ones, bf16 and float32. Past torch's default of 8 per function, dynamo
# silently runs FlexAttention eagerly over dense scores: measured on an H200, a forward +
# backward of 8,192 packed tokens then took 93 ms against dense SDPA's 6.4 ms (docs/benchmarks.md).
# The limit is dynamo's, per function but set for the whole process: compiled decoder blocks
# get it too.
FLEX_RECOMPILE_LIMIT = 64


@functools.cache  # once per process: block masks are built every forward
def _allow_flex_recompiles() -> None:
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))


def _flex_kernel(compiled: bool):
    """FlexAttention itself (eager: a reference over dense scores; CPU inference only) or its
    compiled kernel (accelerators), compiled once per process and shared by every layer."""
    if compiled not in _flex_kernels:
        from torch.nn.attention.flex_attention import flex_attention

        if compiled:
            _allow_flex_recompiles()
        _flex_kernels[compiled] = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    return _flex_kernels[compiled]


def flex_document_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                            mask: AttentionMask, scale: float | None = None,
                            return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query FlexAttention under a "flex" `mask`: `o_BHTE`, and with `return_lse` also
    the float32 log-sum-exp of each query's allowed scores `lse_BHT` (natural log). Inputs
    are padded to the mask's length and the outputs cut back to `T`."""
    T, padded = q_BHTE.shape[2], mask.padded_length
    if padded != T:
        q_BHTE, k_BKTE, v_BKTE = (F.pad(x, (0, 0, 0, padded - T)) for x in (q_BHTE, k_BKTE, v_BKTE))
    kernel = _flex_kernel(q_BHTE.device.type != "cpu")
    out = kernel(q_BHTE, k_BKTE, v_BKTE, block_mask=mask.block_mask, scale=scale,
                 enable_gqa=q_BHTE.shape[1] != k_BKTE.shape[1], **_lse_request(return_lse))
    if return_lse:
        o_BHPE, aux = out
        lse_BHP = aux if torch.is_tensor(aux) else aux.lse
        return o_BHPE[:, :, :T], lse_BHP[:, :, :T]
    return out[:, :, :T]


def _lse_request(return_lse: bool) -> dict:
    """FlexAttention's keyword for the log-sum-exp: `return_aux=AuxRequest(lse=True)` where torch
    has it (2.9 on), else the older `return_lse=True`."""
    if not return_lse:
        return {}
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def build_cached_attention_mask(query_doc_ids_BT: torch.Tensor, query_position_ids_BT: torch.Tensor,
                                key_doc_ids_BS: torch.Tensor, key_position_ids_BS: torch.Tensor, query_start: int,
                                window: int | None = None, backend: str | None = None) -> AttentionMask:
    """The mask of `T` new tokens at slots `query_start..query_start+T-1` over the `S` slots of
    a KV cache (`posttrain.models.kv_cache`), the new ones included: query `t` may see slot `s`
    iff `s <= query_start + t`, both hold the same document, and with `window` their positions
    differ by less than `window`. For a contiguous document this is `document_causal_mask`'s
    rule, so a cached forward attends exactly as the uncached one does."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    T = query_doc_ids_BT.shape[1]
    backend = backend or ("decode" if T == 1 else "sdpa")
    if backend not in ("sdpa", "decode"):
        raise ValueError(f"unknown attention backend {backend!r} for a KV cache; available: ('sdpa', 'decode')")
    S = key_doc_ids_BS.shape[1]
    device = query_doc_ids_BT.device
    allowed_BTS = query_doc_ids_BT[:, :, None] == key_doc_ids_BS[:, None, :]
    if T > 1 or query_start + 1 < S:  # a single query at the last slot sees every slot: nothing to cut
        query_slot_T1 = torch.arange(query_start, query_start + T, device=device)[:, None]
        allowed_BTS &= torch.arange(S, device=device)[None, :] <= query_slot_T1
    if window is not None:
        allowed_BTS &= (query_position_ids_BT[:, :, None] - key_position_ids_BS[:, None, :]) < window
    return AttentionMask(backend, dense_B1TT=allowed_BTS[:, None], window=window)


def document_attention(
    q_BHTE: torch.Tensor,
    k_BKTE: torch.Tensor,
    v_BKTE: torch.Tensor,
    mask: AttentionMask,
    scale: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention under `mask`; returns `o_BHTE`.

    `H` must be a multiple of `K` (query head `h` reads key/value head `h // (H // K)`).
    `scale` defaults to `E ** -0.5`.
    """
    H, K = q_BHTE.shape[1], k_BKTE.shape[1]
    if H % K != 0:
        raise ValueError(f"query heads {H} not a multiple of key/value heads {K}")
    if mask.backend == "documents":
        return _run_per_document(q_BHTE, k_BKTE, v_BKTE, mask.doc_runs, scale)
    if mask.backend == "sdpa":
        return F.scaled_dot_product_attention(
            q_BHTE, k_BKTE, v_BKTE, attn_mask=mask.dense_B1TT, scale=scale, enable_gqa=H != K
        )
    if mask.backend == "decode":
        return _matmul_attention(q_BHTE, k_BKTE, v_BKTE, mask.dense_B1TT, scale)
    if mask.backend == "flex":
        return flex_document_attention(q_BHTE, k_BKTE, v_BKTE, mask, scale)
    raise ValueError(f"unknown attention backend {mask.backend!r}; available: {BACKENDS}")


def _per_document_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                            doc_runs: list[list[int]], scale: float | None) -> torch.Tensor:
    """Causal attention within each run of `doc_runs` (row by row, the runs tile the row): one
    SDPA call per document, the outputs concatenated in row order.

    Grouped-query keys and values are expanded to the query heads first: the CPU kernel's
    backward with `enable_gqa` on one row sums a key head's gradient over its query heads in
    an order that depends on the thread count (measured: 1e-12 apart between 1 and 2 threads),
    which would break bitwise resume across processes; the expansion's backward sums them in
    a fixed order."""
    groups = q_BHTE.shape[1] // k_BKTE.shape[1]
    if groups > 1:
        k_BKTE, v_BKTE = k_BKTE.repeat_interleave(groups, dim=1), v_BKTE.repeat_interleave(groups, dim=1)
    # split, not slice: a slice's backward zero-fills a gradient of the whole input per document
    rows = []
    for lengths, q_1HTE, k_1HTE, v_1HTE in zip(doc_runs, q_BHTE.split(1), k_BKTE.split(1), v_BKTE.split(1)):
        parts = [F.scaled_dot_product_attention(q_1HLE, k_1HLE, v_1HLE, is_causal=True, scale=scale)
                 for q_1HLE, k_1HLE, v_1HLE in zip(q_1HTE.split(lengths, dim=2), k_1HTE.split(lengths, dim=2),
                                                   v_1HTE.split(lengths, dim=2))]
        rows.append(torch.cat(parts, dim=2) if len(parts) != 1 else parts[0])
    return torch.cat(rows, dim=0) if len(rows) != 1 else rows[0]


_run_per_document = _per_document_attention


def keep_per_document_loop_out_of_compiled_graphs() -> None:
    """Compiled model blocks then call the per-document loop eagerly (a graph break) instead of
    tracing it: its lengths change with every batch, and a traced loop would recompile for each.
    The trainer calls this before compiling; not done at import, since `torch.compiler.disable`
    imports torch._dynamo (1.5 s in every process that imports the models)."""
    global _run_per_document
    _run_per_document = torch.compiler.disable(_per_document_attention)


def _matmul_attention(q_BHTE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                      allowed_B1TS: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Grouped-query attention as `softmax(q k^T * scale) v` with explicit matmuls, the softmax in
    float32. The `G` query heads of a key/value head are folded into its query rows (`M = G*T`),
    so each matmul is one batch over `B*K` without expanding (copying) k and v."""
    B, H, T, E = q_BHTE.shape
    K, S = k_BKSE.shape[1], k_BKSE.shape[2]
    G = H // K
    scale = E**-0.5 if scale is None else scale
    q_BKME = q_BHTE.reshape(B, K, G * T, E)
    scores_BKMS = (q_BKME @ k_BKSE.transpose(-1, -2)) * scale
    allowed_B1MS = allowed_B1TS.repeat(1, 1, G, 1) if G > 1 else allowed_B1TS
    scores_BKMS = scores_BKMS.float().masked_fill(~allowed_B1MS, float("-inf"))
    probs_BKMS = scores_BKMS.softmax(dim=-1).to(v_BKSE.dtype)
    return (probs_BKMS @ v_BKSE).reshape(B, H, T, E)


def shared_prefix_attention(q_BHTE: torch.Tensor, prefix_k_PKSE: torch.Tensor, prefix_v_PKSE: torch.Tensor,
                            k_BKUE: torch.Tensor, v_BKUE: torch.Tensor, allowed_B1TS: torch.Tensor,
                            scale: float | None = None, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step (`T == 1`) of rows that share a prefix: rows `p*n .. p*n+n-1` all continue
    prefix `p` (`[P, K, S_p, E]` keys and values, stored once), each with its own later keys
    `[B, K, U, E]`; `allowed_B1TS` covers the `S_p + U` slots. One softmax over both parts
    (with a GPT-OSS sink logit per query head when `sinks_H` is given), in float32.

    The prefix is read once per prefix, not once per row: the `n` rows' query heads of a
    key/value head form one `[n*G, E] @ [E, S_p]` matmul, so the `n` samples of a prompt pay
    for its keys once (the KV cache read is what a CPU decode step waits on)."""
    B, H, T, E = q_BHTE.shape
    P, K, Sp, _ = prefix_k_PKSE.shape
    if T != 1 or B % P:
        raise ValueError(f"shared-prefix attention takes one query per row and whole groups; got T={T}, B={B}, P={P}")
    n, G = B // P, H // K
    scale = E**-0.5 if scale is None else scale
    q_PKME = q_BHTE.reshape(P, n, K, G, E).transpose(1, 2).reshape(P, K, n * G, E)
    prefix_PKMS = q_PKME @ prefix_k_PKSE.transpose(-1, -2)
    prefix_BKGS = prefix_PKMS.view(P, K, n, G, Sp).transpose(1, 2).reshape(B, K, G, Sp)
    own_BKGU = q_BHTE.reshape(B, K, G, E) @ k_BKUE.transpose(-1, -2)
    scores_BKGS = (torch.cat([prefix_BKGS, own_BKGU], dim=-1) * scale).float()
    scores_BKGS = scores_BKGS.masked_fill(~allowed_B1TS.view(B, 1, 1, -1), float("-inf"))
    S = scores_BKGS.shape[-1]
    if sinks_H is not None:
        sink_BKG1 = sinks_H.float().view(1, K, G, 1).expand(B, K, G, 1)
        scores_BKGS = torch.cat([scores_BKGS, sink_BKG1], dim=-1)
    probs_BKGS = scores_BKGS.softmax(dim=-1)[..., :S].to(v_BKUE.dtype)
    probs_PKMS = probs_BKGS[..., :Sp].reshape(P, n, K, G, Sp).transpose(1, 2).reshape(P, K, n * G, Sp)
    from_prefix_BKGE = (probs_PKMS @ prefix_v_PKSE).view(P, K, n, G, E).transpose(1, 2).reshape(B, K, G, E)
    o_BKGE = from_prefix_BKGE + probs_BKGS[..., Sp:] @ v_BKUE
    return o_BKGE.reshape(B, H, T, E)
