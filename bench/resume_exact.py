"""Exact resume after a hard kill: SIGKILL a training process, resume it in a new one, compare.

    python bench/resume_exact.py [--steps 12] [--every 3] [--kill-after 5] [--kill-in-save 9]
                                 [--random-kills N [--seed S] [--repeats R] [--random-steps 30] [--random-every 1]]

Runs the tiny SFT recipe (`configs/sft/tiny.yaml`: ingest -> tokenize -> pack -> train through
`posttrain.steps`) for `--steps` steps, checkpointing every `--every`, each run in a process of
its own (forked from a forkserver that imported the training code once, `CHILD_PRELOAD`)
sharing one prepared dataset and tokenizer:

1. uninterrupted: the reference loss trajectory and final weights;
2. killed between checkpoints: the child stops after step `--kill-after` (before that step's
   checkpoint, if one were due) and the parent SIGKILLs it; a new child resumes from what is on
   disk (the last checkpoint at or before that step);
3. killed during a checkpoint write: the child stops inside `CheckpointManager.save` of step
   `--kill-in-save`, after the tensor shards are written and before the JSON state and the
   rename, and the parent SIGKILLs it; the parent checks that the partial temporary is there
   and the previous checkpoint is complete, and a new child resumes from that previous one.
4. with `--random-kills N`: random wall-clock kills. An uninterrupted run of `--random-steps`
   steps, checkpointing every `--random-every`, logs when each step finished; N kill points are
   drawn uniformly (seeded by `--seed`) over its training timeline (first to last step). One
   chain of processes then trains the same run: each process resumes from whatever the
   previous one left on disk, and is SIGKILLed when its own position on the timeline (the
   reference time of its first newly trained step plus the wall time since) reaches the next
   kill point, so kills land anywhere: inside a step, inside DCP's tensor writes, between the
   tensors and the JSON state, inside the pruning of an old checkpoint. After each kill the
   parent records where it landed (from the temporaries left on disk) and loads the newest
   complete checkpoint into a fresh Trainer. After the last kill one more process runs to the
   end. Every step any process reported (restored or newly trained) must equal the
   uninterrupted loss bit for bit, and so must the final exported weights. `--repeats R`
   runs R chains with seeds S..S+R-1.

Children stop at the points of cases 2 and 3 through the step and checkpoint-stage hooks of
`posttrain.steps.train.run` (they write a marker file and sleep until killed), so the kill
point is exact. The last line printed is one JSON object: `max_abs_loss_diff` (over every
step of both resumed trajectories against the uninterrupted one), `resumed_ok` (each resumed
run started from the expected checkpoint, the interrupted save left the previous checkpoint
whole, and the final exported weights equal the reference's; with random kills also: no
process finished before its kill, the newest complete checkpoint loaded after every kill,
no reported step differs), `landed` (how many random kills fell where), and per-case details.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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


def child(config_path: Path, run_dir: Path, pause_after_step: int | None, pause_in_save: int | None,
          step_log: Path | None = None) -> None:
    """One training run; writes `run_dir/result.json` (losses, resume point) when it finishes.
    With `step_log`, every step record `on_step` sees (restored from a checkpoint or newly
    trained, flagged `new`) is appended to that file and flushed at once, with the wall time,
    so a parent that SIGKILLs this process still has every step it reported."""
    from posttrain.config.loader import sft_config_from_dict
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, pack, tokenize, train, train_state
    from posttrain.train.checkpoint import CheckpointManager

    config = sft_config_from_dict(json.loads(config_path.read_text()), source=str(config_path))
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(config.tokenizer.name_or_path)
    data = ingest.run(config, run_dir)
    samples = tokenize.run(data.train, tokenizer, config.tokenizer.chat_template_kwargs, config.data.filters,
                           config.pack, config.data.tokenize).samples
    rows = pack.run(samples, config, tokenizer.pad_token_id).stats.num_rows
    resume = train_state.resume_point(config, train_state.checkpoint_manager(config, run_dir))
    resume_step = CheckpointManager.info(resume).step if resume is not None else 0
    log = open(step_log, "a", buffering=1) if step_log is not None else None  # line-buffered

    def on_step(metrics: dict) -> None:
        if log is not None:
            log.write(json.dumps({"pid": os.getpid(), "step": metrics["step"], "loss": metrics["loss"],
                                  "new": metrics["step"] > resume_step, "resumed_from": resume_step,
                                  "time": time.time()}) + "\n")
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


# what a child imports, loaded once by the forkserver every child forks from (each would
# otherwise spend seconds of a core importing torch and transformers before its first step)
CHILD_PRELOAD = ["posttrain.config.loader", "posttrain.data.tokenizer", "posttrain.steps.ingest", "posttrain.steps.pack",
                 "posttrain.steps.tokenize", "posttrain.steps.train", "posttrain.steps.train_state",
                 "posttrain.train.checkpoint", "transformers.models.auto.tokenization_auto"]
_FORKSERVER = None


def _forkserver():
    """The multiprocessing context the children start from: a forkserver that imported
    `CHILD_PRELOAD` and nothing else (no training state: a child resumes from disk only).
    Bit for bit needs the same reduction order in every process: MKL's dynamic threading may use
    fewer threads when the machine is busy (a resumed child beside other work) and sum in another
    order, so the server, and so every child, runs with a fixed thread count."""
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing

        os.environ.update(MKL_DYNAMIC="FALSE", OMP_DYNAMIC="FALSE")  # read when the server loads OpenMP
        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(CHILD_PRELOAD)
    return _FORKSERVER


def _child_main(log_path: str, argv: list[str]) -> None:
    """A child process's body: its output to `log_path`, then `main(argv)` (the `--child` path)."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    main(argv)


class _Child:
    """A started child process, with the part of `subprocess.Popen` the parent uses."""

    def __init__(self, process):
        self._process, self.pid = process, process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self) -> int:
        self._process.join()
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


def _start(config: Path, run_dir: Path, ckpt_dir: Path, *flags: str, log_name: str = "child.log") -> _Child:
    """A new child process (forked from `_forkserver()`) training `config` with its
    checkpoints in `ckpt_dir`; its output goes to `run_dir / log_name`."""
    config_with_dir = run_dir / "config.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    data = json.loads(config.read_text())
    data["checkpoint"]["directory"] = str(ckpt_dir)
    config_with_dir.write_text(json.dumps(data))
    argv = ["--child", str(config_with_dir), "--run-dir", str(run_dir), *flags]
    process = _forkserver().Process(target=_child_main, args=(str(run_dir / log_name), argv))
    process.start()
    return _Child(process)


def run_to_end(config: Path, run_dir: Path, ckpt_dir: Path, *flags: str, log_name: str = "child.log") -> tuple[dict, float]:
    started = time.perf_counter()
    proc = _start(config, run_dir, ckpt_dir, *flags, log_name=log_name)
    if proc.wait() != 0:
        raise RuntimeError(f"child in {run_dir} failed:\n{(run_dir / log_name).read_text()[-3000:]}")
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


def read_step_log(path: Path) -> list[dict]:
    """The complete lines of a child's step log (a SIGKILL may leave a partial last line)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


def save_state(ckpt_dir: Path) -> str:
    """Where a kill left the checkpoint directory: "inside_tensor_write" (a temporary without
    DCP's `.metadata`: shards were being written), "inside_save" (tensors written, JSON state
    or rename pending), "inside_delete" (an old checkpoint being pruned) or "between_saves"."""
    from posttrain.train.checkpoint import DCP_METADATA_FILE, TMP_PREFIX

    temps = [p for p in ckpt_dir.iterdir() if p.name.startswith(TMP_PREFIX)] if ckpt_dir.is_dir() else []
    if any(p.name.startswith(f"{TMP_PREFIX}deleting-") for p in temps):
        return "inside_delete"
    if any(not (p / DCP_METADATA_FILE).exists() for p in temps):
        return "inside_tensor_write"
    return "inside_save" if temps else "between_saves"


def latest_loads(config_path: Path, run_dir: Path) -> tuple[int | None, bool, str]:
    """(step, loadable, error) of the newest complete checkpoint, loaded into a fresh Trainer
    here, in the parent, the way the train step resumes (fingerprint checked)."""
    from posttrain.config.loader import sft_config_from_dict
    from posttrain.models.architectures import load_hf_checkpoint
    from posttrain.objectives.sft import SFTObjective
    from posttrain.steps import train, train_state
    from posttrain.train.checkpoint import CheckpointManager
    from posttrain.train.trainer import Trainer

    config = sft_config_from_dict(json.loads(config_path.read_text()), source=str(config_path))
    manager = train_state.checkpoint_manager(config, run_dir)
    complete = manager.complete()  # (`latest()` would also clean the temporaries the kill left)
    if not complete:
        return None, True, ""
    try:
        trainer = Trainer(load_hf_checkpoint(run_dir / "base"), config.train, total_steps=config.train.max_steps,
                          objective=SFTObjective())
        manager.load(complete[-1], trainer)
        return CheckpointManager.info(complete[-1]).step, trainer.step == CheckpointManager.info(complete[-1]).step, ""
    except Exception as exc:  # reported, never fatal: this is what the bench checks
        return None, False, f"{type(exc).__name__}: {exc}"


def random_kills(work: Path, kills: int, seed: int, steps: int, every: int) -> dict:
    """SIGKILL one chain of training processes at `kills` random wall-clock points of the
    training timeline, each new process resuming from what the previous one left; compare
    every reported step and the final weights with an uninterrupted run (module docstring)."""
    import random

    config = prepare(work / "random", steps, every)
    reference, reference_s = run_to_end(config, work / "random-reference", work / "random-reference-ckpt",
                                        "--step-log", str(work / "random-reference" / "steps.jsonl"))
    ref_log = [r for r in read_step_log(work / "random-reference" / "steps.jsonl") if r["new"]]
    timeline = {r["step"]: r["time"] - ref_log[0]["time"] for r in ref_log}  # seconds after step 1
    span = timeline[steps]
    rng = random.Random(seed)
    points = sorted(rng.uniform(0.0, span) for _ in range(kills))
    run_dir, ckpt = work / "random-chain", work / "random-chain-ckpt"
    step_log = run_dir / "steps.jsonl"
    attempts = []
    for k, point in enumerate(points):
        seen = len(read_step_log(step_log))
        proc = _start(config, run_dir, ckpt, "--step-log", str(step_log), log_name=f"attempt-{k}.log")
        deadline = time.monotonic() + WAIT_FOR_PAUSE_S
        first = None
        while first is None:  # wait for this attempt's first newly trained step
            new = [r for r in read_step_log(step_log)[seen:] if r["new"] and r["pid"] == proc.pid]
            first = new[0] if new else None
            if first is None and (proc.poll() is not None or time.monotonic() > deadline):
                proc.kill()
                raise RuntimeError(f"attempt {k} trained no step:\n{(run_dir / f'attempt-{k}.log').read_text()[-3000:]}")
            time.sleep(0.005)
        # sleep to the kill point, but kill at once if this attempt gets to the next-to-last step
        # first: it ran faster than the reference (other load on the machine while the
        # reference ran), and letting it finish would leave the later attempts nothing to resume
        kill_at = time.monotonic() + point - timeline[first["step"]] - (time.time() - first["time"])
        while time.monotonic() < kill_at and proc.poll() is None:
            reached = [r["step"] for r in read_step_log(step_log)[seen:] if r["pid"] == proc.pid and r["new"]]
            if reached and reached[-1] >= steps - 1:
                break
            time.sleep(0.005)
        finished_first = proc.poll() is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        mine = [r for r in read_step_log(step_log)[seen:] if r["pid"] == proc.pid and r["new"]]
        where = save_state(ckpt)
        step, loadable, error = latest_loads(run_dir / "config.json", run_dir)  # the config _start wrote
        attempts.append({"kill_at_s": round(point, 3), "resumed_from_step": first["resumed_from"],
                         "last_step_reported": mine[-1]["step"], "landed": where,
                         "latest_complete_step": step, "latest_loadable": loadable, "load_error": error,
                         "finished_before_kill": finished_first})
        print(f"[resume_exact] kill {k + 1}/{kills} at {point:.2f}s of {span:.2f}s: resumed from step "
              f"{first['resumed_from']}, killed after step {mine[-1]['step']} ({where}); newest complete "
              f"checkpoint step {step}, loads: {loadable}", file=sys.stderr, flush=True)
    final, _ = run_to_end(config, run_dir, ckpt, "--step-log", str(step_log), log_name="final.log")
    want = dict(zip(reference["steps"], reference["losses"]))
    reported = read_step_log(step_log)
    mismatched = [r for r in reported if r["loss"] != want.get(r["step"])]
    diffs = [abs(r["loss"] - want[r["step"]]) for r in reported if r["step"] in want]
    landed = [a["landed"] for a in attempts]
    return {
        "kills": kills, "seed": seed, "steps": steps, "every_steps": every, "timeline_s": round(span, 3),
        "max_abs_loss_diff": max([loss_diff(reference, final), *diffs]),
        "max_abs_weight_diff": weights_diff(reference["checkpoint_dir"], final["checkpoint_dir"]),
        "steps_reported": len(reported), "steps_mismatched": len(mismatched),
        "landed": {w: landed.count(w) for w in sorted(set(landed))},
        "latest_always_loadable": all(a["latest_loadable"] for a in attempts),
        "resumed_ok": (all(a["latest_loadable"] and not a["finished_before_kill"] for a in attempts)
                       and not mismatched and final["steps"] == reference["steps"]),
        "attempts": attempts,
    }


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
    parser.add_argument("--random-kills", type=int, default=0,
                        help="also SIGKILL a chain of runs at this many seeded random wall-clock points")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random kill points")
    parser.add_argument("--repeats", type=int, default=1, help="random-kill chains, seeds seed..seed+N-1")
    parser.add_argument("--random-steps", type=int, default=30, help="steps of the random-kill runs")
    parser.add_argument("--random-every", type=int, default=1, help="checkpoint interval of the random-kill runs")
    parser.add_argument("--work", default=None, help="work directory (default: a temporary one, removed)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--step-log", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pause-after-step", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pause-in-save", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(Path(args.child), Path(args.run_dir), args.pause_after_step, args.pause_in_save,
              Path(args.step_log) if args.step_log else None)
        return {}
    if args.kill_in_save % args.every or args.kill_in_save <= args.every or args.kill_in_save >= args.steps:
        parser.error("--kill-in-save must be a checkpoint step after the first one and before the last step")
    if not 0 < args.kill_after < args.steps or args.kill_after % args.every == 0:
        parser.error("--kill-after must fall between checkpoints, before the last step")
    if args.random_kills < 0 or args.repeats < 1 or args.random_steps < 2 or args.random_every < 1:
        parser.error("--random-kills >= 0, --repeats >= 1, --random-steps >= 2 and --random-every >= 1")

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

        chains = []
        for r in range(args.repeats if args.random_kills else 0):
            chains.append(random_kills(work / f"chain-{r}", args.random_kills, args.seed + r,
                                       args.random_steps, args.random_every))
        if chains:
            cases["random_kills"] = {
                "chains": chains, "ok": all(c["resumed_ok"] for c in chains),
                "max_abs_loss_diff": max(c["max_abs_loss_diff"] for c in chains),
                "max_abs_weight_diff": max(c["max_abs_weight_diff"] for c in chains),
                "landed": {w: sum(c["landed"].get(w, 0) for c in chains)
                           for w in sorted({w for c in chains for w in c["landed"]})},
            }

    result = {
        "benchmark": "resume_exact",
        "steps": args.steps,
        "every_steps": args.every,
        "max_abs_loss_diff": max(c["max_abs_loss_diff"] for c in cases.values()),
        "max_abs_weight_diff": max(c["max_abs_weight_diff"] for c in cases.values()),
        "resumed_ok": all(c["ok"] and c["max_abs_weight_diff"] == 0 for c in cases.values()),
        "random_kills": args.random_kills * args.repeats if args.random_kills else 0,
        "landed": cases.get("random_kills", {}).get("landed", {}),
        "reference_losses": reference["losses"],
        "seconds_reference_run": round(reference_s, 2),
        "seconds_total": round(time.perf_counter() - started, 1),
        "cases": cases,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
