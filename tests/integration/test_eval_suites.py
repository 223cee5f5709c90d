"""Evaluation suites: their config (kinds per recipe, user functions, names), the promoted model
joining the comparison, a failing suite contained, the join, and the multi-model report.

The suites run here in one process on a tiny model (`posttrain.steps.evaluate.run`); the flows'
foreach over them is exercised by the flow tests (the DPO chain in test_preference_flows)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from posttrain.config import ConfigError, load_sft_config
from posttrain.config.loader import sft_config_from_dict
from posttrain.config.schema import SuiteConfig

TESTS = Path(__file__).resolve().parents[1]
TINY = Path(__file__).resolve().parents[2] / "configs" / "sft" / "tiny.yaml"
BASE = {"name": "x", "data": {"sources": [{"name": "a", "kind": "jsonl", "path": "a.jsonl"}],
                              "heldout_fraction": 0.1},
        "tokenizer": {"name_or_path": "builtin:qwen3"}}


def test_suite_config_names_what_is_wrong():
    with pytest.raises(ConfigError, match="kind 'preference' does not apply to a sft recipe"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "preference"}]}})
    with pytest.raises(ConfigError, match="needs function: 'package.module:function'"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "python"}]}})
    with pytest.raises(ConfigError, match="function is only for kind 'python'"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "task", "function": "a:b"}]}})
    with pytest.raises(ConfigError, match="two suites are named 'task'"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "task"}, {"kind": "task", "samples": 4}]}})
    with pytest.raises(ConfigError, match="did you mean 'samples'"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "task", "sample": 4}]}})
    config = sft_config_from_dict({**BASE, "eval": {"suites": [
        {"kind": "task"}, {"kind": "task", "name": "sampled", "samples": 4, "temperature": 0.7}]}})
    assert [s.label for s in config.eval.suites] == ["task", "sampled"]


def test_default_suites_per_recipe():
    from posttrain.steps.evaluate import suites_for

    config = load_sft_config(TINY)
    assert [s.kind for s in suites_for(config)] == ["heldout_loss", "task"]


@pytest.fixture(scope="module")
def tiny_trained(tmp_path_factory):
    """The tiny SFT recipe trained a few steps: (config, tokenizer, base dir, tuned dir, held-out)."""
    from posttrain.steps import ingest, train
    from test_sft_parallel import tiny_recipe_data

    tmp = tmp_path_factory.mktemp("suites")
    config, tokenizer, samples, rows = tiny_recipe_data(tmp, TINY, **{
        "train.max_steps": 40, "checkpoint.enabled": False, "register.registry_dir": str(tmp / "registry"),
        "eval.max_examples": 6, "eval.max_new_tokens": 6})
    result = train.run(config, tokenizer, samples, rows, tmp / "run")
    heldout = ingest.run(config, tmp).heldout
    return config, tokenizer, result.base_dir, result.checkpoint_dir, heldout


def test_suites_run_contain_a_failure_and_compare_the_promoted_model(tiny_trained, monkeypatch):
    import dataclasses

    from posttrain.registry.local import register_model
    from posttrain.registry.promotion import promote
    from posttrain.steps import evaluate

    monkeypatch.syspath_prepend(str(TESTS))
    config, tokenizer, base_dir, tuned_dir, heldout = tiny_trained
    suites = [SuiteConfig("heldout_loss"), SuiteConfig("task", samples=3, temperature=1.0),
              SuiteConfig("python", name="first_token", function="user_suites:reference_token_share"),
              SuiteConfig("python", name="grader", function="user_suites:unavailable_grader"),
              SuiteConfig("python", name="missing", function="user_suites:no_such_suite")]
    config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, suites=suites))

    # nothing promoted yet: base and tuned only
    result = evaluate.run(base_dir, tuned_dir, tokenizer, heldout, config, promoted=True)
    assert set(result.metrics) == {"base", "tuned"}
    assert result.errors == {"grader": "ConnectionError: grading service unavailable",
                             "missing": "LookupError: eval suite 'missing': 'user_suites' has no callable 'no_such_suite'"}
    tuned = result.metrics["tuned"]
    assert tuned["heldout_loss"] < result.metrics["base"]["heldout_loss"]
    assert tuned["perplexity"] == pytest.approx(2.718281828 ** tuned["heldout_loss"], rel=1e-6)
    assert {"exact_match", "output_length", "truncated", "pass_at_3", "sampled_exact_match"} <= set(tuned)
    assert tuned["pass_at_3"] >= tuned["sampled_exact_match"]
    assert "first_token/reference_token_share" in tuned  # a user suite's metrics, under its name
    assert {e["model"] for e in result.examples} == {"base", "tuned"}
    assert result.report_html.count("<iframe") == 0 and "output_length" in result.report_html  # evidently's page

    # the base model put in production under the recipe's name: it joins as `promoted`
    name = config.register.model_name or config.name
    register_model(config.register.registry_dir, name, base_dir, {"recipe": "in-production"})
    promote(config.register.registry_dir, name, 1)
    result = evaluate.run(base_dir, tuned_dir, tokenizer, heldout, config, promoted=True)
    assert set(result.metrics) == {"base", "tuned", "promoted"}
    assert result.metrics["promoted"]["heldout_loss"] == pytest.approx(result.metrics["base"]["heldout_loss"])
    assert result.report_html.count("<iframe srcdoc=") == 2  # tuned against base, and against promoted
    assert "tuned (current) against promoted (reference)" in result.report_html

    no_compare = dataclasses.replace(config, eval=dataclasses.replace(config.eval, compare_promoted=False))
    assert [m.label for m in evaluate.models_under_test(base_dir, tuned_dir, no_compare)] == ["base", "tuned"]


def test_join_refuses_when_every_suite_failed_and_prefixes_named_suites():
    from posttrain.steps.evaluate import SuiteResult, join

    with pytest.raises(RuntimeError, match="every evaluation suite failed: a: ValueError: x"):
        join([SuiteResult("a", "python", error="ValueError: x")])
    joined = join([SuiteResult("task", "task", {"base": {"exact_match": 0.5}}),
                   SuiteResult("sampled", "task", {"base": {"exact_match": 0.25}}),
                   SuiteResult("broken", "python", error="KeyError: 'y'")])
    assert joined.metrics == {"base": {"exact_match": 0.5, "sampled/exact_match": 0.25}}
    assert joined.errors == {"broken": "KeyError: 'y'"}
    assert "No evaluation suite produced" in joined.report_html


def test_a_user_suite_returning_something_else_than_numbers_fails_its_suite(tiny_trained, monkeypatch):
    from posttrain.steps.eval_suites import EvalData, ModelUnderTest
    from posttrain.steps.evaluate import run_suite

    module = type(sys)("bad_suites")
    module.text = lambda model, tokenizer, data: {"score": "high"}
    module.empty = lambda model, tokenizer, data: {}
    monkeypatch.setitem(sys.modules, "bad_suites", module)
    config, tokenizer, base_dir, _, heldout = tiny_trained
    models = [ModelUnderTest("base", str(base_dir))]
    text = run_suite(SuiteConfig("python", name="t", function="bad_suites:text"), models, EvalData(chats=heldout),
                     config, tokenizer)
    assert text.error == "TypeError: eval suite 't': bad_suites:text returned non-numeric metrics {'score': 'high'}"
    empty = run_suite(SuiteConfig("python", name="e", function="bad_suites:empty"), models, EvalData(chats=heldout),
                      config, tokenizer)
    assert "expected a non-empty dict" in empty.error
    missing = run_suite(SuiteConfig("heldout_loss"), models, EvalData(), config, tokenizer)
    assert missing.error == ("ValueError: the 'heldout_loss' suite needs held-out conversations, and this recipe's "
                             "held-out data has none")


def test_reward_model_suite_scores_each_models_greedy_answers(tiny_trained, tmp_path):
    """A registered-style reward model (backbone + value head, as the reward-model recipe saves
    it) scores each model's greedy answers: the suite's mean is the built-in `reward_model`
    reward of the answers the `task` suite generated."""
    import dataclasses

    from posttrain.models.heads import RewardModel, ValueHead, save_with_head
    from posttrain.models.architectures import build_model, tiny_config
    from posttrain.rl.rewards import reward_model
    from posttrain.steps import evaluate
    from posttrain.steps.eval_suites import prompt_and_reference

    config, tokenizer, base_dir, tuned_dir, heldout = tiny_trained
    backbone = build_model(tiny_config("qwen3", vocab_size=len(tokenizer)), seed=0)
    head = ValueHead(backbone.config.hidden_size, bias=False)
    head.init_weights(0, std=0.5)
    rm_dir = save_with_head(RewardModel(backbone, head), tmp_path / "rm", tokenizer=tokenizer)
    suites = [SuiteConfig("task"), SuiteConfig("reward_model", kwargs={"model": str(rm_dir)})]
    config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, suites=suites))
    result = evaluate.run(base_dir, tuned_dir, tokenizer, heldout, config)
    assert result.errors == {}
    records = heldout[: config.eval.max_examples]
    prompts = [type("P", (), {"prompt": prompt_and_reference(r)[0]})() for r in records]
    for label in ("base", "tuned"):
        answers = [e["prediction"] for e in result.examples if e["model"] == label and e["suite"] == "task"]
        expected = reward_model(answers, prompts, model=str(rm_dir), row_length=config.pack.row_length)
        assert result.metrics[label]["reward_model_score"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
        assert result.metrics[label]["reward_model_score_se"] >= 0.0
    with pytest.raises(ConfigError, match="kind 'reward_model' needs kwargs.model"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "reward_model"}]}})
