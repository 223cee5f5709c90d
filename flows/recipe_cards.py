"""Metaflow card builders for the recipes: the only card code; steps and the library stay card-free."""

from __future__ import annotations

import importlib
import time

from metaflow import current
from metaflow.cards import Image, Markdown, ProgressBar, Table


class _OnFirstUse:
    """A module imported when first used. Every task of a flow, and every card it renders (a
    `flow.py card create` process of its own), imports the flow file and so this module;
    matplotlib costs 0.7 s of a core to import and is needed only where a card draws."""

    def __init__(self, name: str):
        self._name, self._module = name, None

    def __getattr__(self, attribute: str):
        if self._module is None:
            import matplotlib

            matplotlib.use("Agg")  # cards render on headless workers
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attribute)


plt = _OnFirstUse("matplotlib.pyplot")
plots = _OnFirstUse("posttrain.eval.plots")

MAX_TABLE_ROWS = 50


class _NoCard:
    """What a step draws on when the run renders no cards (`production.cards: false`): every
    component appended is dropped. The builders that plot check for it first and draw nothing."""

    def append(self, component) -> None:
        pass

    def refresh(self, data=None) -> None:
        pass


NO_CARD = _NoCard()


def card(card_id: str):
    """The running step's card `card_id` (`current.card[card_id]`), or `NO_CARD` when the run
    renders none: its steps then carry no `@card` (`flows/recipe_configs.py:apply_production`),
    and Metaflow sets no `current.card`."""
    collector = getattr(current, "card", None)
    return NO_CARD if collector is None else collector[card_id]


def figure_image(fig, label: str | None = None) -> Image:
    image = Image.from_matplotlib(fig, label=label)
    plt.close(fig)
    return image


def ingest_section(card, counts: dict, rejected: list, warnings: list[str] = ()) -> None:
    card.append(Markdown("## Data sources"))
    for warning in warnings:
        card.append(Markdown(f"**Warning:** {warning}"))
    card.append(Table([[name, c["read"], c["kept"], c["rejected"]] for name, c in counts.items()],
                      headers=["source", "rows read", "kept", "rejected"]))
    card.append(Markdown(f"## Rejected rows ({len(rejected)})"))
    if rejected:
        card.append(Table([[r.source, r.line, r.reason, r.raw[:120]] for r in rejected[:MAX_TABLE_ROWS]],
                          headers=["source", "line", "reason", "row"]))
        if len(rejected) > MAX_TABLE_ROWS:
            card.append(Markdown(f"... and {len(rejected) - MAX_TABLE_ROWS} more, in `rejected.jsonl`."))
    else:
        card.append(Markdown("None: every row was valid."))


def vocabulary_section(card, vocabulary: dict, heldout_users: int, train_only_users: int) -> None:
    """A sequence recipe's item vocabulary and its leave-last-out split."""
    if "reused" in vocabulary:
        text = f"Reused the item tokenizer `{vocabulary['reused']}`: {vocabulary['items']} items."
    else:
        text = (f"{vocabulary['items']} items kept (seen at least {vocabulary['min_count']} times in training), "
                f"{vocabulary['dropped_items']} rarer items ({vocabulary['dropped_interactions']} interactions) "
                f"mapped to `<unk>`; event types {vocabulary['events'] or 'none'}; {vocabulary['vocab_size']} "
                f"tokens with {vocabulary['reserved']} reserved to pad to a multiple of 64.")
    card.append(Markdown(f"## Item vocabulary\n{text}\n\n## Split (leave-last-out)\n{heldout_users} users hold out "
                         f"their last item (test) and the one before (validation); {train_only_users} users with "
                         "fewer than 3 interactions train only."))


def semantic_ids_section(card, stats: dict, examples: list) -> None:
    """A semantic-ID recipe's codes and a few of its conversations."""
    card.append(Markdown(
        f"## Semantic IDs\n{stats['items']} items named by {stats['levels']} codes each ({stats['code_tokens']} code "
        f"tokens added to the tokenizer); {stats['collisions']} items shared a tuple before the collision level. "
        f"{stats['predictions']} next-item turns to train on. Left out: {stats['uncoded_history_items']} history "
        f"items and {stats['uncoded_targets']} targets without features."))
    card.append(Table([[" ".join(m["content"] for m in e.messages[:-1:2])[-160:], e.messages[-1]["content"]]
                       for e in examples], headers=["session: the user's items (end)", "next item"]))


def tokenize_section(card, stats) -> None:
    if card is NO_CARD:  # it plots
        return
    card.append(Markdown(
        f"## Tokenized samples\n{stats.num_samples} samples, {stats.num_tokens} tokens, "
        f"{stats.num_loss_tokens} trained (assistant) tokens"))
    card.append(Table([[name, s["samples"], s["tokens"], s["p50"], s["p90"], s["max"]] for name, s in stats.lengths.items()],
                      headers=["source", "samples", "tokens", "p50 length", "p90 length", "max length"]))
    card.append(figure_image(plots.length_histograms_by_source(stats.length_histograms)))
    card.append(figure_image(plots.source_counts_bar(stats.lengths)))
    card.append(Markdown("## Filters (kept and rejected per source)"))
    card.append(Table([[name, f["kept"], ", ".join(f"{k}: {v}" for k, v in f["rejected"].items()) or "none",
                        f.get("over_row_length", 0)]
                       for name, f in stats.filters.items()],
                      headers=["source", "kept", "rejected", "kept but longer than a row (pack.on_overflow applies)"]))


def pack_section(card, stats, samples_per_source: dict) -> None:
    if card is NO_CARD:  # it plots
        return
    card.append(Markdown(
        f"## Packing (one pass over the mixture)\n{stats.num_samples} samples into {stats.num_rows} rows: "
        f"**efficiency {stats.efficiency:.2%}** real tokens per slot "
        f"(truncated {stats.truncated}, split {stats.split}, dropped {stats.dropped})"))
    card.append(figure_image(plots.packing_bar(stats.efficiency)))
    card.append(Table([[name, count] for name, count in samples_per_source.items()],
                      headers=["source", "samples per epoch (mixer pass)"]))


def verify_section(card, verdict: dict | None) -> None:
    if verdict is None:
        card.append(Markdown("## Logit verification\nDisabled (`verify.enabled: false`)."))
        return
    if verdict.get("skipped"):
        card.append(Markdown(f"## Logit verification\n{verdict['reason']}."))
        return
    card.append(Markdown(
        f"## Logit verification against transformers\n**{'passed' if verdict['passed'] else 'FAILED'}**: "
        f"max |diff| {verdict['max_abs_diff']:.2e}, mean {verdict['mean_abs_diff']:.2e}, "
        f"tolerance {verdict['tolerance']:.0e}"))
    card.append(Table([[c.get("name", ""), f"{c.get('max_abs_diff', float('nan')):.2e}",
                        f"{c.get('mean_abs_diff', float('nan')):.2e}"] for c in verdict.get("cases", [])],
                      headers=["case", "max |diff|", "mean |diff|"]))
    if "generation" in verdict:
        g = verdict["generation"]
        card.append(Markdown(f"Greedy generation (rollout engine vs transformers `generate`): {g['prompts']} prompts "
                             f"x {g['new_tokens']} tokens, {g['mismatched']} differ ({g['near_ties']} at near-ties)."))


def skew_section(card, report: dict | None) -> None:
    """The train/serve skew gate's verdict (None: off, or it raised before a report)."""
    if report is None:
        card.append(Markdown("## Train/serve skew gate\nNo report (off with `verify.skew_samples: 0`, or it failed: "
                             "see the step's log)."))
        return
    checked = ", ".join(f"{n} {kind}" for kind, n in sorted(report["checked"].items()))
    card.append(Markdown(
        f"## Train/serve skew gate\n**{'passed' if report['passed'] else 'FAILED'}**: the exported directory, "
        f"loaded alone by {' and '.join(report.get('serving_stacks', ['transformers']))}, rendered {checked} "
        f"as training did ({report['mismatched']} differ); "
        f"training ended answers with ids {report['end_of_turn_ids']}, the generation config stops at "
        f"{report['serving_stop_ids']}." + "".join(f"\n\n{note}" for note in report.get("notes", []))))


def teacher_section(card, spec) -> None:
    """A distillation recipe's teacher: where it is, its identity, the shared vocabulary, its
    logit verdict and, with `distill.cache`, the stored top-k."""
    ident = spec.identity
    lines = [f"## Teacher\n`{ident['reference']}` -> `{spec.model_dir}` ({spec.backend} backend), "
             f"sha256 `{ident['sha256'][:16]}`, {ident['bytes'] / 1e6:.1f} MB of weights; shares the student's "
             f"{spec.vocab_size} token ids. Prepared in {spec.seconds:.1f}s."]
    manifest = spec.cache_manifest
    if manifest:
        lines.append(f"Top-{manifest['top_k']} cache at `{spec.cache_dir}`: {manifest['num_samples']} samples, "
                     f"{manifest['num_positions']} loss positions, {manifest['bytes'] / 1e6:.1f} MB "
                     f"({manifest['bytes_per_position']} bytes per position), temperature {manifest['temperature']}.")
    card.append(Markdown("\n\n".join(lines)))
    verify_section(card, spec.verdict)


# the evaluation table's columns, in order: metric key -> (header, format); a column is shown
# when any model has the metric ("–" where one lacks it; SFT: loss and exact match; DPO adds
# preference accuracies; a reward model: pair accuracy with its standard error and the score
# margin); `pass_at_N` columns are added as they appear, a user suite's metrics are in its chart
EVAL_COLUMNS = {
    "heldout_loss": ("held-out loss", "{:.4f}"),
    "exact_match": ("exact match", "{:.1%}"),
    "numeric_match": ("numeric match", "{:.1%}"),
    "logp_accuracy": ("prefers chosen (log-prob)", "{:.1%}"),
    "reward_accuracy": ("reward accuracy", "{:.1%}"),
    "reward_margin": ("mean reward margin", "{:.3f}"),
    "pair_accuracy": ("pair accuracy", "{:.1%}"),
    "pair_accuracy_se": ("± s.e.", "{:.1%}"),
    "score_margin": ("mean score margin", "{:.3f}"),
    "heldout_reward": ("held-out reward (greedy)", "{:.4f}"),
    "heldout_success": ("success (greedy)", "{:.1%}"),
    "heldout_success_se": ("± s.e.", "{:.1%}"),
    "heldout_pass_at_k": ("pass@k (sampled)", "{:.1%}"),
    "perplexity": ("perplexity", "{:.2f}"),
    "output_length": ("mean answer tokens", "{:.1f}"),
    "truncated": ("cut at max tokens", "{:.1%}"),
    "sampled_exact_match": ("exact match (sampled)", "{:.1%}"),
    "reward_model_score": ("reward-model score", "{:.3f}"),
}


def eval_section(card, metrics: dict) -> None:
    """The metrics table: one row per model under test, a column per known metric any of them
    has, and per lm-evaluation-harness `<task>/<metric>` (its standard errors and sample
    counts left to the per-suite chart and the lineage)."""
    card.append(Markdown(f"## Evaluation: {', '.join(metrics)} (held out)"))
    passes = sorted({k for m in metrics.values() for k in m if k.startswith("pass_at_")})
    harness = sorted({k for m in metrics.values() for k in m
                      if "/" in k and not k.endswith(("_stderr", "/sample_len")) and "_stderr," not in k})
    columns = {**EVAL_COLUMNS, **{k: (k.replace("pass_at_", "pass@"), "{:.1%}") for k in passes},
               **{k: (k, "{:.3f}") for k in harness}}
    shown = [k for k in columns if any(k in m for m in metrics.values())]
    card.append(Table([[label, *(columns[k][1].format(m[k]) if k in m else "–" for k in shown)]
                       for label, m in metrics.items()],
                      headers=["model", *(columns[k][0] for k in shown)]))


def evaluation_card(card, result, models) -> None:
    """The evaluate step's card: the models under test, the metrics table, each suite's outcome
    (a failed suite with its error), a chart per suite, sample outputs."""
    if card is NO_CARD:
        return
    card.append(Markdown("## Models under test\n" + "\n".join(
        f"- **{m.label}**: `{m.model_dir}`" + (f" (registry `{m.reference}`)" if m.reference else "") for m in models)))
    eval_section(card, result.metrics)
    card.append(Markdown("## Suites"))
    card.append(Table([[s.name, s.kind, f"failed: {s.error}" if s.error else "completed", f"{s.seconds:.1f} s"]
                       for s in result.suites], headers=["suite", "kind", "outcome", "time"]))
    for suite in result.suites:
        if suite.metrics:
            card.append(figure_image(plots.suite_bars(suite.metrics, f"suite {suite.name}"), label=suite.name))
    examples_table(card, result.examples)
    card.append(Markdown("The evidently report of the outputs (tuned against base, and against the promoted model "
                         "when there is one) is this step's `report` card (`flow.py card view evaluate --id report`)."))


def pairs_section(card, stats: dict) -> None:
    """Pairs per source: kept, rejected (by reason), truncated to fit a row, tokens."""
    card.append(Markdown("## Preference pairs"))
    card.append(Table([[name, s["kept"], ", ".join(f"{k}: {v}" for k, v in s["rejected"].items()) or "none",
                        s["truncated"], s["tokens"]] for name, s in stats.items()],
                      headers=["source", "kept", "rejected", "responses truncated to fit a row", "tokens"]))


def examples_table(card, examples: list[dict]) -> None:
    """Held-out prompts with each model's prediction side by side (the first suite that
    produced examples)."""
    if not examples:
        return
    suite = examples[0].get("suite")
    by_model: dict[str, list[dict]] = {}
    for example in examples:
        if example.get("suite") == suite:
            by_model.setdefault(example["model"], []).append(example)

    def shown(e: dict) -> str:
        return f"{e['prediction']!r} {'✓' if e['correct'] else '✗'}"

    labels = list(by_model)
    first = by_model[labels[0]]
    card.append(Markdown("## Sample outputs" + (f" ({suite})" if suite else "")))
    card.append(Table([[e["prompt"], e["reference"], *(shown(by_model[label][i]) for label in labels)]
                       for i, e in enumerate(first)][:MAX_TABLE_ROWS], headers=["prompt", "reference", *labels]))


class LiveTrainingCard:
    """Loss curve, throughput and progress, refreshed at most every `refresh_s` seconds while training."""

    def __init__(self, card, total_steps: int, refresh_s: float):
        self._card = card
        if card is NO_CARD:  # nothing to draw on: every call returns at once
            return
        self._total = total_steps
        self._refresh_s = refresh_s
        self._last = 0.0
        self._history: list[dict] = []
        self._progress = ProgressBar(max=total_steps, label="training steps")
        self._summary = Markdown("Training starting...")
        self._loss = Image.from_matplotlib(plots.loss_curve([{"step": 0, "loss": 0.0}]))
        self._throughput = Image.from_matplotlib(plots.throughput_curve([{"step": 0, "tokens_per_s": 0.0}]))
        self._optimizer = Image.from_matplotlib(plots.optimizer_curves([{"step": 0, "grad_norm": 1.0, "lr": 0.0}]))
        self._health = Markdown(plots.health_summary([]))
        plt.close("all")
        for component in (Markdown("## Training (live)"), self._progress, self._summary, self._health, self._loss,
                          self._throughput, self._optimizer):
            card.append(component)
        card.refresh()

    def __call__(self, metrics: dict) -> None:
        if self._card is NO_CARD:
            return
        self._history.append(metrics)
        now = time.monotonic()
        if now - self._last < self._refresh_s and metrics["step"] < self._total:
            return
        self._last = now
        self._progress.update(metrics["step"])
        mfu = f", MFU {metrics['mfu']:.1%} (HFU {metrics['hfu']:.1%})" if "mfu" in metrics else ""
        self._summary.update(
            f"step {metrics['step']}/{self._total}: loss **{metrics['loss']:.4f}**, lr {metrics['lr']:.2e}, "
            f"grad norm {metrics['grad_norm']:.3f}, **{metrics['tokens_per_s']:.0f} real tokens/s**{mfu}")
        self._health.update(plots.health_summary(self._history))
        for image, fig in ((self._loss, plots.loss_curve(self._history)),
                           (self._throughput, plots.throughput_curve(self._history)),
                           (self._optimizer, plots.optimizer_curves(self._history))):
            image.update(fig)
            plt.close(fig)
        self._card.refresh()


ROUND_CURVES = ("reward_mean", "pass@1", "kl", "entropy", "length_mean", "zero_advantage_groups")
TIME_KEYS = ("generate", "score", "reference", "teacher", "update", "sync")


def _round_curves(history: list[dict], n: int) -> list[str]:
    names = [k for k in (*ROUND_CURVES[:2], f"pass@{n}", *ROUND_CURVES[2:]) if history and k in history[-1]]
    return names


def rounds_section(card, history: list[dict], n: int) -> None:
    """An RL run's rounds: reward, pass@k, KL, entropy, lengths per round, and the time split."""
    if card is NO_CARD:
        return
    card.append(Markdown("## RL rounds"))
    if not history:
        card.append(Markdown("No round has finished yet."))
        return
    card.append(figure_image(plots.metric_curves(history, _round_curves(history, n), "per round", x="round"),
                             label="rounds"))
    totals = {k: sum(h.get(f"time_{k}_s", 0.0) for h in history) for k in TIME_KEYS}
    whole = sum(totals.values()) or 1.0
    card.append(Table([[k, f"{v:.1f}", f"{v / whole:.0%}"] for k, v in totals.items()],
                      headers=["time in", "seconds", "share"]))
    failed = sum(h.get("reward_failed", 0) for h in history)
    card.append(Markdown(f"{len(history)} rounds; {failed} reward calls failed (excluded from the update)."))


class LiveRoundsCard:
    """The rounds of one `rl_round` task, redrawn after a round at most every `refresh_s` seconds."""

    def __init__(self, card, n: int, refresh_s: float = 10.0):
        self._card, self._n, self._refresh_s = card, n, refresh_s
        if card is NO_CARD:  # nothing to draw on: every call returns at once
            return
        self._last = 0.0
        self._history: list[dict] = []
        self._summary = Markdown("Round starting...")
        self._curves = Image.from_matplotlib(plots.metric_curves([{"round": 0, "reward_mean": 0.0}], ["reward_mean"],
                                                                 x="round"))
        plt.close("all")
        for component in (Markdown("## RL rounds (live)"), self._summary, self._curves):
            card.append(component)
        card.refresh()

    def __call__(self, result) -> None:
        if self._card is NO_CARD:
            return
        self._history.append(result.metrics)
        if time.monotonic() - self._last >= self._refresh_s:
            self.draw()

    def draw(self) -> None:
        """Redraw from every round so far (also when the task ends)."""
        if self._card is NO_CARD or not self._history:
            return
        self._last = time.monotonic()
        m = self._history[-1]
        times = ", ".join(f"{k} {m.get(f'time_{k}_s', 0.0):.2f}s" for k in TIME_KEYS)
        self._summary.update(
            f"round {m['round']}: reward **{m['reward_mean']:.3f}**, pass@1 {m['pass@1']:.3f}, "
            f"pass@{self._n} {m.get(f'pass@{self._n}', float('nan')):.3f}, KL {m.get('kl', 0.0):.4f}, "
            f"{m['samples_trained']} samples trained, {m['reward_failed']} rewards failed; {times}")
        fig = plots.metric_curves(self._history, _round_curves(self._history, self._n), x="round")
        self._curves.update(fig)
        plt.close(fig)
        self._card.refresh()
