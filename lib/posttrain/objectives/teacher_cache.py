"""The offline teacher cache: a teacher's top-k per loss position, stored once, trained against later.

    cache_dir = build_teacher_cache(teacher, samples, directory, top_k=64, temperature=2.0, vocab_size=V,
                                    row_length=512, pad_id=0, identity=teacher_identity)
    cache = TeacherCache.load(cache_dir, top_k=64, temperature=2.0, vocab_size=V, identity=teacher_identity)
    ids_MK, logp_MK = cache.lookup(batch)       # for the batch's positions with a label, in order

What is stored, per training sample: the sample's tokens as a training row holds them (cut
to `row_length`, as `pack.on_overflow: truncate` cuts them) are its key (a 16-byte BLAKE2b
digest), and for each of its loss positions (a label, in order) the teacher's `top_k` token
ids and their log-probabilities at `temperature`, over the whole vocabulary
(`posttrain.ops.kd.chunked_topk_logprobs`). The student's stream packs the same samples
into other rows in another order; `lookup` finds every document of a batch by its tokens, so
the cache does not depend on the packing, the mixture's order or the number of workers, and
a document the cache does not hold (other data, other row length) is an error naming it.
How the tail beyond the top-k enters the loss: `posttrain.ops.kd` (one explicit bucket).

On disk (`directory`): `manifest.json` (format version, the teacher's identity, `top_k`,
`temperature`, `vocab_size`, `row_length`, counts, bytes, shard names) and shards
`shard_00000.safetensors`, ... of `shard_samples` samples each, holding `keys` (uint8 `[S,
16]`), `offsets` (int64 `[S + 1]`: sample `s` owns positions `offsets[s]:offsets[s + 1]`),
`ids` (int32 `[M, K]`) and `logp` (float32 `[M, K]`). Safetensors only: nothing is unpickled
when a cache made elsewhere is loaded. The manifest is written last, after every shard, so a
directory without one is an unfinished cache (rebuilt). Size: `8 K` bytes per loss position
(K = 64: 512 bytes), plus 24 bytes per sample.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from posttrain.ops.kd import chunked_topk_logprobs
from posttrain.ops.losses import IGNORE_INDEX

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KEY_BYTES = 16


class TeacherCacheError(ValueError):
    """A teacher cache that does not match the recipe, or a batch it does not cover."""


def document_key(tokens: np.ndarray) -> bytes:
    """The cache key of a document: a digest of its token ids (as int64)."""
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64).tobytes(), digest_size=KEY_BYTES).digest()


def _documents(input_ids_BT: np.ndarray, doc_ids_BT: np.ndarray, labels_BT: np.ndarray):
    """`(key, loss positions [n] as flat indices into the batch)` of every document, row by row,
    in position order (so their positions, concatenated, are the batch's labelled positions in
    row-major order)."""
    B, T = input_ids_BT.shape
    for r in range(B):
        docs = doc_ids_BT[r]
        real = np.flatnonzero(docs >= 0)
        if not len(real):
            continue
        cuts = np.flatnonzero(np.diff(docs[real])) + 1
        for span in np.split(real, cuts):
            labelled = span[labels_BT[r, span] != IGNORE_INDEX]
            yield document_key(input_ids_BT[r, span]), r * T + labelled


class TeacherCache:
    """A loaded cache (module docstring): every shard in memory, a key -> positions index."""

    def __init__(self, directory: Path, manifest: dict, ids_MK: torch.Tensor, logp_MK: torch.Tensor,
                 index: dict[bytes, tuple[int, int]]):
        self.directory, self.manifest = directory, manifest
        self.ids_MK, self.logp_MK, self.index = ids_MK, logp_MK, index

    @classmethod
    def load(cls, directory: str | os.PathLike, *, top_k: int, temperature: float, vocab_size: int,
             identity: dict | None = None) -> "TeacherCache":
        """Read the cache at `directory`, refusing (`TeacherCacheError`, naming the setting) one
        made with another `top_k`, `temperature`, vocabulary or teacher."""
        directory = Path(directory)
        manifest = read_manifest(directory)
        if manifest is None:
            raise TeacherCacheError(f"{directory} holds no finished teacher cache (no {MANIFEST})")
        check_manifest(manifest, directory, top_k=top_k, temperature=temperature, vocab_size=vocab_size,
                       identity=identity)
        ids, logp, index, base = [], [], {}, 0
        for name in manifest["shards"]:
            shard = load_file(str(directory / name))
            keys, offsets = shard["keys"].numpy(), shard["offsets"].numpy()
            for s in range(keys.shape[0]):
                index[keys[s].tobytes()] = (base + int(offsets[s]), base + int(offsets[s + 1]))
            ids.append(shard["ids"])
            logp.append(shard["logp"])
            base += int(offsets[-1])
        k = manifest["top_k"]
        ids_MK = torch.cat(ids) if ids else torch.empty((0, k), dtype=torch.int32)
        logp_MK = torch.cat(logp) if logp else torch.empty((0, k))
        return cls(directory, manifest, ids_MK, logp_MK, index)

    def lookup(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k ids (int64) and log-probabilities (float32), `[M, K]` on the
        batch's device, for the batch's positions with a label (`labels != -100`), in row-major
        order; `TeacherCacheError` for a document the cache does not hold."""
        labels = batch["labels"]
        input_ids, doc_ids = batch["input_ids"].cpu().numpy(), batch["doc_ids"].cpu().numpy()
        labels_np = labels.cpu().numpy()
        rows = []
        for key, positions in _documents(input_ids, doc_ids, labels_np):
            if len(positions) == 0:
                continue
            found = self.index.get(key)
            if found is None or found[1] - found[0] != len(positions):
                raise TeacherCacheError(
                    f"the teacher cache at {self.directory} does not hold a document of this batch "
                    f"({len(positions)} loss positions, key {key.hex()}): it was built for other samples or "
                    "another row length; rebuild it (delete the directory) for this recipe's data")
            rows.append(torch.arange(found[0], found[1]))
        picked = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        device = labels.device
        return self.ids_MK[picked].to(device=device, dtype=torch.long), self.logp_MK[picked].to(device)


def read_manifest(directory: Path) -> dict | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise TeacherCacheError(f"{path} is not a readable teacher cache manifest: {err}") from None


def check_manifest(manifest: dict, directory: Path, *, top_k: int, temperature: float, vocab_size: int,
                   identity: dict | None) -> None:
    if manifest.get("format_version") != FORMAT_VERSION:
        raise TeacherCacheError(f"{directory}: teacher cache format {manifest.get('format_version')}, "
                                f"this version reads {FORMAT_VERSION}")
    wanted = {"top_k": top_k, "temperature": float(temperature), "vocab_size": vocab_size}
    for key, value in wanted.items():
        if manifest.get(key) != value:
            raise TeacherCacheError(f"the teacher cache at {directory} was made with {key} {manifest.get(key)}, "
                                    f"the recipe asks for {value} (distill.cache / distill.temperature); use "
                                    "another directory or delete it to rebuild")
    if identity is not None and manifest.get("teacher", {}).get("sha256") != identity.get("sha256"):
        raise TeacherCacheError(f"the teacher cache at {directory} was made by teacher "
                                f"{manifest.get('teacher', {}).get('reference')} "
                                f"(sha256 {str(manifest.get('teacher', {}).get('sha256'))[:12]}), not by "
                                f"{identity.get('reference')} (sha256 {str(identity.get('sha256'))[:12]})")


@torch.no_grad()
def build_teacher_cache(teacher: torch.nn.Module, samples: Iterable, directory: str | os.PathLike, *, top_k: int,
                        temperature: float, vocab_size: int, row_length: int, pad_id: int,
                        identity: dict | None = None, rows_per_batch: int = 8, window: int = 256,
                        shard_samples: int = 4096, progress=None) -> dict:
    """Run `teacher` (frozen, in eval mode) once over `samples` (`TokenizedSample`s; repeats
    are stored once) packed into rows of `row_length`, and write the cache to `directory`
    (replaced if present). Returns the manifest. `progress(done, total)` is called per batch."""
    from posttrain.data.packer import pack_samples

    directory = Path(directory)
    started = time.perf_counter()
    unique, seen = [], set()
    for sample in samples:
        key = document_key(np.asarray(sample.input_ids[:row_length]))
        if key not in seen:
            seen.add(key)
            unique.append(sample)
    rows, _ = pack_samples(unique, row_length, pad_id, window=window, on_overflow="truncate")
    teacher.eval()
    device = next(teacher.parameters()).device
    softcap = getattr(teacher, "logit_softcap", None)
    staging = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    entries: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
    for start in range(0, rows.num_rows, rows_per_batch):
        sl = slice(start, start + rows_per_batch)
        batch = {name: torch.as_tensor(getattr(rows, name)[sl]) for name in ("input_ids", "labels", "position_ids",
                                                                              "doc_ids")}
        hidden_BTD = teacher(*(batch[k].to(device) for k in ("input_ids", "position_ids", "doc_ids")))
        flat_ND = hidden_BTD.reshape(-1, hidden_BTD.shape[-1])
        for key, positions in _documents(batch["input_ids"].numpy(), batch["doc_ids"].numpy(),
                                         batch["labels"].numpy()):
            if len(positions) == 0:
                continue
            ids, logp = chunked_topk_logprobs(flat_ND[torch.as_tensor(positions, device=device)],
                                              teacher.output_weight, vocab_size, top_k, temperature, softcap)
            entries[key] = (ids.to(torch.int32).cpu(), logp.cpu())
        if progress is not None:
            progress(min(start + rows_per_batch, rows.num_rows), rows.num_rows)
    keys = list(entries)
    shards, total_bytes, positions_total = [], 0, 0
    for i, first in enumerate(range(0, max(len(keys), 1), shard_samples)):
        part = keys[first:first + shard_samples]
        lengths = [entries[k][0].shape[0] for k in part]
        tensors = {
            "keys": torch.tensor(np.frombuffer(b"".join(part), dtype=np.uint8).reshape(len(part), KEY_BYTES).copy()
                                 if part else np.zeros((0, KEY_BYTES), dtype=np.uint8)),
            "offsets": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)),
            "ids": torch.cat([entries[k][0] for k in part]) if part else torch.empty((0, top_k), dtype=torch.int32),
            "logp": torch.cat([entries[k][1] for k in part]) if part else torch.empty((0, top_k)),
        }
        name = f"shard_{i:05d}.safetensors"
        save_file(tensors, str(staging / name))
        shards.append(name)
        total_bytes += (staging / name).stat().st_size
        positions_total += sum(lengths)
    manifest = {"format_version": FORMAT_VERSION, "teacher": identity or {}, "top_k": top_k,
                "temperature": float(temperature), "vocab_size": vocab_size, "row_length": row_length,
                "num_samples": len(keys), "num_positions": positions_total, "bytes": total_bytes,
                "bytes_per_position": round(total_bytes / max(positions_total, 1), 1),
                "seconds": round(time.perf_counter() - started, 2), "shards": shards}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")  # last: the cache is whole
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    return manifest
