"""Teacher: everything about a distillation recipe's teacher that must hold before training.

`run(config, tokenizer, samples, run_dir)`:
1. resolves `distill.teacher` (a registry entry, a model directory, or a hub id downloaded
   once) to a local model directory;
2. checks that it shares the student's token ids (`check_shared_vocabulary`: identical
   tokenizers, or a teacher output padded beyond the same tokens), naming the first
   differing token otherwise;
3. verifies it (`distill.verify_teacher`, native backend): our model and transformers must
   give the same logits on its checkpoint, as the verify step checks every export;
4. records its identity (`teacher_identity`: the SHA-256 of its config and weight files),
   which goes into the training checkpoints' fingerprint, so a resume with another teacher
   is refused by name;
5. with `distill.cache`, runs it once over the training samples and stores its top-k per loss
   position (`posttrain.objectives.teacher_cache`), or reuses a cache of the same teacher,
   top-k and temperature already in the directory.
Any failure raises `TeacherError` saying what to fix, before the train step starts.
`load_teacher(spec, device)` is how the train step (every worker) loads it.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.config.schema import DistillConfig

if TYPE_CHECKING:  # the plan and evaluation steps unpickle `TeacherSpec` without loading torch
    import torch


class TeacherError(ValueError):
    """The recipe's teacher cannot be used; the message says what to fix."""


@dataclass
class TeacherSpec:
    """What the train step needs to rebuild the teacher on any worker (picklable)."""

    model_dir: str
    backend: str  # "native" or "transformers"
    vocab_size: int  # the shared vocabulary
    identity: dict  # reference, directory, sha256, bytes
    cache_dir: str | None = None  # the top-k cache to train against (distill.cache), else None
    verdict: dict | None = None
    cache_manifest: dict | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TeacherSettings:
    """Where a recipe names its teacher: `key` (for messages), `reference`, `backend`, `verify`."""

    key: str
    reference: str
    backend: str
    verify: bool


def teacher_settings(config) -> TeacherSettings:
    """The teacher of a distillation recipe (`distill.*`) or of on-policy distillation in an RL
    recipe (`grpo.teacher`, `grpo.teacher_backend`, `grpo.verify_teacher`)."""
    section = config.own_section
    return TeacherSettings(f"{config.section}.teacher", section.teacher, section.teacher_backend,
                           section.verify_teacher)


def resolve_teacher(config) -> Path:
    """The teacher's local model directory (module docstring, 1)."""
    from posttrain.config.paths import names_hub_model
    from posttrain.registry import resolve_model_dir

    settings = teacher_settings(config)
    ref = settings.reference
    if not names_hub_model(ref):
        try:
            return Path(resolve_model_dir(ref, registry_dir=config.register.registry_dir))
        except ValueError as err:
            raise TeacherError(f"{settings.key}: {err}") from None
    from posttrain.recipes.start import resolve_pretrained

    try:
        return resolve_pretrained(ref)
    except Exception as err:  # the hub is unreachable, or no such repository
        raise TeacherError(f"{settings.key}: cannot download {ref!r} from the Hugging Face Hub ({err}); "
                           "give a local model directory or a registry entry") from None


def teacher_identity(model_dir: Path, reference: str) -> dict:
    """`{"reference", "directory", "sha256", "bytes"}`: a digest of config.json and every
    weight file (names and contents, in name order) of the teacher."""
    digest, size = hashlib.sha256(), 0
    files = sorted(p for p in Path(model_dir).iterdir()
                   if p.name == "config.json" or p.suffix == ".safetensors" or p.name.endswith(".index.json"))
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
                size += len(chunk)
    return {"reference": reference, "directory": str(model_dir), "sha256": digest.hexdigest(), "bytes": size}


def load_teacher(spec: TeacherSpec, device: torch.device | str) -> torch.nn.Module:
    """The teacher model on `device`, frozen (eval mode, no gradients)."""
    from posttrain.objectives.distill import freeze_teacher

    if spec.backend == "transformers":
        from posttrain.models.hf_backend import load_hf_backend

        model = load_hf_backend(spec.model_dir, device=device)
    else:
        from posttrain.models.architectures import load_hf_checkpoint

        model = load_hf_checkpoint(spec.model_dir, device=device)
    return freeze_teacher(model.to(device))


def _model_vocab(model_dir: Path) -> int:
    from posttrain.models.safetensors_io import read_json

    config = read_json(Path(model_dir) / "config.json")
    text = config.get("text_config") or {}
    return int(config.get("vocab_size") or text.get("vocab_size") or 0)


def check_vocabulary(config, tokenizer, teacher_dir: Path, student_vocab: int) -> int:
    """The shared vocabulary size (module docstring, 2), or `TeacherError`."""
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.objectives.distill import VocabularyMismatch, check_shared_vocabulary

    settings = teacher_settings(config)
    try:
        teacher_tokenizer = load_tokenizer(str(teacher_dir))
    except Exception as err:
        raise TeacherError(f"{settings.key} {settings.reference}: no usable tokenizer in {teacher_dir} ({err}); "
                           "the teacher's directory must hold its tokenizer files to check the token ids") from None
    try:
        return check_shared_vocabulary(tokenizer, teacher_tokenizer, student_vocab, _model_vocab(teacher_dir))
    except VocabularyMismatch as err:
        raise TeacherError(f"{settings.key} {settings.reference}: {err}") from None


def student_vocab_size(config, tokenizer) -> int:
    """The rows of the student's output: its starting model's vocabulary, or the tokenizer's
    size for a random init (`posttrain.recipes.start.model_config_for`)."""
    from posttrain.recipes.start import trained_start_dir

    start = trained_start_dir(config)
    return _model_vocab(start) if start is not None else len(tokenizer)


def run(config, tokenizer, samples: dict[str, list] | None, run_dir) -> TeacherSpec:
    """Steps 1-5 of the module docstring (a distillation recipe's teacher, or an RL recipe's
    `grpo.teacher`: steps 1-4); returns the `TeacherSpec` its training reads."""
    from posttrain.parallel.mesh import pick_device
    from posttrain.steps import verify

    started = time.perf_counter()
    settings = teacher_settings(config)
    teacher_dir = resolve_teacher(config)
    vocab = check_vocabulary(config, tokenizer, teacher_dir, student_vocab_size(config, tokenizer))
    print(f"[teacher] {settings.reference} -> {teacher_dir}: shares the student's {vocab} token ids")
    verdict = None
    if settings.verify and settings.backend == "native":
        try:
            verdict = verify.run(str(teacher_dir), config.verify, device=pick_device(config.train.device))
        except verify.VerificationError as err:
            raise TeacherError(f"{settings.key} {settings.reference} fails the logit verifier: {err}. Fix or re-export "
                               f"the checkpoint, or run it through transformers' own code ({settings.key}_backend: "
                               "transformers)") from None
    identity = teacher_identity(teacher_dir, settings.reference)
    print(f"[teacher] identity sha256 {identity['sha256'][:16]}... ({identity['bytes'] / 1e6:.1f} MB of weights)")
    spec = TeacherSpec(str(teacher_dir), settings.backend, vocab, identity, verdict=verdict)
    if getattr(config.own_section, "cache", None) is not None:  # a distillation recipe's stored top-k
        spec.cache_dir, spec.cache_manifest = _cache(config, spec, samples, Path(run_dir), tokenizer.pad_token_id)
    spec.seconds = time.perf_counter() - started
    return spec


def _cache(config: DistillConfig, spec: TeacherSpec, samples: dict[str, list], run_dir: Path, pad_id: int):
    """The top-k cache's directory and manifest: reused when it matches, else built."""
    from posttrain.objectives.teacher_cache import (TeacherCacheError, build_teacher_cache, check_manifest,
                                                    read_manifest)
    from tqdm import tqdm

    from posttrain.parallel.mesh import pick_device

    cache, distill = config.distill.cache, config.distill
    directory = Path(cache.directory).expanduser().resolve() if cache.directory else run_dir / "teacher_cache"
    manifest = read_manifest(directory)
    if manifest is not None:
        try:
            check_manifest(manifest, directory, top_k=cache.top_k, temperature=distill.temperature,
                           vocab_size=spec.vocab_size, identity=spec.identity)
            if manifest.get("row_length") == config.pack.row_length:
                print(f"[teacher] reusing the top-{cache.top_k} cache at {directory} "
                      f"({manifest['num_positions']} positions, {manifest['bytes'] / 1e6:.1f} MB)")
                return str(directory), manifest
        except TeacherCacheError as err:
            print(f"[teacher] rebuilding the cache at {directory}: {err}")
    teacher = load_teacher(spec, pick_device(config.train.device))
    every = [s for group in samples.values() for s in group]
    with tqdm(desc="[teacher cache]", unit="row", mininterval=2.0) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        manifest = build_teacher_cache(
            teacher, every, directory, top_k=cache.top_k, temperature=distill.temperature,
            vocab_size=spec.vocab_size, row_length=config.pack.row_length, pad_id=pad_id, identity=spec.identity,
            rows_per_batch=config.train.micro_batch_size, window=config.pack.window,
            shard_samples=cache.shard_samples, progress=progress)
    print(f"[teacher] top-{cache.top_k} cache of {manifest['num_samples']} samples, {manifest['num_positions']} loss "
          f"positions: {manifest['bytes'] / 1e6:.1f} MB at {directory} in {manifest['seconds']:.1f}s")
    return str(directory), manifest
