"""Training health: non-finite steps are skipped without touching weights, optimizer or
schedule; spikes and explosions are flagged while the step is applied; a run of bad steps
stops with a clear error."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.config.schema import HealthConfig
from posttrain.objectives.sft import SFTObjective
from posttrain.ops.losses import causal_lm_loss
from posttrain.train.health import HealthMonitor, TrainingHealthError
from posttrain.train.trainer import Trainer

from test_trainer import T, config, packed_row, tiny_model


class Injected:
    """`causal_lm_loss`, made bad on chosen calls (1-based): `loss` scales the loss sum (NaN or a
    factor), `grad` scales the gradient flowing back into the final hidden states."""

    def __init__(self, loss: dict[int, float] | None = None, grad: dict[int, float] | None = None):
        self.loss, self.grad, self.calls = loss or {}, grad or {}, 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls in self.grad:
            factor = self.grad[self.calls]

            def scale_grad(_module, _inputs, hidden_BTD):
                hidden_BTD.register_hook(lambda g: g * factor)

            handle = model.norm.register_forward_hook(scale_grad)
        loss_sum, n = causal_lm_loss(model, batch)
        if self.calls in self.grad:
            handle.remove()
        if self.calls in self.loss:
            loss_sum = loss_sum * self.loss[self.calls]
        return loss_sum, n


def batches(n: int):
    gen = torch.Generator().manual_seed(5)
    return [packed_row(gen, [T], [T - 1]) for _ in range(n)]


def health(**overrides) -> HealthConfig:
    return HealthConfig(**{"min_history": 3, "window": 10, **overrides})


def snapshot(trainer: Trainer):
    params = [p.detach().clone() for p in trainer.model.parameters()]
    opt = copy.deepcopy(trainer.optimizer.state_dict())
    return params, opt, trainer.scheduler.last_epoch


def assert_same(before, trainer: Trainer):
    params, opt, epoch = before
    assert all(torch.equal(a, b) for a, b in zip(params, trainer.model.parameters()))
    now = trainer.optimizer.state_dict()
    for key, state in opt["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(now["state"][key][name])), (key, name)
    assert trainer.scheduler.last_epoch == epoch


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_nonfinite_step_is_skipped_and_leaves_state_untouched(where):
    bad = {3: float("nan")} if where == "loss" else {3: float("inf")}
    loss_fn = Injected(loss=bad) if where == "loss" else Injected(grad=bad)
    trainer = Trainer(tiny_model(), config(learning_rate=1e-3, warmup_steps=2, health=health()), total_steps=10,
                      objective=SFTObjective(loss_fn))
    data = batches(5)
    for b in data[:2]:
        assert trainer.train_step([b])["health"] == "ok"
    before = snapshot(trainer)
    lr_before = trainer.optimizer.param_groups[0]["lr"]
    metrics = trainer.train_step([data[2]])
    assert metrics["health"] == "nonfinite" and metrics["nonfinite"] and metrics["skipped"]
    assert metrics["skipped_steps"] == 1 and metrics["step"] == 3
    assert not metrics["grad_clipped"]
    if where == "grad":
        assert metrics["loss"] == metrics["loss"]  # the loss itself was finite
    assert_same(before, trainer)
    assert all(p.grad is None for p in trainer.model.parameters())  # gradients dropped
    after = trainer.train_step([data[3]])
    assert after["health"] == "ok" and after["lr"] == lr_before  # the schedule did not advance
    assert not all(torch.equal(a, b) for a, b in zip(before[0], trainer.model.parameters()))


def test_consecutive_nonfinite_steps_raise_with_a_clear_message():
    loss_fn = Injected(loss={2: float("nan"), 3: float("inf"), 4: float("nan")})
    trainer = Trainer(tiny_model(), config(health=health(max_consecutive_bad_steps=3)), total_steps=10,
                      objective=SFTObjective(loss_fn))
    trainer.health.mark_checkpoint("/runs/x/checkpoints/step-1", 1)
    data = batches(4)
    trainer.train_step([data[0]])
    trainer.train_step([data[1]])
    trainer.train_step([data[2]])
    with pytest.raises(TrainingHealthError) as err:
        trainer.train_step([data[3]])
    message = str(err.value)
    for part in ("3 consecutive non-finite steps (2..4)", "step 2: loss=nan", "step 3: loss=inf",
                 "/runs/x/checkpoints/step-1 (step 1)"):
        assert part in message, message


def test_a_good_step_resets_the_bad_streak():
    monitor = HealthMonitor(health(max_consecutive_bad_steps=2))
    monitor.check(1, float("nan"), 1.0)
    monitor.check(2, 1.0, 1.0)
    monitor.check(3, 1.0, float("nan"))
    with pytest.raises(TrainingHealthError, match=r"\(3\.\.4\).*no checkpoint was recorded"):
        monitor.check(4, float("inf"), 1.0)
    assert monitor.skipped_steps == 3


def test_loss_spike_is_flagged_and_the_step_still_applied():
    loss_fn = Injected(loss={5: 20.0})
    trainer = Trainer(tiny_model(), config(learning_rate=1e-3, health=health(spike_factor=3.0)), total_steps=10,
                      objective=SFTObjective(loss_fn))
    data = batches(6)
    flags = [trainer.train_step([b]) for b in data[:4]]
    assert [m["health"] for m in flags] == ["ok"] * 4
    before = snapshot(trainer)
    spike = trainer.train_step([data[4]])
    assert spike["loss_spike"] and spike["health"] in ("loss_spike", "grad_explosion") and not spike["skipped"]
    assert not all(torch.equal(a, b) for a, b in zip(before[0], trainer.model.parameters()))
    assert trainer.scheduler.last_epoch == before[2] + 1


def test_grad_explosion_is_flagged_relative_and_absolute():
    loss_fn = Injected(grad={5: 1000.0})
    # config() turns clipping off (max_grad_norm 1e9), which is also the default floor: set it
    trainer = Trainer(tiny_model(), config(health=health(grad_explosion_factor=10.0, grad_explosion_min_norm=0.0)),
                      total_steps=10, objective=SFTObjective(loss_fn))
    data = batches(6)
    ok = [trainer.train_step([b]) for b in data[:4]]
    assert not any(m["grad_explosion"] for m in ok)
    boom = trainer.train_step([data[4]])
    assert boom["health"] == "grad_explosion" and boom["grad_explosion"] and not boom["loss_spike"]
    assert not boom["skipped"] and boom["grad_norm"] > 10 * max(m["grad_norm"] for m in ok)

    alert = ok[0]["grad_norm"] / 2
    absolute = Trainer(tiny_model(), config(health=health(max_grad_norm_alert=alert)), total_steps=10,
                       objective=SFTObjective())
    first = absolute.train_step([data[0]])  # no history needed for the absolute threshold
    assert first["grad_explosion"] and first["health"] == "grad_explosion"


def test_no_flags_before_min_history():
    monitor = HealthMonitor(health(min_history=3))
    assert monitor.check(1, 1.0, 1.0).health == "ok"
    assert monitor.check(2, 100.0, 1000.0).health == "ok"  # not enough history yet
    monitor.check(3, 1.0, 1.0)
    verdict = monitor.check(4, 100.0, 1.0)
    assert verdict.loss_spike and not verdict.grad_explosion


def test_monitor_state_round_trips():
    monitor = HealthMonitor(health())
    for step, loss in enumerate([2.0, 1.9, float("nan"), 1.8], start=1):
        monitor.check(step, loss, 0.5)
    monitor.mark_checkpoint("ckpt", 4)
    restored = HealthMonitor(health())
    restored.load_state_dict(monitor.state_dict())
    assert restored.state_dict() == monitor.state_dict()
    assert restored.check(5, 100.0, 0.5).loss_spike == monitor.check(5, 100.0, 0.5).loss_spike is True


# ------------------------------------------------------------------ no false alarms


def flags(monitor: HealthMonitor, losses, grad_norms) -> list[tuple[int, str]]:
    """(step, health) of every flagged step when `monitor` sees this trajectory."""
    out = []
    for step, (loss, norm) in enumerate(zip(losses, grad_norms), start=1):
        verdict = monitor.check(step, loss, norm)
        if verdict.health != "ok":
            out.append((step, verdict.health))
    return out


def converging(n: int = 600, seed: int = 0):
    """A healthy run's shape: the loss falls from 5 to a floor of ~3e-4 that jitters by
    several x from batch to batch (x/÷ 1.35 while it is large); the gradient norm falls from
    ~3 to ~3e-4 (1e4x), log-normal around its trend (x/÷ 2.5)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 1, n, dtype=torch.float64)
    z = lambda sigma: torch.exp(torch.randn(n, generator=gen, dtype=torch.float64) * sigma)  # noqa: E731
    losses = 5.0 * torch.exp(-12 * t) * z(0.3) + 3e-4 * z(1.5)
    norms = 3.0 * torch.exp(-9.2 * t) * z(0.9)
    return losses.tolist(), norms.tolist()


def old_rule_flags(losses, norms, window: int = 50) -> int:
    """How many steps the monitor's former rules flagged: loss > 3x, norm > 10x the window median."""
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return sum((losses[i] > 3 * median(losses[i - window:i])) + (norms[i] > 10 * median(norms[i - window:i]))
               for i in range(window, len(losses)))


def test_a_converging_run_near_zero_loss_and_shrinking_gradients_flags_nothing():
    losses, norms = converging()
    assert flags(HealthMonitor(HealthConfig(), clip_norm=1.0), losses, norms) == []
    assert old_rule_flags(losses, norms) > 10  # the relative rules alone cry wolf on it


def test_injected_spikes_and_explosions_are_still_caught():
    losses, norms = converging()
    losses[100], losses[500] = losses[100] + 6.0, 4.0  # a jump mid-run (median 1.2), one near the end (3e-4)
    norms[200], norms[550] = 40.0, 50.0  # far beyond the clipping threshold (1.0)
    found = flags(HealthMonitor(HealthConfig(), clip_norm=1.0), losses, norms)
    assert found == [(101, "loss_spike"), (201, "grad_explosion"), (501, "loss_spike"), (551, "grad_explosion")]


def test_spikes_are_measured_as_rises_so_negative_losses_work():
    gen = torch.Generator().manual_seed(1)
    policy = (-0.05 + 0.01 * torch.randn(300, generator=gen, dtype=torch.float64)).tolist()  # a policy loss
    assert flags(HealthMonitor(HealthConfig()), policy, [0.5] * 300) == []
    policy[250] = 0.9
    assert flags(HealthMonitor(HealthConfig()), policy, [0.5] * 300) == [(251, "loss_spike")]


def test_a_clean_tiny_training_run_flags_nothing():
    """Overfitting a few packed rows: the loss falls towards zero and the gradients shrink."""
    trainer = Trainer(tiny_model(), config(learning_rate=3e-3, warmup_steps=5, max_grad_norm=1.0), total_steps=150,
                      objective=SFTObjective())
    data = batches(3)
    history = [trainer.train_step([data[i % 3]]) for i in range(150)]
    assert history[-1]["loss"] < history[0]["loss"] / 5
    assert [m["step"] for m in history if m["health"] != "ok"] == []


def demo_trajectory():
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).resolve().parents[1] / "data" / "demo_trajectory.json").read_text())
    return data["loss"], data["grad_norm"]


def test_the_healthy_demo_run_flags_nothing_and_injected_faults_in_it_are_caught():
    """The real trajectory of `make run` (loss 5.7 -> 3e-4; late gradient norms of ~0.02 that
    jump to 1-4 on harder batches and are clipped): the former relative rules flagged 106 of
    its steps."""
    losses, norms = demo_trajectory()
    assert flags(HealthMonitor(HealthConfig(), clip_norm=1.0), losses, norms) == []
    assert old_rule_flags(losses, norms) > 50
    losses[1500], norms[2000], losses[2400] = losses[1500] + 5.0, 200.0, 2.0
    assert flags(HealthMonitor(HealthConfig(), clip_norm=1.0), losses, norms) == [
        (1501, "loss_spike"), (2001, "grad_explosion"), (2401, "loss_spike")]
