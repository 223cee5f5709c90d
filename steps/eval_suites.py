"""The built-in evaluation suites, one function per `SuiteConfig.kind` (`SUITES`).

Every suite has the same signature, `suite(models, data, ctx) -> SuiteOutput`: it measures each
model under test (`ModelUnderTest`, loaded one at a time with `ctx.load`) on the held-out data
(`EvalData`) and returns metrics by model label, example rows for the card, and report rows
(one row per model and example, with the columns the evidently report compares). Suites do
not catch their own errors: `posttrain.steps.evaluate.run_suite` turns a raised error into a
failed suite, so the other suites still run.

- `heldout_loss`: per-token loss of the reference answers (assistant tokens only) and its perplexity.
- `task`: greedy answers from the native rollout engine, exact (numeric where the reference is a
  number) match against the references, `numeric_match` (the answer's last number equals the
  reference's final answer, GSM8K style), mean answer length, the share cut at `max_new_tokens`;
  with `samples: n > 1` also n answers per prompt at `temperature`: `pass_at_n` (any correct)
  and `sampled_exact_match`.
- `preference`: on held-out pairs, log-prob and implicit-reward accuracy against the `base`
  model as the reference (DPO's preference accuracy), and the mean implicit-reward margin.
- `reward_pairs`: a reward model's held-out pair accuracy with its standard error, score margin
  and Bradley-Terry loss.
- `rewards`: the RL recipe's reward functions (a reward model among them) on greedy and sampled
  answers to the held-out prompts (`evaluate_rewards`).
- `reward_model`: each model's greedy answers scored by a registered reward model
  (`kwargs.model`, `posttrain.rl.rewards.reward_model`): `reward_model_score` (mean) and its
  standard error; the scores go into the report.
- `next_item`: a sequence model's next-item ranking of held-out users (`posttrain.eval.next_item`:
  full-ranking recall@k / NDCG@k / MRR with standard errors, the unseen-items and the sampled
  variants), beside the popularity and item-to-item Markov baselines on the same cases.
- `semantic_next_item`: a semantic-ID text model's top items by trie-constrained beam search,
  ranked as `next_item` ranks, the share of its greedy answers that are real items with and
  without the constraint, beside the same baselines and (optionally) a sequence model.
- `lm_eval`: EleutherAI lm-evaluation-harness tasks (`kwargs.tasks`: built-in, shipped in
  `configs/eval/lm_eval` or in `kwargs.include_path`) on each model, through our loaded model
  (`posttrain.eval.lm_harness`) or, with `kwargs.backend: vllm`, lm-eval's vLLM model over the
  model's directory: `<task>/<metric>` and its `<task>/<metric>_stderr` (`posttrain.eval.harness_tasks`),
  the first documents of each task as examples.
- `python`: a user's `package.module:function`, called once per model as
  `function(model, tokenizer, data, **kwargs)`, returning `{metric: number}`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from posttrain.catalog import import_callable
from posttrain.config.schema import GRPOConfig, RecipeConfig, SuiteConfig
from posttrain.data.chat import generation_stop_ids, render_prompt
from posttrain.data.packer import iter_batches, pack_samples
from posttrain.data.records import ChatRecord, PromptRecord
from posttrain.eval.heldout import evaluate_loss
from posttrain.eval.suite_data import EvalData, ModelUnderTest  # noqa: F401  (the suites' inputs)
from posttrain.eval.metrics import exact_match
from posttrain.parallel.mesh import pick_device
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.native import NativeEngine
from posttrain.rl.rewards import numeric_answer
from posttrain.steps import tokenize as tokenize_step


@dataclass
class SuiteContext:
    """What a suite needs besides the models and the data: the recipe, its tokenizer, the
    suite's own config, and `load(model)` (an evaluation-mode model on the recipe's device)."""

    config: RecipeConfig
    tokenizer: object
    suite: SuiteConfig
    load: Callable[[ModelUnderTest], torch.nn.Module]

    @property
    def max_examples(self) -> int | None:
        return self.suite.max_examples or self.config.eval.max_examples

    def head(self, items: list) -> list:
        return items[: self.max_examples] if self.max_examples else items


@dataclass
class SuiteOutput:
    """What a suite measured: `metrics` (model label -> metric -> value), `examples` (rows with
    `model`, `prompt`, `reference`, `prediction`, `correct`, `output_length`), `report_rows`
    (rows with `model` and the `report_numerical` / `report_categorical` columns)."""

    metrics: dict[str, dict[str, float]]
    examples: list[dict] = field(default_factory=list)
    report_rows: list[dict] = field(default_factory=list)
    report_numerical: list[str] = field(default_factory=list)
    report_categorical: list[str] = field(default_factory=list)


def _needs(items: list, what: str, kind: str) -> list:
    if not items:
        raise ValueError(f"the {kind!r} suite needs {what}, and this recipe's held-out data has none")
    return items


def prompt_and_reference(record: ChatRecord) -> tuple[list[dict], str]:
    """Everything before the last assistant turn is the prompt; that turn's content the reference."""
    last = max(i for i, m in enumerate(record.messages) if m["role"] == "assistant")
    return record.messages[:last], record.messages[last]["content"]


def heldout_loss(models: list[ModelUnderTest], data: EvalData, ctx: SuiteContext) -> SuiteOutput:
    config, tokenizer = ctx.config, ctx.tokenizer
    records = ctx.head(_needs(data.chats, "held-out conversations", "heldout_loss"))
    samples, _ = tokenize_step.render(records, tokenizer, config.tokenizer.chat_template_kwargs, desc="tokenize held-out")
    rows, _ = pack_samples(samples, config.pack.row_length, tokenizer.pad_token_id, window=config.pack.window,
                           on_overflow=config.pack.on_overflow)
    metrics = {}
    for model_ref in models:
        model = ctx.load(model_ref)
        with torch.no_grad():
            loss = evaluate_loss(model, iter_batches(rows, config.eval.batch_size))
        del model
        metrics[model_ref.label] = {"heldout_loss": loss, "perplexity": math.exp(min(loss, 50.0))}
        print(f"[evaluate] {model_ref.label}: held-out loss {loss:.4f} (perplexity {math.exp(min(loss, 50.0)):.2f})")
    return SuiteOutput(metrics)


def _prompts_and_references(data: EvalData, ctx: SuiteContext, kind: str):
    """The held-out prompts (messages and rendered ids), their references and the stop ids."""
    config, tokenizer = ctx.config, ctx.tokenizer
    conversations = [r for r in data.chats if hasattr(r, "messages")]  # plain text has no prompt to answer
    records = ctx.head(_needs(conversations, "held-out conversations", kind))
    template_kwargs = config.tokenizer.chat_template_kwargs
    prompts, references = zip(*(prompt_and_reference(r) for r in records))
    prompt_ids = [render_prompt(tokenizer, messages, **template_kwargs) for messages in prompts]
    stop_ids = tuple(sorted(generation_stop_ids(tokenizer, **template_kwargs)))  # where a server stops
    return list(prompts), list(references), prompt_ids, stop_ids


def _greedy(config: RecipeConfig, stop_ids: tuple[int, ...]) -> SamplingConfig:
    return SamplingConfig(temperature=0, max_new_tokens=config.eval.max_new_tokens, stop_token_ids=stop_ids)


def task(models: list[ModelUnderTest], data: EvalData, ctx: SuiteContext) -> SuiteOutput:
    config, tokenizer, suite = ctx.config, ctx.tokenizer, ctx.suite
    prompts, references, prompt_ids, stop_ids = _prompts_and_references(data, ctx, "task")
    greedy = _greedy(config, stop_ids)
    sampled = SamplingConfig(n=suite.samples, temperature=suite.temperature, max_new_tokens=config.eval.max_new_tokens,
                             stop_token_ids=stop_ids, seed=config.seed)
    output = SuiteOutput({}, report_numerical=["output_length"], report_categorical=["correct"])
    for model_ref in models:
        model = ctx.load(model_ref)
        engine = NativeEngine(model, max_batch_rows=max(config.eval.batch_size, suite.samples))
        with torch.no_grad():
            answers = [group[0] for group in engine.generate(prompt_ids, greedy)]
            groups = engine.generate(prompt_ids, sampled) if suite.samples > 1 else None
        del model, engine
        predictions = [tokenizer.decode(a.content_ids, skip_special_tokens=True) for a in answers]
        correct = [exact_match(p, r) for p, r in zip(predictions, references)]
        numeric = numeric_answer(predictions, [_Reference(r) for r in references])
        m = {"exact_match": sum(correct) / len(correct), "numeric_match": sum(numeric) / len(numeric),
             "output_length": sum(len(a.content_ids) for a in answers) / len(answers),
             "truncated": sum(a.finish_reason == "length" for a in answers) / len(answers)}
        if groups is not None:
            hits = [[exact_match(tokenizer.decode(c.content_ids, skip_special_tokens=True), ref) for c in group]
                    for group, ref in zip(groups, references)]
            m[f"pass_at_{suite.samples}"] = sum(any(h) for h in hits) / len(hits)
            m["sampled_exact_match"] = sum(sum(h) for h in hits) / (len(hits) * suite.samples)
        output.metrics[model_ref.label] = m
        shown = ", ".join(f"{k} {v:.3f}" for k, v in m.items())
        print(f"[evaluate] {model_ref.label}: {shown}")
        for messages, reference, prediction, ok, answer in zip(prompts, references, predictions, correct, answers):
            row = {"model": model_ref.label, "prompt": messages[-1]["content"], "reference": reference,
                   "prediction": prediction, "correct": ok, "output_length": len(answer.content_ids)}
            output.examples.append(row)
            output.report_rows.append({"model": model_ref.label, "output_length": row["output_length"], "correct": ok})
    return output


@dataclass(frozen=True)
class _Reference:
    reference: str  # what `rewards.numeric_answer` reads of a record


@dataclass(frozen=True)
class _Prompt:
    prompt: list[dict]  # what `rewards.reward_model` reads of a record


def reward_model(models: list[ModelUnderTest], data: EvalData, ctx: SuiteContext) -> SuiteOutput:
    from posttrain.rl import rewards as reward_functions

    config, tokenizer = ctx.config, ctx.tokenizer
    prompts, _, prompt_ids, stop_ids = _prompts_and_references(data, ctx, "reward_model")
    kwargs = {"registry_dir": config.register.registry_dir, "row_length": config.pack.row_length,
              "batch_size": config.eval.batch_size, **ctx.suite.kwargs}
    output = SuiteOutput({}, report_numerical=["score"])
    for model_ref in models:
        model = ctx.load(model_ref)
        with torch.no_grad():
            answers = [g[0] for g in NativeEngine(model, max_batch_rows=config.eval.batch_size).generate(
                prompt_ids, _greedy(config, stop_ids))]
        del model
        texts = [tokenizer.decode(a.content_ids, skip_special_tokens=True) for a in answers]
        scores = reward_functions.reward_model(texts, [_Prompt(p) for p in prompts], **kwargs)
        mean = sum(scores) / len(scores)
        spread = math.sqrt(sum((s - mean) ** 2 for s in scores) / max(len(scores) - 1, 1))
        output.metrics[model_ref.label] = {"reward_model_score": mean,
                                           "reward_model_score_se": spread / math.sqrt(len(scores))}
        print(f"[evaluate] {model_ref.label}: reward-model score {mean:.4f} over {len(scores)} answers")
        for messages, text, score in zip(prompts, texts, scores):
            output.report_rows.append({"model": model_ref.label, "score": score})
            output.examples.append({"model": model_ref.label, "prompt": messages[-1]["content"], "reference": "",
                                    "prediction": f"{text!r} ({score:+.3f})", "correct": score > 0,
                                    "output_length": len(tokenizer.encode(text, add_special_tokens=False))})
    return output


def preference(models: list[ModelUnderTest], data: EvalData, ctx: SuiteContext) -> SuiteOutput:
    from posttrain.objectives.dpo import reference_logps

    config = ctx.config
    pairs = ctx.head(_needs(data.pairs, "held-out preference pairs", "preference"))
    if models[0].label != "base":
        raise ValueError("the preference suite measures against the starting model: models[0] must be 'base'")
    tables = {}
    for model_ref in models:
        model = ctx.load(model_ref)
        with torch.no_grad():
            tables[model_ref.label] = reference_logps(
                model, pairs, config.pack.row_length, ctx.tokenizer.pad_token_id, rows_per_batch=config.eval.batch_size,
                shared_prompt=config.shared_prompt, window=config.pack.window)
        del model
    metrics = {}
    for label, table in tables.items():
        metrics[label] = m = preference_metrics(table, tables["base"], pairs)
        print(f"[evaluate] {label}: preference accuracy (log-prob) {m['logp_accuracy']:.3f}, "
              f"reward accuracy {m['reward_accuracy']:.3f}, mean margin {m['reward_margin']:.3f}")
    return SuiteOutput(metrics)


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


def reward_metrics(scores: torch.Tensor, pairs) -> dict[str, float]:
    """Held-out pair accuracy (chosen scored above rejected) with its binomial standard error,
    the mean score margin and the mean Bradley-Terry loss `-log s(s_c - s_r)`, from a score
    table by pair id (`posttrain.objectives.reward.score_pairs`)."""
    import torch.nn.functional as F

    ids = torch.tensor([p.pair_id for p in pairs])
    margin = scores[2 * ids] - scores[2 * ids + 1]
    accuracy = float((margin > 0).double().mean())
    return {"heldout_loss": float(-F.logsigmoid(margin.double()).mean()), "pair_accuracy": accuracy,
            "pair_accuracy_se": math.sqrt(accuracy * (1 - accuracy) / len(pairs)),
            "score_margin": float(margin.mean()), "pairs": len(pairs)}


def _last_content(messages: list[dict]) -> str:
    return messages[-1]["content"] if messages else ""


def reward_pairs(models: list[ModelUnderTest], data: EvalData, ctx: SuiteContext) -> SuiteOutput:
    from posttrain.objectives.reward import score_pairs

    config = ctx.config
    pairs = ctx.head(_needs(data.pairs, "held-out preference pairs", "reward_pairs"))
    by_line = {(r.source, r.line): r for r in data.pair_records}
    output = SuiteOutput({}, report_numerical=["margin"], report_categorical=["correct"])
    for model_ref in models:
        model = ctx.load(model_ref)
        with torch.no_grad():
            table = score_pairs(model, pairs, config.pack.row_length, ctx.tokenizer.pad_token_id,
                                rows_per_batch=config.eval.batch_size, shared_prompt=config.shared_prompt,
                                window=config.pack.window)
        del model
        output.metrics[model_ref.label] = m = reward_metrics(table, pairs)
        print(f"[evaluate] {model_ref.label}: pair accuracy {m['pair_accuracy']:.3f} +- {m['pair_accuracy_se']:.3f} "
              f"({m['pairs']} held-out pairs), mean margin {m['score_margin']:.3f}, loss {m['heldout_loss']:.4f}")
        for pair in pairs:
            s_c, s_r = float(table[2 * pair.pair_id]), float(table[2 * pair.pair_id + 1])
            record = by_line.get((pair.source, pair.line))
            prompt, chosen, rejected = ((_last_content(record.prompt), _last_content(record.chosen),
                                         _last_content(record.rejected)) if record is not None else ("", "", ""))
            output.report_rows.append({"model": model_ref.label, "margin": s_c - s_r, "correct": s_c > s_r})
            output.examples.append({"model": model_ref.label, "prompt": prompt, "reference": chosen,
                                    "prediction": f"{s_c:+.2f} vs {s_r:+.2f} for {rejected!r}", "correct": s_c > s_r,
                                    "output_length": len(pair.chosen_ids)})
    return output


def rewards(models: list[ModelUnderTest], data: EvalData, ctx: SuiteContext) -> SuiteOutput:
    import dataclasses

    prompts = ctx.head(_needs(data.prompts, "held-out prompts", "rewards"))
    config = dataclasses.replace(ctx.config, eval=dataclasses.replace(ctx.config.eval, max_examples=len(prompts)))
    metrics = evaluate_rewards({m.label: m.model_dir for m in models}, config, ctx.tokenizer, prompts)
    return SuiteOutput(metrics)


def evaluate_rewards(models: dict[str, str], config: GRPOConfig, tokenizer, records: list[PromptRecord],
                     samples: bool = True, per_prompt: dict[str, list[float]] | None = None) -> dict[str, dict]:
    """Each model (label -> HF directory) on the held-out prompts (the first `eval.max_examples`),
    episodes through the recipe's environment (`grpo.environment`, as in training) scored by its
    rewards: `heldout_reward` (mean over greedy answers),
    `heldout_reward_se` its standard error, `heldout_success` (the share of greedy answers
    reaching `grpo.success_threshold`, with its standard error `heldout_success_se`),
    `heldout_reward_failed`; `per_prompt`, when given, gets each model's greedy reward per
    prompt (for paired comparisons); with `samples`, also
    `heldout_pass_at_k` (the share of prompts with a success among `grpo.eval_samples` samples
    at the training temperature; `k` is `eval_samples`) and `heldout_sampled_success`. Without
    reward functions or a multi-turn environment (on-policy distillation alone) every model gets
    an empty dict."""
    from posttrain.recipes import recipe_spec
    from posttrain.rl.environments import chat_template_kwargs
    from posttrain.data.chat import ObservationRenderer
    from posttrain.rl.episodes import episode_rewards, run_episodes
    from posttrain.steps.rl import build_environment_role, catalogue_trie, reward_scorer, stop_token_ids, tokenize_prompts

    scorer = reward_scorer(config)
    g = config.grpo
    if scorer is None and g.environment.name == "single_turn":
        return {label: {} for label in models}
    limit = config.eval.max_examples or len(records)
    prompts = tokenize_prompts(records[:limit], tokenizer, config)
    stops = stop_token_ids(tokenizer, config)
    allowed = catalogue_trie(config, tokenizer)
    greedy = SamplingConfig(temperature=0, max_new_tokens=g.sampling.max_new_tokens, stop_token_ids=stops,
                            allowed=allowed)
    sampled = replace(g.sampling, n=g.eval_samples, stop_token_ids=stops, seed=config.seed, allowed=allowed)
    device = pick_device(config.train.device)
    try:
        environment = build_environment_role(config)
    except BaseException:
        if scorer is not None:
            scorer.close()
        raise
    renderer = None if environment.single_turn else ObservationRenderer(tokenizer, chat_template_kwargs(config))

    def score(engine, sampling: SamplingConfig) -> tuple[list[float], int]:
        """Episodes of every held-out prompt through the recipe's environment, as in training."""
        groups = run_episodes(engine, environment, prompts.ids, prompts.records, range(len(prompts.ids)), sampling,
                              tokenizer, renderer, config.pack.row_length, g.environment.max_turns)
        rewards, _ = episode_rewards(scorer, [e for group in groups for e in group])
        return rewards, sum(not math.isfinite(r) for r in rewards)

    out: dict[str, dict] = {}
    try:
        for label, model_dir in models.items():
            model = recipe_spec(config).load_model(config, model_dir, device).eval()
            engine = NativeEngine(model, tokenizer=tokenizer, max_batch_rows=max(config.eval.batch_size, g.eval_samples))
            rewards, failed = score(engine, greedy)
            finite = [r for r in rewards if math.isfinite(r)]
            success = [math.isfinite(r) and r >= g.success_threshold for r in rewards]
            p = sum(success) / len(success)
            mean = sum(finite) / max(len(finite), 1)
            spread = sum((r - mean) ** 2 for r in finite) / max(len(finite) - 1, 1)
            if per_prompt is not None:
                per_prompt[label] = list(rewards)
            metrics = {"heldout_reward": mean, "heldout_reward_se": math.sqrt(spread / max(len(finite), 1)),
                       "heldout_success": p,
                       "heldout_success_se": math.sqrt(p * (1 - p) / len(success)), "heldout_reward_failed": failed,
                       "heldout_prompts": len(success)}
            if samples:
                rewards, _ = score(engine, sampled)
                ok = [math.isfinite(r) and r >= g.success_threshold for r in rewards]
                k = g.eval_samples
                metrics["heldout_pass_at_k"] = sum(any(ok[i * k:(i + 1) * k]) for i in range(len(success))) / len(success)
                metrics["heldout_sampled_success"] = sum(ok) / len(ok)
                metrics["eval_samples"] = k
            out[label] = metrics
            print(f"[evaluate] {label}: held-out reward {metrics['heldout_reward']:.4f}, success "
                  f"{metrics['heldout_success']:.3f} ± {metrics['heldout_success_se']:.3f}"
                  + (f", pass@{g.eval_samples} {metrics['heldout_pass_at_k']:.3f}" if samples else ""))
            del model, engine
    finally:
        for role in (scorer, environment):  # their worker processes for user code
            if role is not None:
                role.close()
    return out


def next_item(models: list[ModelUnderTest], data: EvalData, ctx: SuiteContext) -> SuiteOutput:
    """Next-item ranking (`posttrain.eval.next_item`) of every model, each read through its own
    exported tokenizer, beside the popularity and Markov baselines fitted on the training
    histories; the per-case hits and reciprocal ranks go into the report."""
    from posttrain.data.item_vocab import ItemCodec
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.eval.next_item import baseline_scores, sampled_negatives, score_cases
    from posttrain.eval.ranking import MarkovBaseline, PopularityBaseline

    config = ctx.config
    cases = ctx.head(_needs(data.cases, "held-out next items", "next_item"))
    catalogue, ks = list(data.catalogue), tuple(config.sequence.ks)
    negatives = (sampled_negatives(cases, catalogue, config.sequence.sampled_negatives, config.seed)
                 if config.sequence.sampled_negatives else None)
    rankings = _Rankings(cases, catalogue, ks, negatives)
    for model_ref in models:
        model = ctx.load(model_ref)
        codec = ItemCodec(load_tokenizer(model_ref.model_dir))  # each model's own vocabulary
        scores_NI, oov = score_cases(model, codec, cases, catalogue, config.pack.row_length, config.eval.batch_size)
        del model
        rankings.record(model_ref.label, scores_NI, {"oov_history_items": float(oov)})
        for i, case in enumerate(cases[:5]):
            top = [catalogue[c] for c in scores_NI[i].topk(min(5, len(catalogue))).indices.tolist()]
            rankings.output.examples.append({"model": model_ref.label, "prompt": f"... {case.history[-5:]}",
                                             "reference": case.target, "prediction": top,
                                             "correct": case.target in top, "output_length": len(top)})
    for baseline in (PopularityBaseline(data.train_histories), MarkovBaseline(data.train_histories)):
        rankings.record(baseline.name, baseline_scores(baseline, cases, catalogue), {})
    return rankings.finish([m.label for m in models])


class _Rankings:
    """The rankings of several models and baselines on the same cases (`next_item`,
    `semantic_next_item`): metrics by label, one report row per label and case (reciprocal rank,
    hit at the first cutoff), and each model's paired differences from the baselines."""

    BASELINES = ("popularity", "markov")

    def __init__(self, cases, catalogue: list[int], ks: tuple[int, ...], negatives=None):
        self.cases, self.catalogue, self.ks, self.negatives = cases, catalogue, ks, negatives
        self.hit = f"hit@{ks[0]}"
        self.output = SuiteOutput({}, report_numerical=["reciprocal_rank"], report_categorical=[self.hit])
        self.per_case: dict[str, dict[str, torch.Tensor]] = {}

    def record(self, label: str, scores_NI: torch.Tensor, extra: dict) -> None:
        from posttrain.eval.next_item import evaluate_next_item

        metrics, per_case = evaluate_next_item(scores_NI, self.cases, self.catalogue, self.ks, self.negatives)
        self.output.metrics[label] = {**metrics, **extra}
        self.per_case[label] = per_case
        k = self.ks[0]
        print(f"[evaluate] {label}: recall@{k} {metrics[f'recall@{k}']:.4f} (se {metrics[f'recall@{k}_se']:.4f}), "
              f"ndcg@{k} {metrics[f'ndcg@{k}']:.4f} on {len(self.cases)} users"
              + "".join(f", {name} {value:.3f}" for name, value in extra.items()))
        self.output.report_rows += [{"model": label, "reciprocal_rank": float(per_case["rr"][i]),
                                     self.hit: float(per_case[self.hit][i]) >= 0.5} for i in range(len(self.cases))]

    def finish(self, models: list[str]) -> SuiteOutput:
        """The suite's output, with each of `models`' recall and NDCG at the first cutoff minus
        each baseline's, paired over the same cases (`..._vs_markov`, `..._vs_markov_se`)."""
        from posttrain.eval.next_item import paired_differences

        k = self.ks[0]
        for metric in (f"hit@{k}", f"ndcg@{k}"):
            for label, values in paired_differences(self.per_case, models, list(self.BASELINES), metric).items():
                self.output.metrics[label].update(values)
        for label in models:
            m = self.output.metrics[label]
            print(f"[evaluate] {label} - markov: recall@{k} {m[f'recall@{k}_vs_markov']:+.4f} "
                  f"(paired se {m[f'recall@{k}_vs_markov_se']:.4f}), ndcg@{k} {m[f'ndcg@{k}_vs_markov']:+.4f} "
                  f"(paired se {m[f'ndcg@{k}_vs_markov_se']:.4f})")
        return self.output


def semantic_next_item(models: list[ModelUnderTest], data: EvalData, ctx: SuiteContext) -> SuiteOutput:
    """A semantic-ID model's next items: the top `beam_width` catalogue items of each held-out
    prompt by trie-constrained beam search (`posttrain.rl.constrained`), ranked by their
    log-probability (items below the beams rank last), reported as the `next_item` suite
    reports rankings; the share of greedy answers that name a real item, constrained
    (`valid_items_constrained`, 1.0 by construction) and free (`valid_items_unconstrained`);
    beside the popularity and Markov baselines and, with `semantic_ids.compare_with`, a
    sequence model ranked on the same cases through its own vocabulary. Each model reads the
    codes it was trained with from its own directory (`semantic_ids.json`)."""
    from pathlib import Path

    from posttrain.data.chat import end_of_turn_token_ids
    from posttrain.data.semantic_ids import SemanticIDs
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.eval.next_item import baseline_scores
    from posttrain.eval.ranking import MarkovBaseline, PopularityBaseline
    from posttrain.rl.constrained import trie_beam_search
    from posttrain.steps.semantic import SEMANTIC_IDS_FILE

    config, section = ctx.config, ctx.config.semantic_ids
    cases = ctx.head(_needs(data.cases, "held-out next items", "semantic_next_item"))
    chats = data.chats[:len(cases)]  # the held-out conversations, one per case, in order
    catalogue, ks = list(data.catalogue), tuple(section.ks)
    column = {item: c for c, item in enumerate(catalogue)}
    kwargs = config.tokenizer.chat_template_kwargs
    rankings = _Rankings(cases, catalogue, ks)
    for model_ref in models:
        model = ctx.load(model_ref)
        tokenizer = load_tokenizer(model_ref.model_dir)
        semantic = SemanticIDs.load(Path(model_ref.model_dir) / SEMANTIC_IDS_FILE)
        end_ids = end_of_turn_token_ids(tokenizer, **kwargs) or [tokenizer.eos_token_id]
        trie = semantic.token_trie(tokenizer, end_ids)
        prompts = [render_prompt(tokenizer, chat.messages[:-1], **kwargs) for chat in chats]
        with torch.no_grad():
            beams = trie_beam_search(model, prompts, trie, section.beam_width)
        scores_NI = torch.full((len(cases), len(catalogue)), float("-inf"), dtype=torch.float64)
        for i, found in enumerate(beams):
            for item, logprob in found:
                if item in column:
                    scores_NI[i, column[item]] = logprob
        probe = prompts[:min(len(prompts), config.eval.batch_size * 4)]
        validity, texts = _valid_item_shares(model, tokenizer, semantic, trie, end_ids, probe, config.eval.batch_size)
        for chat, text, case in list(zip(chats, texts, cases))[:5]:
            rankings.output.examples.append({"model": model_ref.label, "prompt": chat.messages[-2]["content"],
                                             "reference": chat.messages[-1]["content"], "prediction": text,
                                             "correct": semantic.parse_item(text) == case.target,
                                             "output_length": semantic.levels})
        del model
        rankings.record(model_ref.label, scores_NI, validity)
    for baseline in (PopularityBaseline(data.train_histories), MarkovBaseline(data.train_histories)):
        rankings.record(baseline.name, baseline_scores(baseline, cases, catalogue), {})
    if section.compare_with:
        rankings.record("sequence_model", *_sequence_model_scores(section.compare_with, config, cases, catalogue))
    return rankings.finish([m.label for m in models])


def _valid_item_shares(model, tokenizer, semantic, trie, end_ids: list[int], prompts: list[list[int]],
                       batch_size: int) -> tuple[dict[str, float], list[str]]:
    """The share of greedy answers to `prompts` that name a catalogue item, decoded inside the
    trie and freely (`valid_items_constrained`, `valid_items_unconstrained`), and the
    constrained answers' texts."""
    engine = NativeEngine(model, max_batch_rows=batch_size)
    shares, constrained_texts = {}, []
    for name, allowed in (("constrained", trie), ("unconstrained", None)):
        greedy = SamplingConfig(temperature=0, max_new_tokens=semantic.levels + 1, stop_token_ids=tuple(end_ids),
                                allowed=allowed)
        with torch.no_grad():
            answers = [group[0] for group in engine.generate(prompts, greedy)]
        texts = [tokenizer.decode(a.content_ids, skip_special_tokens=True) for a in answers]
        shares[f"valid_items_{name}"] = sum(semantic.parse_item(t) is not None for t in texts) / len(texts)
        constrained_texts = texts if name == "constrained" else constrained_texts
    return shares, constrained_texts


def _sequence_model_scores(reference: str, config: RecipeConfig, cases, catalogue) -> tuple[torch.Tensor, dict]:
    """A sequence model (`registry:NAME[:VERSION]` or a directory) scoring the same cases through
    its own item vocabulary."""
    from posttrain.data.item_vocab import ItemCodec
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.eval.next_item import score_cases
    from posttrain.models.architectures import load_hf_checkpoint
    from posttrain.registry import resolve_model_dir

    from posttrain.steps.sequences import context_tokens

    model_dir = resolve_model_dir(reference, registry_dir=config.register.registry_dir)
    model = load_hf_checkpoint(model_dir, device=pick_device(config.train.device)).eval()
    max_tokens = context_tokens(model_dir, default=model.config.max_position_embeddings)
    scores_NI, oov = score_cases(model, ItemCodec(load_tokenizer(str(model_dir))), cases, catalogue,
                                 max_tokens=max_tokens, batch_size=config.eval.batch_size)
    print(f"[evaluate] sequence_model: {reference} ({model_dir})")
    return scores_NI, {"oov_history_items": float(oov)}


def lm_eval_harness(models: list[ModelUnderTest], data: EvalData, ctx: SuiteContext) -> SuiteOutput:
    from posttrain.eval.harness_tasks import HarnessSettings, load_tasks, run_tasks
    from posttrain.eval.lm_harness import harness_lm, vllm_lm

    config, tokenizer, suite = ctx.config, ctx.tokenizer, ctx.suite
    settings = HarnessSettings.from_kwargs(suite.kwargs, label=suite.label, batch_size=config.eval.batch_size)
    loaded = load_tasks(settings, suite.label)
    template_kwargs = config.tokenizer.chat_template_kwargs
    output = SuiteOutput({})
    for model_ref in models:
        model = None
        if settings.backend == "vllm":
            lm = vllm_lm(model_ref.model_dir, batch_size=settings.batch_size, max_length=settings.max_length,
                         max_gen_toks=settings.max_gen_toks, seed=config.seed, chat_template_kwargs=template_kwargs,
                         model_args=settings.model_args)
        else:
            model = ctx.load(model_ref)
            lm = harness_lm(model, tokenizer, batch_size=settings.batch_size, max_length=settings.max_length,
                            max_gen_toks=settings.max_gen_toks, seed=config.seed, chat_template_kwargs=template_kwargs)
        with torch.no_grad():
            result = run_tasks(lm, loaded, settings, ctx.max_examples)
        del lm, model
        output.metrics[model_ref.label] = result.metrics
        shown = ", ".join(f"{k} {v:.3f}" for k, v in result.metrics.items() if not k.endswith("_stderr"))
        print(f"[evaluate] {model_ref.label}: {suite.label} {shown}")
        for example in result.examples:
            output.examples.append({"model": model_ref.label, **example, "output_length": len(
                tokenizer.encode(example["prediction"], add_special_tokens=False))})
    return output


def python(models: list[ModelUnderTest], data: EvalData, ctx: SuiteContext) -> SuiteOutput:
    suite = ctx.suite
    function = import_callable(suite.function, f"eval suite {suite.label!r}")
    limited = EvalData(chats=ctx.head(data.chats), pairs=ctx.head(data.pairs), pair_records=data.pair_records,
                       prompts=ctx.head(data.prompts), cases=ctx.head(data.cases),
                       train_histories=data.train_histories, catalogue=data.catalogue)
    metrics = {}
    for model_ref in models:
        model = ctx.load(model_ref)
        with torch.no_grad():
            values = function(model, ctx.tokenizer, limited, **suite.kwargs)
        del model
        if not isinstance(values, dict) or not values:
            raise TypeError(f"eval suite {suite.label!r}: {suite.function} returned {type(values).__name__}, "
                            "expected a non-empty dict of metric name -> number")
        bad = {k: v for k, v in values.items() if not isinstance(k, str) or isinstance(v, bool)
               or not isinstance(v, (int, float))}
        if bad:
            raise TypeError(f"eval suite {suite.label!r}: {suite.function} returned non-numeric metrics {bad}")
        metrics[model_ref.label] = {k: float(v) for k, v in values.items()}
        print(f"[evaluate] {model_ref.label}: {suite.label} {metrics[model_ref.label]}")
    return SuiteOutput(metrics)


SUITES: dict[str, Callable[[list[ModelUnderTest], EvalData, SuiteContext], SuiteOutput]] = {
    "heldout_loss": heldout_loss, "task": task, "preference": preference, "reward_pairs": reward_pairs,
    "rewards": rewards, "reward_model": reward_model, "next_item": next_item,
    "semantic_next_item": semantic_next_item, "lm_eval": lm_eval_harness, "python": python,
}
