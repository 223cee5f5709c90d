"""Evaluate: the untrained base and the tuned model side by side on held-out data.

For each model: held-out loss (per token, assistant tokens only) and the task metric from
greedy generation through the native rollout engine (exact match of the final assistant answer). An evidently report
compares the two models' outputs (lengths, correctness). Preference recipes add the held-out
pairs: DPO their log-prob and implicit-reward accuracies (`run_pairs`); a reward model
(`run_reward`) is judged on the pairs alone: pair accuracy (chosen scored higher) with its
standard error, mean score margin and the held-out Bradley-Terry loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.config.schema import RecipeConfig
from posttrain.data.chat import end_of_turn_token_ids, render_prompt
from posttrain.data.packer import iter_batches, pack_samples
from posttrain.data.records import ChatRecord
from posttrain.eval.heldout import evaluate_loss
from posttrain.eval.metrics import exact_match
from posttrain.eval.report import build_comparison_frame, evidently_report_html
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.native import NativeEngine
from posttrain.steps import tokenize as tokenize_step
from posttrain.steps.train import pick_device
from posttrain.steps.train_model import load_for_eval


@dataclass
class EvalResult:
    metrics: dict[str, dict[str, float]]
    examples: list[dict]
    report_html: str


def prompt_and_reference(record: ChatRecord) -> tuple[list[dict], str]:
    """Everything before the last assistant turn is the prompt; that turn's content the reference."""
    last = max(i for i, m in enumerate(record.messages) if m["role"] == "assistant")
    return record.messages[:last], record.messages[last]["content"]


def run(base_dir: str, tuned_dir: str, tokenizer, heldout: list[ChatRecord], config: RecipeConfig,
        others: dict[str, tuple[str, str]] | None = None) -> EvalResult:
    """Held-out loss and exact match of the base and the tuned model (and of `others`: label ->
    `(model directory, backend)`, e.g. a distillation recipe's teacher), and an evidently
    report of the base's and the tuned model's outputs."""
    if not heldout:
        raise ValueError("evaluation needs held-out records: set data.heldout or data.heldout_fraction")
    records = heldout[: config.eval.max_examples] if config.eval.max_examples else heldout
    template_kwargs = config.tokenizer.chat_template_kwargs
    samples, _ = tokenize_step.render(records, tokenizer, template_kwargs, desc="tokenize held-out")
    rows, _ = pack_samples(samples, config.pack.row_length, tokenizer.pad_token_id, window=config.pack.window,
                           on_overflow=config.pack.on_overflow)
    prompts, references = zip(*(prompt_and_reference(r) for r in records))
    prompt_ids = [render_prompt(tokenizer, messages, **template_kwargs) for messages in prompts]
    stop_ids = set(end_of_turn_token_ids(tokenizer, **template_kwargs)) | {tokenizer.eos_token_id}
    greedy = SamplingConfig(temperature=0, max_new_tokens=config.eval.max_new_tokens, stop_token_ids=tuple(stop_ids))
    device = pick_device(config.train.device)

    metrics: dict[str, dict[str, float]] = {}
    examples: list[dict] = []
    models = [("base", base_dir, None), ("tuned", tuned_dir, None)]
    models += [(label, model_dir, backend) for label, (model_dir, backend) in (others or {}).items()]
    for label, model_dir, backend in models:
        model = load_for_eval(model_dir, config, device, backend=backend).eval()
        with torch.no_grad():
            loss = evaluate_loss(model, iter_batches(rows, config.eval.batch_size))
            engine = NativeEngine(model, max_batch_rows=config.eval.batch_size)
            outputs = [group[0].content_ids for group in engine.generate(prompt_ids, greedy)]
        del model, engine
        predictions = [tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]
        correct = [exact_match(p, r) for p, r in zip(predictions, references)]
        metrics[label] = {"heldout_loss": loss, "exact_match": sum(correct) / len(correct)}
        print(f"[evaluate] {label}: held-out loss {loss:.4f}, exact match {metrics[label]['exact_match']:.3f}")
        for messages, reference, prediction, ok, ids in zip(prompts, references, predictions, correct, outputs):
            examples.append({"model": label, "prompt": messages[-1]["content"], "reference": reference,
                             "prediction": prediction, "correct": ok, "output_length": len(ids)})
    frame = build_comparison_frame([e for e in examples if e["model"] in ("base", "tuned")])
    report_html = evidently_report_html(frame[frame.model == "base"], frame[frame.model == "tuned"])
    return EvalResult(metrics=metrics, examples=examples, report_html=report_html)


def pair_logps(model, pairs, config, tokenizer) -> torch.Tensor:
    """`model`'s response log-probabilities of `pairs`, by pair id (`reference_logps`' table)."""
    from posttrain.objectives.dpo import reference_logps

    shared = config.shared_prompt
    return reference_logps(model, pairs, config.pack.row_length, tokenizer.pad_token_id,
                           rows_per_batch=config.eval.batch_size, shared_prompt=shared, window=config.pack.window)


def preference_metrics(table: torch.Tensor, reference: torch.Tensor, pairs) -> dict[str, float]:
    """On held-out pairs, from a model's table and the reference's: how often the model gives
    the chosen response a higher summed log-probability (`logp_accuracy`), and how often its
    implicit reward margin `(c - c0) - (r - r0)` is positive (`reward_accuracy`, DPO's
    preference accuracy; 0 for the reference itself) and its mean (`reward_margin`)."""
    ids = torch.tensor([p.pair_id for p in pairs])
    c, r = table[2 * ids], table[2 * ids + 1]
    margin = (c - reference[2 * ids]) - (r - reference[2 * ids + 1])
    return {"logp_accuracy": float((c > r).double().mean()), "reward_accuracy": float((margin > 0).double().mean()),
            "reward_margin": float(margin.mean())}


def run_pairs(base_dir: str, tuned_dir: str, tokenizer, heldout_pairs, heldout_chats: list[ChatRecord],
              config: RecipeConfig) -> EvalResult:
    """A preference recipe's evaluation: `run` (held-out loss and greedy exact match of the
    chosen responses, base vs tuned, with the evidently report) plus `preference_metrics` on
    the held-out pairs for both models (the base is the reference)."""
    result = run(base_dir, tuned_dir, tokenizer, heldout_chats, config)
    device = pick_device(config.train.device)
    pairs = heldout_pairs[: config.eval.max_examples] if config.eval.max_examples else heldout_pairs
    tables = {}
    with torch.no_grad():
        for label, model_dir in (("base", base_dir), ("tuned", tuned_dir)):
            model = load_for_eval(model_dir, config, device).eval()
            tables[label] = pair_logps(model, pairs, config, tokenizer)
            del model
    for label, table in tables.items():
        result.metrics[label].update(preference_metrics(table, tables["base"], pairs))
        m = result.metrics[label]
        print(f"[evaluate] {label}: preference accuracy (log-prob) {m['logp_accuracy']:.3f}, "
              f"reward accuracy {m['reward_accuracy']:.3f}, mean margin {m['reward_margin']:.3f}")
    return result


def _last_content(messages: list[dict]) -> str:
    return messages[-1]["content"] if messages else ""


def reward_metrics(scores: torch.Tensor, pairs) -> dict[str, float]:
    """Held-out pair accuracy (chosen scored above rejected) with its binomial standard error,
    the mean score margin and the mean Bradley-Terry loss `-log s(s_c - s_r)`, from a score
    table by pair id (`posttrain.objectives.reward.score_pairs`)."""
    import math

    import torch.nn.functional as F

    ids = torch.tensor([p.pair_id for p in pairs])
    margin = scores[2 * ids] - scores[2 * ids + 1]
    accuracy = float((margin > 0).double().mean())
    return {"heldout_loss": float(-F.logsigmoid(margin.double()).mean()), "pair_accuracy": accuracy,
            "pair_accuracy_se": math.sqrt(accuracy * (1 - accuracy) / len(pairs)),
            "score_margin": float(margin.mean()), "pairs": len(pairs)}


def run_reward(base_dir: str, tuned_dir: str, tokenizer, heldout_pairs, heldout_records,
               config: RecipeConfig) -> EvalResult:
    """A reward model's evaluation: `reward_metrics` on the held-out pairs for the starting
    reward model (its new head) and the tuned one; examples list each pair's two scores, and
    the evidently report compares the models' score margins and correctness."""
    import pandas as pd

    from posttrain.objectives.reward import score_pairs

    device = pick_device(config.train.device)
    limit = config.eval.max_examples
    pairs = heldout_pairs[:limit] if limit else heldout_pairs
    by_line = {(r.source, r.line): r for r in heldout_records}
    metrics, examples, frames = {}, [], {}
    for label, model_dir in (("base", base_dir), ("tuned", tuned_dir)):
        model = load_for_eval(model_dir, config, device).eval()
        table = score_pairs(model, pairs, config.pack.row_length, tokenizer.pad_token_id,
                            rows_per_batch=config.eval.batch_size, shared_prompt=config.shared_prompt,
                            window=config.pack.window)
        del model
        metrics[label] = reward_metrics(table, pairs)
        m = metrics[label]
        print(f"[evaluate] {label}: pair accuracy {m['pair_accuracy']:.3f} +- {m['pair_accuracy_se']:.3f} "
              f"({m['pairs']} held-out pairs), mean margin {m['score_margin']:.3f}, loss {m['heldout_loss']:.4f}")
        rows = []
        for pair in pairs:
            s_c, s_r = float(table[2 * pair.pair_id]), float(table[2 * pair.pair_id + 1])
            record = by_line.get((pair.source, pair.line))
            prompt, chosen, rejected = ((_last_content(record.prompt), _last_content(record.chosen),
                                         _last_content(record.rejected)) if record is not None else ("", "", ""))
            rows.append({"margin": s_c - s_r, "correct": s_c > s_r})
            examples.append({"model": label, "prompt": prompt, "reference": chosen,
                             "prediction": f"{s_c:+.2f} vs {s_r:+.2f} for {rejected!r}", "correct": s_c > s_r,
                             "output_length": len(pair.chosen_ids)})
        frames[label] = pd.DataFrame(rows)
    report_html = evidently_report_html(frames["base"], frames["tuned"], numerical=["margin"], categorical=["correct"])
    return EvalResult(metrics=metrics, examples=examples, report_html=report_html)
