"""Data pipeline benchmark (issue 34): chats in, packed training rows out, posttrain's data
steps against TRL's own preparation (`SFTTrainer._prepare_dataset`), side by side.

    python bench/data_pipeline.py [--sizes 200000,1000000] [--row-length 2048] [--num-proc N]
                                  [--repeats 1] [--sides trl,posttrain] [--work-dir DIR]
                                  [--tokenizer DIR] [--keep-runs]

Progress (one human-readable line per run) goes to stderr; the LAST stdout line is one JSON
object:

    {"benchmark": "data_pipeline", "baseline": "TRL <version> datasets.map(num_proc) + pack_dataset(bfd)",
     "row_length", "num_proc", "repeats", "sides",
     "sizes": {"<N>": {"rows", "data_bytes",
                        "<side>": {"rows_per_s": {"min", "median", "max", "n"}, "rows_per_s_in_process",
                                   "wall_s", "peak_rss_bytes", "peak_pss_bytes", "bytes_written_per_row",
                                   "packing_efficiency", "rows_packed", "real_tokens", "loss_tokens",
                                   "seconds": {stage: median}, "failed", ...},
                        "ratio_rows_per_s": {"min", "median", "max", "n"}},   # posttrain / TRL, per pass
               ...},
     "failed": [...], "settings": {machine, commit, ...}, "seconds"}

The process exits with status 1 (after the JSON line) when any run failed.

Data. `make_chats(N)` writes N chats as JSON Lines (`{"messages": [{"role", "content"}, ...]}`)
from the real public data in ../shared/data, read in place (nothing is copied into the repo):
even rows are the 564 OASST conversations (2, 4 or 6 turns), odd rows the 7,473 GSM8K train
problems as one user / one assistant turn; each source is cycled in a fresh seeded order per
pass over it. The first user turn of row i ends with " [id i]", so every row is distinct (exact
de-duplication keeps all N). Deterministic, streamed (never N rows in memory) and cached as
`<work-dir>/data/chats-v1-<N>.jsonl`: a repeat does not regenerate it.

Sides. Each run is a fresh interpreter (`python bench/data_pipeline.py --side <side> ...`)
under `measure`: wall seconds of the whole subprocess (interpreter start and imports included)
and the peak, over a 0.2 s poll, of the RSS of the process plus all its descendants, summed
(forked workers' copy-on-write and file-backed pages count once per process, so this
overstates; `peak_pss_bytes`, the same poll summing PSS, does not). Each run gets its own
empty directory (`HF_DATASETS_CACHE`, `HF_HOME` and `TMPDIR` inside it), so no cache from an
earlier run makes a repeat free; `bytes_written` is what that directory holds at the end. The
child prints one JSON stats line: stage seconds, rows packed, real tokens, packing efficiency
(real tokens / (rows x row_length)), bytes written. Repeats rotate the sides' order.

- `trl` (the baseline, what `SFTTrainer(train_dataset=..., args=SFTConfig(packing=True,
  packing_strategy="bfd", max_length=L, assistant_only_loss=True, dataset_num_proc=P))` does
  to a conversational dataset before training): `datasets.load_dataset("json")`, then TRL's
  own `SFTTrainer._prepare_dataset`, called unbound on a stand-in for the trainer holding the
  three attributes it reads (`chat_template`, `completion_only_loss`, `_tokenizer`), so TRL's
  code runs unchanged: (1) `Dataset.map(tokenize_fn, num_proc=P)`, not batched: per chat
  `trl.data_utils._tokenize` -> `tokenizer.apply_chat_template(messages, tokenize=True,
  return_dict=True, chat_template=<training template>, tools=None,
  return_assistant_tokens_mask=True)`, giving `input_ids` and `assistant_masks`; (2)
  `Dataset.map(build_labels, num_proc=P)`: `labels` = ids outside the assistant mask set to
  -100; (3) `select_columns(["input_ids", "labels"])` and `trl.data_utils.pack_dataset(dataset,
  L, "bfd", map_kwargs)`, a batched `Dataset.map(_pack_bfd, num_proc=P)` at datasets' default
  `batch_size` of 1,000: best-fit decreasing over each 1,000 consecutive chats, not the whole
  dataset (over-long chats are truncated, `tokens_dropped`). Stage seconds come from timing
  each outermost `Dataset.map` by its `desc`.
  The chat template, as `SFTTrainer.__init__` picks it: with `assistant_only_loss=True` and a
  template without `{% generation %}` markers (Qwen3's has none) it swaps in
  `trl.chat_template_utils.get_training_chat_template(tokenizer)`, which knows templates only
  by exact text. The Qwen3 tokenizer in ../shared/data carries an earlier revision of the
  Qwen3 template than the one TRL 1.16 recognises (it differs in how non-string content is
  guarded), so that call raises ValueError there and `SFTTrainer` would refuse to start. This
  side then uses TRL's own Qwen3 training template (`qwen3_training_chat_template`, what TRL
  swaps in for the current Qwen3 template) and records the fact in `chat_template`. That
  template wraps each assistant turn's `<think>\\n\\n</think>\\n\\n` + content + `<|im_end|>\\n`
  in `{% generation %}` (all trained) and renders the empty think block in every assistant
  turn (the original only in turns after the last user message): on multi-turn chats it gives
  4 more tokens per earlier assistant turn than the tokenizer's own template.
  `load_dataset` runs in one process (one JSON file; its `num_proc` splits by file).
- `posttrain`: `run_posttrain` (posttrain's ingest -> tokenize -> pack over the same file,
  tokenizer, row length and worker count).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, spread  # noqa: E402  (bench/common.py)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
OASST = SHARED_DATA / "sft" / "oasst_en_100_conversations.jsonl"
GSM8K = SHARED_DATA / "gsm8k" / "train.jsonl"
QWEN3_TOKENIZER = SHARED_DATA / "tokenizers" / "qwen3"
DATA_VERSION = "v1"  # part of the cached file's name: bump it when make_chats changes what it writes
SIDES = ("trl", "posttrain")
POLL_S = 0.2


def log(message: str) -> None:
    print(f"[data_pipeline] {message}", file=sys.stderr, flush=True)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (what a run left on disk)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# ---------------------------------------------------------------------------- data


def _source_chats() -> tuple[list[list[dict]], list[list[dict]]]:
    """The OASST conversations and the GSM8K train problems as chats (the ~8k base rows)."""
    for path in (OASST, GSM8K):
        if not path.exists():
            raise SystemExit(f"{path} is absent: the chats are made from ../shared/data (see its SOURCES.md)")
    oasst = []
    with OASST.open(encoding="utf-8") as f:
        for line in f:
            oasst.append([{"role": m["role"], "content": m["content"]} for m in json.loads(line)["messages"]])
    gsm8k = []
    with GSM8K.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            gsm8k.append([{"role": "user", "content": row["question"]},
                          {"role": "assistant", "content": row["answer"]}])
    return oasst, gsm8k


def make_chats(n: int, out_path: str | Path) -> Path:
    """Write `n` distinct chats to `out_path` (JSON Lines, `{"messages": [...]}`), streamed;
    an existing `out_path` is taken as is (the name carries `n` and DATA_VERSION). Row i is
    OASST (i even) or GSM8K (i odd), each source cycled in a seeded order per pass, and the
    first user turn ends with " [id i]"."""
    out_path = Path(out_path)
    if out_path.exists():
        return out_path
    out_path.parent.mkdir(parents=True, exist_ok=True)
    pools = _source_chats()
    orders: list[tuple[int, list[int]]] = [(-1, []), (-1, [])]  # per source: (pass, order of that pass)
    tmp = out_path.with_name(out_path.name + f".tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for i in range(n):
            source = i % 2
            pool = pools[source]
            epoch, pos = divmod(i // 2, len(pool))
            if orders[source][0] != epoch:
                order = list(range(len(pool)))
                random.Random(1_000_003 * source + epoch).shuffle(order)
                orders[source] = (epoch, order)
            messages = [dict(m) for m in pool[orders[source][1][pos]]]
            messages[0]["content"] = f"{messages[0]['content']} [id {i}]"
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    os.replace(tmp, out_path)
    return out_path


# ---------------------------------------------------------------------------- measurement


def _tree_memory(proc) -> tuple[int, int]:
    """(RSS, PSS) of `proc` plus all its descendants, summed; processes gone meanwhile count 0."""
    import psutil

    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    rss = pss = 0
    for p in procs:
        try:
            info = p.memory_full_info()
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        except psutil.AccessDenied:
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        except psutil.Error:
            pass
    return rss, pss


def measure(cmd_argv: list[str], env: dict, log_dir: str | Path | None = None, poll_s: float = POLL_S) -> dict:
    """Run `cmd_argv` under `env`; its wall seconds, exit code, and the peak (polled every
    `poll_s`) of the RSS summed over it and its descendants (`peak_rss_bytes`), the same for PSS
    (`peak_pss_bytes`). Its stdout and stderr go to files in `log_dir` (a temporary directory
    when None) and come back as `stdout` and `stderr_tail`."""
    import psutil

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="data-pipeline-log-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / "stdout.txt", log_dir / "stderr.txt"
    peak_rss = peak_pss = 0
    with out_path.open("wb") as out, err_path.open("wb") as err:
        start = time.perf_counter()
        child = subprocess.Popen(cmd_argv, env=env, stdout=out, stderr=err)
        proc = psutil.Process(child.pid)
        while child.poll() is None:
            rss, pss = _tree_memory(proc)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            try:
                child.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
        wall = time.perf_counter() - start
    stderr = err_path.read_text(errors="replace")
    return {"wall_s": wall, "returncode": child.returncode, "peak_rss_bytes": peak_rss, "peak_pss_bytes": peak_pss,
            "stdout": out_path.read_text(errors="replace"), "stderr_tail": stderr[-4000:], "log_dir": str(log_dir)}


def _child_stats(stdout: str) -> dict | None:
    """The JSON stats line a side's subprocess printed last."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _run_side(side: str, jsonl, tokenizer_dir, row_length: int, num_proc: int, work_dir) -> dict:
    """One side in a fresh interpreter with its own empty caches under `work_dir`: `measure`'s
    figures plus the child's stats (`stats`, None when it printed none)."""
    work_dir = Path(work_dir)
    if work_dir.exists():
        shutil.rmtree(work_dir)
    run_dir = work_dir / "run"  # everything the child writes; its logs go beside, uncounted
    (run_dir / "tmp").mkdir(parents=True)
    env = dict(os.environ)
    env.update({
        "HF_DATASETS_CACHE": str(run_dir / "hf_datasets_cache"),
        "HF_HOME": str(run_dir / "hf_home"),
        "TMPDIR": str(run_dir / "tmp"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    })
    argv = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--data", str(jsonl),
            "--tokenizer", str(tokenizer_dir), "--row-length", str(row_length), "--num-proc", str(num_proc),
            "--work-dir", str(run_dir)]
    result = measure(argv, env, log_dir=work_dir / "logs")
    result["stats"] = _child_stats(result.pop("stdout"))
    return result


def trl_side(jsonl, tokenizer_dir, row_length: int, num_proc: int, work_dir) -> dict:
    """TRL's preparation (`run_trl`) in a fresh interpreter, measured (see `_run_side`)."""
    return _run_side("trl", jsonl, tokenizer_dir, row_length, num_proc, work_dir)


def posttrain_side(jsonl, tokenizer_dir, row_length: int, num_proc: int, work_dir) -> dict:
    """posttrain's data steps (`run_posttrain`) in a fresh interpreter, measured (see `_run_side`)."""
    return _run_side("posttrain", jsonl, tokenizer_dir, row_length, num_proc, work_dir)


SIDE_RUNNERS = {"trl": trl_side, "posttrain": posttrain_side}


# ---------------------------------------------------------------------------- the sides (in the child)


def _trl_training_template(tokenizer) -> tuple[str | None, str]:
    """The chat template `SFTTrainer.__init__` uses with `assistant_only_loss=True`, and where it
    came from. TRL recognises templates by exact text; an unrecognised Qwen3 revision (the one in
    ../shared/data) gets TRL's own Qwen3 training template (module docstring)."""
    from trl.chat_template_utils import (get_training_chat_template, has_generation_markers,
                                         qwen3_training_chat_template)

    if has_generation_markers(tokenizer.chat_template):
        return None, "the tokenizer's own (it has {% generation %} markers)"
    try:
        return get_training_chat_template(tokenizer), "trl get_training_chat_template(tokenizer)"
    except ValueError as exc:
        if "<|im_start|>" in tokenizer.chat_template and "<think>" in tokenizer.chat_template:
            return qwen3_training_chat_template, (
                "trl qwen3_training_chat_template: get_training_chat_template raised on this tokenizer's "
                f"Qwen3 template revision ({str(exc)[:80]}...), so SFTTrainer itself would not start")
        raise


def run_trl(jsonl, tokenizer_dir, row_length: int, num_proc: int, work_dir) -> dict:
    """TRL's preparation of `jsonl` (module docstring); its stats."""
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    from types import SimpleNamespace

    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
    from transformers import AutoTokenizer
    from trl import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    seconds["import"], clock = time.perf_counter() - clock, time.perf_counter()
    cache = Path(datasets.config.HF_DATASETS_CACHE).resolve()
    if not cache.is_relative_to(Path(work_dir).resolve()):
        raise RuntimeError(f"HF_DATASETS_CACHE {cache} is outside the run's directory {work_dir}")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    chat_template, template_source = _trl_training_template(tokenizer)
    args = SFTConfig(output_dir=str(Path(work_dir) / "trainer_out"), max_length=row_length, packing=True,
                     packing_strategy="bfd", assistant_only_loss=True, dataset_num_proc=num_proc,
                     use_cpu=True, bf16=False, report_to=[])
    completion_only_loss = bool(args.completion_only_loss)  # None -> False for a "messages" dataset
    # the three attributes of the trainer `_prepare_dataset` reads, as `SFTTrainer.__init__` sets them
    trainer = SimpleNamespace(chat_template=chat_template, completion_only_loss=completion_only_loss,
                              _tokenizer=tokenizer)
    seconds["setup"], clock = time.perf_counter() - clock, time.perf_counter()

    dataset = datasets.load_dataset("json", data_files=str(jsonl), split="train")
    seconds["load"], clock = time.perf_counter() - clock, time.perf_counter()

    # time each outermost Dataset.map by its `desc` ("Tokenizing train dataset", ...)
    map_seconds: dict[str, float] = {}
    map_results: dict[str, object] = {}
    original_map, depth = datasets.Dataset.map, [0]

    def timed_map(self, *a, **kw):
        depth[0] += 1
        start = time.perf_counter()
        try:
            return_value = original_map(self, *a, **kw)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            desc = kw.get("desc") or "map"
            map_seconds[desc] = map_seconds.get(desc, 0.0) + time.perf_counter() - start
            map_results[desc] = return_value
        return return_value

    datasets.Dataset.map = timed_map
    try:
        packed = SFTTrainer._prepare_dataset(trainer, dataset, tokenizer, args, True, None, "train")
    finally:
        datasets.Dataset.map = original_map
    prepare = time.perf_counter() - clock
    stage_of = {"Tokenizing": "tokenize", "Building labels": "labels", "Packing": "pack"}
    for desc, s in map_seconds.items():
        stage = next((v for k, v in stage_of.items() if desc.startswith(k)), "other_maps")
        seconds[stage] = seconds.get(stage, 0.0) + s
    seconds["prepare_other"] = prepare - sum(map_seconds.values())  # checks, select_columns, formats

    def column_tokens(ds, column: str) -> tuple[int, pa.ChunkedArray]:
        col = ds.data.column(column)
        return int(pc.sum(pc.list_value_length(col)).as_py() or 0), col

    assert packed._indices is None, "packed dataset has an indices mapping (shuffled?)"
    real_tokens = column_tokens(packed, "input_ids")[0]
    labels = column_tokens(packed, "labels")[1]
    loss_tokens = int(pc.sum(pc.cast(pc.not_equal(pc.list_flatten(labels), -100), pa.int64())).as_py() or 0)
    labelled = next((v for k, v in map_results.items() if k.startswith("Building labels")), None)
    tokenized_tokens = column_tokens(labelled, "input_ids")[0] if labelled is not None else None
    return {
        "rows_in": dataset.num_rows,
        "rows_packed": packed.num_rows,
        "real_tokens": real_tokens,
        "loss_tokens": loss_tokens,
        "tokenized_tokens": tokenized_tokens,
        "tokens_dropped": None if tokenized_tokens is None else tokenized_tokens - real_tokens,
        "seconds": seconds,
        "chat_template": template_source,
        "versions": {name: importlib.metadata.version(name) for name in ("trl", "datasets", "transformers")},
    }


def run_posttrain(jsonl, tokenizer_dir, row_length: int, num_proc: int, work_dir) -> dict:
    """posttrain's data steps over `jsonl` into packed rows of `row_length`, with `num_proc`
    render workers, writing only under `work_dir`: the SFT flow's `ingest` (fingerprint),
    `tokenize` (`posttrain.steps.tokenize.run_streamed`: read in parts, render, filter, write
    Arrow shards) and `pack` (one pass over the shards, best-fit packed), as the flow calls
    them, on the SFT demo recipe with this data, tokenizer and row length. `artifact_bytes`:
    what the flow would store as Metaflow artifacts for these steps (each pickled, as the
    datastore stores them); `shard_bytes`: the tokenized shards."""
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    import pickle

    from transformers import AutoTokenizer

    from posttrain.config import load_sft_config
    from posttrain.steps import ingest, pack, tokenize

    seconds["import"], clock = time.perf_counter() - clock, time.perf_counter()
    config = load_sft_config(REPO / "configs" / "sft" / "demo.yaml", overrides={
        "data.generate": None, "data.heldout_fraction": 0.0,  # a held-out set apart: every row trains
        "data.heldout": {"name": "heldout", "kind": "jsonl", "path": str(SHARED_DATA / "gsm8k" / "test.jsonl"),
                         "format": "gsm8k_chat", "limit": 200},
        "data.sources": [{"name": "chats", "kind": "jsonl", "path": str(jsonl), "format": "chat"}],
        "data.tokenize.num_proc": num_proc, "tokenizer.name_or_path": str(tokenizer_dir),
        "output_dir": str(work_dir), "pack.row_length": row_length})
    run_dir = Path(work_dir) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    fingerprints = ingest.source_fingerprints(config, run_dir)
    seconds["setup"], clock = time.perf_counter() - clock, time.perf_counter()
    result = tokenize.run_streamed(config, run_dir, tokenizer, fingerprints)
    seconds["tokenize"], clock = time.perf_counter() - clock, time.perf_counter()
    packed = pack.run(result.samples, config, tokenizer.pad_token_id)
    seconds["pack"] = time.perf_counter() - clock
    artifacts = {"data_fingerprints": fingerprints, "samples": result.samples, "tokenize_stats": result.stats,
                 "heldout_records": result.heldout, "data_counts": result.counts, "rejected": result.rejected,
                 "packed_rows": packed.rows, "pack_stats": packed.stats,
                 "samples_per_source": packed.samples_per_source}
    artifact_bytes = {name: len(pickle.dumps(value, protocol=4)) for name, value in artifacts.items()}
    stats = packed.stats
    return {
        "rows_in": result.counts["chats"]["read"],
        "samples": stats.num_samples,
        "rows_packed": stats.num_rows,
        "real_tokens": stats.real_tokens,
        "loss_tokens": stats.loss_tokens,
        "tokens_dropped": None,
        "truncated": stats.truncated,
        "seconds": seconds,
        "shard_bytes": sum(group.num_bytes for group in result.samples.values()),
        "artifact_bytes": sum(artifact_bytes.values()),
        "artifact_bytes_by_name": artifact_bytes,
        "rejected": len(result.rejected),
    }


CHILD_RUNNERS = {"trl": run_trl, "posttrain": run_posttrain}


def _child(args) -> None:
    """`--side S`: run that side once and print its stats as one JSON line."""
    start = time.perf_counter()
    stats = CHILD_RUNNERS[args.side](Path(args.data), Path(args.tokenizer), args.row_length, args.num_proc,
                                     Path(args.work_dir))
    stats.setdefault("seconds", {})["total"] = time.perf_counter() - start
    stats["seconds"] = {k: round(v, 3) for k, v in stats["seconds"].items()}
    rows, real = stats["rows_packed"], stats["real_tokens"]
    stats.setdefault("packing_efficiency", real / (rows * args.row_length) if rows else 0.0)
    stats.setdefault("bytes_written", dir_bytes(Path(args.work_dir)))
    stats.update(side=args.side, row_length=args.row_length, num_proc=args.num_proc)
    print(json.dumps(stats), flush=True)


# ---------------------------------------------------------------------------- main


def _summary(runs: list[dict], rows: int) -> dict:
    """One side's figures over its repeats at one size."""
    ok = [r for r in runs if r["returncode"] == 0 and r["stats"]]
    failed = len(runs) - len(ok)
    if not ok:
        tail = runs[-1]["stderr_tail"].strip().splitlines()
        return {"failed": failed, "error": tail[-1] if tail else f"exit {runs[-1]['returncode']}",
                "log_dir": runs[-1]["log_dir"]}
    first = ok[0]["stats"]
    stages = sorted({k for r in ok for k in r["stats"]["seconds"]})
    out = {
        "rows_per_s": spread([rows / r["wall_s"] for r in ok], 1),
        "rows_per_s_in_process": spread([rows / r["stats"]["seconds"]["total"] for r in ok], 1),
        "wall_s": spread([r["wall_s"] for r in ok], 2),
        "peak_rss_bytes": spread([r["peak_rss_bytes"] for r in ok], 0),
        "peak_pss_bytes": spread([r["peak_pss_bytes"] for r in ok], 0),
        "bytes_written_per_row": round(statistics.median(r["stats"]["bytes_written"] for r in ok) / rows, 1),
        "packing_efficiency": round(first["packing_efficiency"], 4),
        "seconds": {k: round(statistics.median(r["stats"]["seconds"].get(k, 0.0) for r in ok), 2) for k in stages},
        "failed": failed,
    }
    if "shard_bytes" in first:  # posttrain: the datastore holds the shards and the artifacts (references)
        written = statistics.median(r["stats"]["bytes_written"] + r["stats"]["artifact_bytes"] for r in ok)
        out["datastore_bytes_per_row"] = round(written / rows, 1)
        out["shard_bytes_per_row"] = round(first["shard_bytes"] / rows, 1)
        out["datastore_over_shards"] = round(written / first["shard_bytes"], 3)
        out["artifact_bytes"] = first["artifact_bytes"]
    for key in ("rows_in", "rows_packed", "real_tokens", "loss_tokens", "tokens_dropped", "chat_template",
                "versions", "samples", "truncated", "rejected"):
        if key in first:
            out[key] = first[key]
    # the same data through the same code must give the same rows every repeat
    out["repeats_identical"] = all(r["stats"].get(k) == first.get(k) for r in ok
                                   for k in ("rows_packed", "real_tokens", "loss_tokens"))
    return out


def _run_line(n: int, side: str, rep: int, repeats: int, r: dict) -> str:
    head = f"{n:,} rows, {side} run {rep + 1}/{repeats}:"
    s = r["stats"]
    if r["returncode"] != 0 or not s:
        tail = r["stderr_tail"].strip().splitlines()
        return f"{head} FAILED (exit {r['returncode']}): {tail[-1] if tail else ''} (logs: {r['log_dir']})"
    stages = ", ".join(f"{k} {v:.1f}" for k, v in s["seconds"].items() if k != "total")
    return (f"{head} {r['wall_s']:.1f} s wall = {n / r['wall_s']:,.0f} rows/s; "
            f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB (tree sum; PSS {r['peak_pss_bytes'] / 2**30:.2f}); "
            f"stages s: {stages}; {s['rows_packed']:,} rows of "
            f"{s['row_length']}, efficiency {s['packing_efficiency']:.4f}; {s['bytes_written'] / n:,.0f} B/row written")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="200000,1000000", help="comma-separated numbers of chats")
    parser.add_argument("--row-length", type=int, default=2048)
    parser.add_argument("--num-proc", type=int, default=usable_cores(), help="worker processes (default: usable cores)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "posttrain-bench-data-pipeline"))
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--tokenizer", default=str(QWEN3_TOKENIZER))
    parser.add_argument("--keep-runs", action="store_true", help="keep each run's written files (default: deleted)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: one side, in a child
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        _child(args)
        return

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if unknown := set(sides) - set(SIDES):
        parser.error(f"unknown sides {sorted(unknown)}; known: {', '.join(SIDES)}")
    if args.repeats < 1 or args.num_proc < 1 or not sizes or min(sizes) < 1:
        parser.error("--repeats, --num-proc and every size must be at least 1")
    work_dir = Path(args.work_dir)
    started = time.perf_counter()
    trl_version = importlib.metadata.version("trl")
    results: dict[str, dict] = {}
    failed: list[str] = []
    for n in sizes:
        clock = time.perf_counter()
        data = make_chats(n, work_dir / "data" / f"chats-{DATA_VERSION}-{n}.jsonl")
        log(f"{n:,} chats: {data} ({data.stat().st_size / 2**20:,.1f} MiB, {time.perf_counter() - clock:.1f} s)")
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for rep in range(args.repeats):
            for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:  # rotate the order each pass
                run_dir = work_dir / "runs" / f"{n}-{side}-{rep}"
                r = SIDE_RUNNERS[side](data, args.tokenizer, args.row_length, args.num_proc, run_dir)
                runs[side].append(r)
                log(_run_line(n, side, rep, args.repeats, r))
                if r["returncode"] != 0 or not r["stats"]:
                    failed.append(f"{n}/{side}/{rep}")
                elif not args.keep_runs:
                    shutil.rmtree(run_dir / "run", ignore_errors=True)
        entry = {"rows": n, "data_bytes": data.stat().st_size, **{side: _summary(runs[side], n) for side in sides}}
        if "trl" in runs and "posttrain" in runs:
            ratios = [t["wall_s"] / p["wall_s"] for p, t in zip(runs["posttrain"], runs["trl"])
                      if p["returncode"] == 0 and p["stats"] and t["returncode"] == 0 and t["stats"]]
            entry["ratio_rows_per_s"] = spread(ratios, 3) if ratios else None
        results[str(n)] = entry

    print(json.dumps({
        "benchmark": "data_pipeline",
        "baseline": f"TRL {trl_version} datasets.map(num_proc) + pack_dataset(bfd)",
        "ratio": "posttrain rows/s over TRL rows/s, per pass (wall of each side's whole subprocess)",
        "row_length": args.row_length,
        "num_proc": args.num_proc,
        "repeats": args.repeats,
        "sides": sides,
        "tokenizer": str(args.tokenizer),
        "sizes": results,
        "failed": failed,
        "settings": machine(),
        "seconds": round(time.perf_counter() - started, 1),
    }))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
