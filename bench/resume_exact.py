"""Exact resume after a hard kill: SIGKILL a training process, resume it in a new one, compare.

    python bench/resume_exact.py [--steps 12] [--every 3] [--kill-after 5] [--kill-in-save 9]

Runs the tiny SFT recipe (`configs/sft/tiny.yaml`: ingest -> tokenize -> pack -> train through
`posttrain.steps`) for `--steps` steps, checkpointing every `--every`, each run in its own
subprocess sharing one prepared dataset and tokenizer:

1. uninterrupted: the reference loss trajectory and final weights;
2. killed between checkpoints: the child stops after step `--kill-after` (before that step's
   checkpoint, if one were due) and the parent SIGKILLs it; a new child resumes from what is on
   disk (the last checkpoint at or before that step);
3. killed during a checkpoint write: the child stops inside `CheckpointManager.save` of step
   `--kill-in-save`, after the tensor shards are written and before the JSON state and the
   rename, and the parent SIGKILLs it; the parent checks that the partial temporary is there
   and the previous checkpoint is complete, and a new child resumes from that previous one.

Children stop at those points through the step and checkpoint-stage hooks of
`posttrain.steps.train.run` (they write a marker file and sleep until killed), so the kill
point is exact. The last line printed is one JSON object: `max_abs_loss_diff` (over every
step of both resumed trajectories against the uninterrupted one), `resumed_ok` (each resumed
run started from the expected checkpoint, the interrupted save left the previous checkpoint
whole, and the final exported weights equal the reference's), and per-case details.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "sft" / "tiny.yaml"
PAUSED = "paused"
WAIT_FOR_PAUSE_S = 300.0


# ---------------------------------------------------------------------------------- child side


def _pause(marker: Path, what: str) -> None:
    """Tell the parent where we are, then wait to be killed."""
    marker.write_text(what)
    while True:
        time.sleep(1.0)


def child(config_path: Path, run_dir: Path, pause_after_step: int | None, pause_in_save: int | None) -> None:
    """One training run; writes `run_dir/result.json` (losses, resume point) when it finishes."""
    from posttrain.config.loader import sft_config_from_dict
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, pack, tokenize, train
    from posttrain.train.checkpoint import CheckpointManager

    config = sft_config_from_dict(json.loads(config_path.read_text()), source=str(config_path))
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(config.tokenizer.name_or_path)
    data = ingest.run(config, run_dir)
    samples = tokenize.run(data.train, tokenizer, config.tokenizer.chat_template_kwargs, config.data.filters).samples
    rows = pack.run(samples, config, tokenizer.pad_token_id).stats.num_rows

    def on_step(metrics: dict) -> None:
        if metrics["step"] == pause_after_step:
            _pause(run_dir / PAUSED, f"after step {pause_after_step}")

    def on_stage(stage: str, tmp: Path) -> None:
        if stage == "tensors_written" and tmp.name.endswith(CheckpointManager.step_dir_name(pause_in_save or -1)):
            _pause(run_dir / PAUSED, f"inside save of step {pause_in_save} ({stage}, {tmp})")

    result = train.run(config, tokenizer, samples, rows, run_dir, on_step=on_step, on_checkpoint_stage=on_stage)
    (run_dir / "result.json").write_text(json.dumps({
        "losses": [h["loss"] for h in result.history],
        "steps": [h["step"] for h in result.history],
        "resumed_from": result.resumed_from,
        "checkpoint_dir": result.checkpoint_dir,
    }))


# ---------------------------------------------------------------------------------- parent side


def prepare(work: Path, steps: int, every: int) -> Path:
    """Generate the tiny recipe's data and tokenizer once; write the children's config (JSON)."""
    import yaml

    from posttrain.config.loader import sft_config_from_dict
    from posttrain.config.strict import to_dict
    from posttrain.steps import ingest

    raw = yaml.safe_load(TINY.read_text())
    ingest.run(sft_config_from_dict(raw, source=str(TINY)), work / "prep")
    generated = work / "prep" / "generated"
    raw["data"].pop("generate")
    raw["data"]["sources"][0]["path"] = str(generated / "train.jsonl")
    raw["data"]["heldout"]["path"] = str(generated / "heldout.jsonl")
    raw["tokenizer"]["name_or_path"] = str(generated / "tokenizer")
    raw["train"].update(max_steps=steps, device="cpu")
    raw["checkpoint"] = {"every_steps": every, "keep_last": 2}
    raw["output_dir"] = str(work / "outputs")
    config = work / "config.json"
    config.write_text(json.dumps(to_dict(sft_config_from_dict(raw, source="bench"))))
    return config


def _start(config: Path, run_dir: Path, ckpt_dir: Path, *flags: str) -> subprocess.Popen:
    config_with_dir = run_dir / "config.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    data = json.loads(config.read_text())
    data["checkpoint"]["directory"] = str(ckpt_dir)
    config_with_dir.write_text(json.dumps(data))
    log = open(run_dir / "child.log", "w")
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(config_with_dir),
                             "--run-dir", str(run_dir), *flags], stdout=log, stderr=subprocess.STDOUT)


def run_to_end(config: Path, run_dir: Path, ckpt_dir: Path) -> tuple[dict, float]:
    started = time.perf_counter()
    proc = _start(config, run_dir, ckpt_dir)
    if proc.wait() != 0:
        raise RuntimeError(f"child in {run_dir} failed:\n{(run_dir / 'child.log').read_text()[-3000:]}")
    return json.loads((run_dir / "result.json").read_text()), time.perf_counter() - started


def run_and_kill(config: Path, run_dir: Path, ckpt_dir: Path, *flags: str) -> tuple[str, float]:
    """Start a child that pauses at a hook, SIGKILL it there; returns where it paused."""
    started = time.perf_counter()
    proc = _start(config, run_dir, ckpt_dir, *flags)
    marker = run_dir / PAUSED
    deadline = time.monotonic() + WAIT_FOR_PAUSE_S
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"child in {run_dir} never reached its pause point:\n"
                               f"{(run_dir / 'child.log').read_text()[-3000:]}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return marker.read_text(), time.perf_counter() - started


def weights_diff(a: str, b: str) -> float:
    """Max absolute difference between two exported HF checkpoints (same tensor names)."""
    from safetensors.torch import load_file

    def tensors(path: str) -> dict:
        out = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            out.update(load_file(str(file)))
        return out

    left, right = tensors(a), tensors(b)
    if set(left) != set(right):
        return float("inf")
    return max(float((left[k].double() - right[k].double()).abs().max()) for k in left)


def loss_diff(reference: dict, resumed: dict) -> float:
    if resumed["steps"] != reference["steps"]:
        return float("inf")
    return max(abs(x - y) for x, y in zip(reference["losses"], resumed["losses"]))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=5, help="SIGKILL after this step (between checkpoints)")
    parser.add_argument("--kill-in-save", type=int, default=9, help="SIGKILL inside the save of this step")
    parser.add_argument("--work", default=None, help="work directory (default: a temporary one, removed)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pause-after-step", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pause-in-save", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(Path(args.child), Path(args.run_dir), args.pause_after_step, args.pause_in_save)
        return {}
    if args.kill_in_save % args.every or args.kill_in_save <= args.every or args.kill_in_save >= args.steps:
        parser.error("--kill-in-save must be a checkpoint step after the first one and before the last step")
    if not 0 < args.kill_after < args.steps or args.kill_after % args.every == 0:
        parser.error("--kill-after must fall between checkpoints, before the last step")

    from posttrain.train.checkpoint import CheckpointManager

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="posttrain-resume-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        config = prepare(work, args.steps, args.every)
        reference, reference_s = run_to_end(config, work / "reference", work / "reference-ckpt")
        cases = {}

        # kill between checkpoints
        ckpt = work / "between-ckpt"
        paused, killed_s = run_and_kill(config, work / "between-killed", ckpt,
                                        "--pause-after-step", str(args.kill_after))
        expect = ckpt / CheckpointManager.step_dir_name(args.kill_after // args.every * args.every)
        resumed, resumed_s = run_to_end(config, work / "between-resumed", ckpt)
        cases["kill_between_checkpoints"] = {
            "killed": paused, "resumed_from": resumed["resumed_from"], "expected_resume": str(expect),
            "max_abs_loss_diff": loss_diff(reference, resumed),
            "max_abs_weight_diff": weights_diff(reference["checkpoint_dir"], resumed["checkpoint_dir"]),
            "seconds_killed_run": round(killed_s, 2), "seconds_resumed_run": round(resumed_s, 2),
        }
        cases["kill_between_checkpoints"]["ok"] = resumed["resumed_from"] == str(expect)

        # kill inside a checkpoint write
        ckpt = work / "in-save-ckpt"
        paused, killed_s = run_and_kill(config, work / "in-save-killed", ckpt, "--pause-in-save", str(args.kill_in_save))
        manager = CheckpointManager(ckpt, every_steps=args.every)
        partial = ckpt / f".tmp-{CheckpointManager.step_dir_name(args.kill_in_save)}"
        previous = ckpt / CheckpointManager.step_dir_name(args.kill_in_save - args.every)
        on_disk = {
            "partial_temporary_left": partial.is_dir() and not CheckpointManager.is_complete(partial),
            "partial_files": sorted(p.name for p in partial.iterdir()) if partial.is_dir() else [],
            "complete_checkpoints": [p.name for p in manager.complete()],
        }
        previous_whole = manager.complete()[-1:] == [previous] and CheckpointManager.info(previous).step == \
            args.kill_in_save - args.every
        resumed, resumed_s = run_to_end(config, work / "in-save-resumed", ckpt)
        cases["kill_during_save"] = {
            "killed": paused, **on_disk, "previous_checkpoint_whole": previous_whole,
            "resumed_from": resumed["resumed_from"], "expected_resume": str(previous),
            "temporary_cleaned": not partial.exists(),
            "max_abs_loss_diff": loss_diff(reference, resumed),
            "max_abs_weight_diff": weights_diff(reference["checkpoint_dir"], resumed["checkpoint_dir"]),
            "seconds_killed_run": round(killed_s, 2), "seconds_resumed_run": round(resumed_s, 2),
        }
        cases["kill_during_save"]["ok"] = (on_disk["partial_temporary_left"] and previous_whole
                                           and resumed["resumed_from"] == str(previous) and not partial.exists())

    result = {
        "benchmark": "resume_exact",
        "steps": args.steps,
        "every_steps": args.every,
        "max_abs_loss_diff": max(c["max_abs_loss_diff"] for c in cases.values()),
        "max_abs_weight_diff": max(c["max_abs_weight_diff"] for c in cases.values()),
        "resumed_ok": all(c["ok"] and c["max_abs_weight_diff"] == 0 for c in cases.values()),
        "reference_losses": reference["losses"],
        "seconds_reference_run": round(reference_s, 2),
        "seconds_total": round(time.perf_counter() - started, 1),
        "cases": cases,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
