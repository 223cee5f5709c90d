"""The live training card's optimizer plot and health line."""

import math

import matplotlib

matplotlib.use("Agg")

from posttrain.eval import plots  # noqa: E402


def history():
    steps = []
    for step in range(1, 11):
        h = {"step": step, "loss": 2.0 / step, "grad_norm": 1.0 / step, "lr": 1e-3 * step / 10,
             "skipped": False, "loss_spike": False, "grad_explosion": False}
        steps.append(h)
    steps[3].update(loss=math.nan, grad_norm=math.inf, skipped=True)
    steps[6].update(loss_spike=True)
    steps[7].update(grad_explosion=True, grad_norm=50.0)
    return steps


def test_health_summary_counts_each_flag_with_its_last_step():
    line = plots.health_summary(history())
    assert line == ("health: skipped (non-finite): 1 (last at step 4), loss spikes: 1 (last at step 7), "
                    "gradient explosions: 1 (last at step 8)")
    assert plots.health_summary([]) == "health: skipped (non-finite): 0, loss spikes: 0, gradient explosions: 0"


def test_optimizer_curves_mark_flagged_steps_and_skip_non_finite_norms():
    fig = plots.optimizer_curves(history())
    ax_norm, ax_lr = fig.axes
    (norm_line,) = [line for line in ax_norm.get_lines() if len(line.get_xdata()) > 2]
    assert list(norm_line.get_xdata()) == [1, 2, 3, 5, 6, 7, 8, 9, 10]  # step 4's inf left out
    marked = sorted(line.get_xdata()[0] for line in ax_norm.get_lines() if len(line.get_xdata()) == 2)
    assert marked == [4, 7, 8]
    assert len(ax_lr.get_lines()[0].get_xdata()) == 10
    matplotlib.pyplot.close(fig)
