"""Metrics sinks: TensorBoard event files hold the step scalars, the fan-out writes JSONL and
TensorBoard alike, and progress shows a bar on a terminal and plain ETA lines elsewhere."""

from __future__ import annotations

import io
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from posttrain.objectives.sft import SFTObjective
from posttrain.train.metrics import MetricsLog, MetricsSinks, open_metrics
from posttrain.train.progress import Progress
from posttrain.train.tensorboard import TensorBoardLog, scalars
from posttrain.train.trainer import Trainer

from test_trainer import T, config, packed_row, tiny_model


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def step_metrics(step: int) -> dict:
    return {"step": step, "loss": 3.0 / step, "lr": 1e-3 * step, "grad_norm": 0.5, "grad_clipped": step % 2 == 0,
            "tokens": 100, "tokens_per_s": 1000.0 + step, "step_time_s": 0.1, "health": "ok", "elapsed_s": 0.1 * step}


def test_scalars_keep_numbers_and_bools_only():
    got = scalars(step_metrics(2))
    assert got["grad_clipped"] == 1.0 and got["loss"] == 1.5
    assert "health" not in got and "step" not in got and "elapsed_s" not in got


def test_tensorboard_event_files_hold_the_trainer_scalars(tmp_path):
    gen = torch.Generator().manual_seed(0)
    trainer = Trainer(tiny_model(), config(learning_rate=1e-3, peak_flops=1e12), total_steps=3,
                      objective=SFTObjective())
    board = TensorBoardLog(tmp_path / "tb")
    history = []
    for _ in range(3):
        metrics = trainer.train_step([packed_row(gen, [T], [T - 1])])
        history.append(metrics)
        board.append(metrics)
    board.close()
    tags = read_scalars(tmp_path / "tb")
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "skipped_steps"):
        assert [s for s, _ in tags[f"train/{key}"]] == [1, 2, 3], key
        assert [v for _, v in tags[f"train/{key}"]] == pytest.approx([m[key] for m in history], rel=1e-6), key


def test_fan_out_writes_jsonl_and_tensorboard(tmp_path):
    with open_metrics(tmp_path / "run") as sinks:
        for step in (1, 2, 3):
            sinks.append(step_metrics(step))
        assert [r["step"] for r in sinks.records] == [1, 2, 3]
    assert MetricsLog.read(tmp_path / "run" / "metrics.jsonl") == [step_metrics(s) for s in (1, 2, 3)]
    assert [v for _, v in read_scalars(tmp_path / "run" / "tensorboard")["train/loss"]] == pytest.approx([3.0, 1.5, 1.0])

    only_jsonl = open_metrics(tmp_path / "plain", report_to=[])
    only_jsonl.append(step_metrics(1))
    only_jsonl.close()
    assert not (tmp_path / "plain" / "tensorboard").exists()
    assert MetricsSinks().records == []


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_plain_lines_every_log_every_with_eta():
    stream = io.StringIO()
    with Progress(total_steps=7, log_every=3, stream=stream) as progress:
        assert not progress.uses_bar  # not a terminal
        for step in range(1, 8):
            progress.update(step_metrics(step))
    lines = stream.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/7", "step 3/7", "step 6/7", "step 7/7"]
    assert "eta 0m01s" in lines[0] and lines[-1].endswith("eta 0m00s")


def test_progress_bar_on_a_terminal_and_off_when_disabled():
    stream = FakeTerminal()
    with Progress(total_steps=4, log_every=1, stream=stream) as progress:
        assert progress.uses_bar
        for step in range(1, 5):
            progress.update(step_metrics(step))
        assert progress.bar.n == 4
    out = stream.getvalue()
    assert "4/4" in out and "loss=0.7500" in out and "step 1/4" not in out

    off = FakeTerminal()
    with Progress(total_steps=4, log_every=2, enabled=False, stream=off) as progress:
        assert not progress.uses_bar
        for step in range(1, 5):
            progress.update(step_metrics(step))
    assert [line.split(" |")[0] for line in off.getvalue().splitlines()] == ["step 1/4", "step 2/4", "step 4/4"]


def test_step_line_shows_mfu_and_health_flags():
    from posttrain.train.metrics import format_step

    ok = format_step({**step_metrics(2), "mfu": 0.4123})
    assert "mfu 41.2%" in ok and "NONFINITE" not in ok and "LOSS_SPIKE" not in ok
    bad = format_step({**step_metrics(2), "health": "nonfinite", "skipped": True}, total_steps=5)
    assert "NONFINITE (step skipped)" in bad
    assert format_step({**step_metrics(2), "health": "loss_spike"}).endswith("LOSS_SPIKE")


def test_tensorboard_resume_discards_steps_after_the_resume_point(tmp_path):
    """A crashed attempt logged steps 1-5; the run resumes after step 3: steps 4-5 are
    written again by the new attempt and must not show twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from posttrain.train.tensorboard import TensorBoardLog

    first = TensorBoardLog(tmp_path)
    for step in range(1, 6):
        first.append({"step": step, "loss": 10.0 + step})
    first.close()
    # event files are read in name order, and names start with the creation second; a real
    # resume starts seconds later (a new process), which this sleep stands for
    time.sleep(1.05)
    resumed = TensorBoardLog(tmp_path, resume_step=3)
    for step in range(4, 7):
        resumed.append({"step": step, "loss": 20.0 + step})
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert got == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)]
