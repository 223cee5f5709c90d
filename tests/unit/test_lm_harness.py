"""lm-evaluation-harness on our models (posttrain.eval.lm_harness, posttrain.eval.harness_tasks,
suite kind `lm_eval`): the scorer's log-likelihoods and greedy flags equal a direct forward of
each sequence alone (batched, padded, truncated, with an empty context), rolling windows
predict every token once, generation stops at the `until` strings; the real lm-eval runs the
shipped demo tasks offline from any working directory and its accuracy is the one our own
log-likelihoods give; the suite measures each model separately; its config errors name the
suite and the key."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.config.loader import recipe_config_from_dict, sft_config_from_dict
from posttrain.config.schema import SuiteConfig

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "configs" / "eval" / "lm_eval"
BASE = {"name": "x", "data": {"sources": [{"name": "a", "kind": "jsonl", "path": "a.jsonl"}],
                              "heldout_fraction": 0.1},
        "tokenizer": {"name_or_path": "builtin:qwen3"}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Qwen3 with the demo tokenizer, saved: (model, tokenizer, directory)."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import save_tiny_demo_model

    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.architectures import load_hf_checkpoint

    model_dir = save_tiny_demo_model(tmp_path_factory.mktemp("lm_harness"))
    return load_hf_checkpoint(model_dir).eval(), load_tokenizer(str(model_dir)), model_dir


def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Log-probabilities `[len(ids) - 1, V]` of each next token of `ids`, one unpadded forward."""
    ids_BT = torch.tensor([ids[:-1]])
    with torch.no_grad():
        hidden_BTD = model(ids_BT, torch.arange(ids_BT.shape[1])[None], torch.zeros_like(ids_BT))
        return model.compute_logits(hidden_BTD)[0].float().log_softmax(-1)


def direct_score(model, context: list[int], continuation: list[int], max_length: int = 10_000) -> tuple[float, bool]:
    whole = (context + continuation)[-(max_length + 1):]
    logprobs_TV = direct_logprobs(model, whole)[-len(continuation):]
    targets = torch.tensor(continuation)
    return (float(logprobs_TV.gather(1, targets[:, None]).sum()),
            bool((logprobs_TV.argmax(-1) == targets).all()))


def test_loglikelihood_equals_a_direct_forward_of_each_sequence(tiny):
    from posttrain.eval.lm_harness import ModelScorer

    model, tokenizer, _ = tiny
    scorer = ModelScorer(model, tokenizer, batch_size=3)
    requests = [("What is 12 + 30?", " 42"), ("What is 7 - 2? ", "5"), ("", "What is 1 + 1?"),
                ("Compute 91 - 45.", " 46"), ("12 + 3 =", " 15 and more words here"), ("   ", "8")]
    got = scorer.loglikelihood(requests)
    for (context, continuation), (logprob, greedy) in zip(requests, got):
        context_ids, continuation_ids = scorer.pair_ids(context, continuation)
        assert continuation_ids, (context, continuation)
        want_logprob, want_greedy = direct_score(model, context_ids, continuation_ids)
        assert logprob == pytest.approx(want_logprob, abs=1e-4), (context, continuation)
        assert greedy == want_greedy
    # the trailing space of a context moves to the continuation; an empty context is the prefix token
    assert scorer.pair_ids("What is 7 - 2? ", "5")[1] == scorer.pair_ids("What is 7 - 2?", " 5")[1]
    assert scorer.pair_ids("", "7") == ([tokenizer.eos_token_id], tokenizer.encode("7", add_special_tokens=False))

    # greedy: the model's own argmax continuation is greedy, one changed token is not
    context_ids = tokenizer.encode("What is 12 + 30?", add_special_tokens=False)
    ids = list(context_ids)
    for _ in range(3):
        ids.append(int(direct_logprobs(model, ids + [0])[-1].argmax()))
    argmax_continuation = ids[len(context_ids):]
    other = [argmax_continuation[0], (argmax_continuation[1] + 1) % len(tokenizer), argmax_continuation[2]]
    (_, greedy), (_, not_greedy) = scorer.score_ids([(context_ids, argmax_continuation), (context_ids, other)])
    assert greedy and not not_greedy


def test_a_long_request_keeps_its_last_tokens_and_a_too_long_continuation_is_refused(tiny):
    from posttrain.eval.lm_harness import ModelScorer

    model, tokenizer, _ = tiny
    scorer = ModelScorer(model, tokenizer, batch_size=2, max_length=8)
    context = tokenizer.encode("What is 12 + 30? What is 7 - 2? Compute 91 - 45.", add_special_tokens=False)
    continuation = tokenizer.encode(" 46", add_special_tokens=False)
    assert len(context) > 8
    (logprob, greedy), = scorer.score_ids([(context, continuation)])
    assert (logprob, greedy) == pytest.approx(direct_score(model, context, continuation, max_length=8), abs=1e-4)
    with pytest.raises(ValueError, match="does not fit max_length 8"):
        scorer.score_ids([(context[:2], context[:9])])


def test_rolling_windows_predict_every_token_once_within_max_length(tiny):
    from posttrain.eval.lm_harness import ModelScorer

    model, tokenizer, _ = tiny
    text = "What is 12 + 30? 42. Compute 91 - 45. 46. What is 7 - 2? 5."
    tokens = tokenizer.encode(text, add_special_tokens=False)
    for max_length in (4, 7, len(tokens) + 5):
        scorer = ModelScorer(model, tokenizer, max_length=max_length)
        windows = scorer.rolling_windows(tokens)
        assert [t for _, continuation in windows for t in continuation] == tokens
        for context, continuation in windows:
            assert len(context) + len(continuation) - 1 <= max_length and context
        # each window after the first sees max_length tokens
        assert all(len(c) + len(t) - 1 == max_length for c, t in windows[1:])
        expected = sum(direct_score(model, c, t)[0] for c, t in windows)
        assert scorer.loglikelihood_rolling([text])[0] == pytest.approx(expected, abs=1e-4)
    whole = ModelScorer(model, tokenizer).loglikelihood_rolling([text])[0]
    logprobs_TV = direct_logprobs(model, [tokenizer.eos_token_id, *tokens])
    assert whole == pytest.approx(float(logprobs_TV.gather(1, torch.tensor(tokens)[:, None]).sum()), abs=1e-4)


def test_generate_until_is_greedy_and_stops_at_the_first_until_string(tiny):
    from posttrain.eval.lm_harness import ModelScorer

    model, tokenizer, _ = tiny
    scorer = ModelScorer(model, tokenizer, batch_size=2)
    prompts = ["What is 12 + 30?", "Compute 91 - 45."]
    free = scorer.generate_until([(p, {"until": [], "max_gen_toks": 8}) for p in prompts])
    for prompt, text in zip(prompts, free):  # the model's argmax, token by token
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        new = []
        for _ in range(8):
            token = int(direct_logprobs(model, ids + new + [0])[-1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
        assert text == tokenizer.decode(new, skip_special_tokens=True)
    stop = free[0][len(free[0]) // 2:len(free[0]) // 2 + 2]
    assert stop.strip(), free
    cut, = scorer.generate_until([(prompts[0], {"until": [stop, "never"], "max_gen_toks": 8})])
    assert cut == free[0][:free[0].index(stop)]
    short, = scorer.generate_until([(prompts[0], {"until": "never", "max_gen_toks": 2})])
    assert free[0].startswith(short) and len(tokenizer.encode(short, add_special_tokens=False)) <= 2


def test_lm_eval_runs_the_shipped_tasks_offline_and_agrees_with_our_loglikelihoods(tiny, tmp_path, monkeypatch):
    from posttrain.eval.harness_tasks import HarnessSettings, load_tasks, run_tasks
    from posttrain.eval.lm_harness import ModelScorer, harness_lm

    model, tokenizer, _ = tiny
    monkeypatch.chdir(tmp_path)  # the task's data file is found beside its YAML, not here
    settings = HarnessSettings.from_kwargs({"tasks": ["arith_demo", "arith_demo_gen"], "batch_size": 4})
    loaded = load_tasks(settings)
    result = run_tasks(harness_lm(model, tokenizer, batch_size=4), loaded, settings, limit=12)
    metrics = result.metrics
    assert {"arith_demo/acc", "arith_demo/acc_stderr", "arith_demo_gen/exact_match"} <= set(metrics), metrics

    docs = [json.loads(line) for line in (SHIPPED / "arith_demo.jsonl").read_text().splitlines()][:12]
    scorer = ModelScorer(model, tokenizer)
    hits = []
    for doc in docs:
        scores = [s for s, _ in scorer.loglikelihood([(doc["question"], " " + c) for c in doc["choices"]])]
        hits.append(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    assert metrics["arith_demo/acc"] == pytest.approx(sum(hits) / len(hits))
    answers = scorer.generate_until([(doc["question"], {"until": ["\n", "<|im_end|>"], "max_gen_toks": 4})
                                     for doc in docs])
    assert metrics["arith_demo_gen/exact_match"] == pytest.approx(
        sum(a.strip() == doc["answer"] for a, doc in zip(answers, docs)) / len(docs))
    shown = [e for e in result.examples if e["task"] == "arith_demo"]
    assert [e["reference"] for e in shown] == [d["answer"] for d in docs[:len(shown)]]
    assert [e["correct"] for e in shown] == hits[:len(shown)]
    assert [e["prompt"] for e in shown] == [d["question"] for d in docs[:len(shown)]]


def test_a_local_task_directory_with_relative_data_files(tiny, tmp_path, monkeypatch):
    """A task of the user's own (`include_path`), its data named relative to its YAML, loads
    from elsewhere; with the chat template the question is the user turn."""
    from posttrain.eval.harness_tasks import HarnessSettings, load_tasks, run_tasks
    from posttrain.eval.lm_harness import harness_lm

    model, tokenizer, _ = tiny
    tasks = tmp_path / "my_tasks"
    (tasks / "data").mkdir(parents=True)
    shutil.copy(SHIPPED / "arith_demo.jsonl", tasks / "data" / "sums.jsonl")
    text = (SHIPPED / "arith_demo.yaml").read_text().replace("task: arith_demo", "task: my_sums")
    (tasks / "my_sums.yaml").write_text(text.replace("test: arith_demo.jsonl", "test: data/sums.jsonl"))
    monkeypatch.chdir(REPO)
    settings = HarnessSettings.from_kwargs({"tasks": ["my_sums"], "include_path": "my_tasks",
                                            "apply_chat_template": True}, base_dir=tmp_path)
    assert settings.include_path == tasks.resolve()
    result = run_tasks(harness_lm(model, tokenizer), load_tasks(settings), settings, limit=3)
    assert set(result.metrics) >= {"my_sums/acc"}
    assert result.examples[0]["prompt"].startswith("<|im_start|>user\nWhat is")  # the chat template rendered it
    with pytest.raises(ValueError, match="kwargs.include_path 'nowhere' is not a directory"):
        HarnessSettings.from_kwargs({"tasks": ["my_sums"], "include_path": "nowhere"}, base_dir=tmp_path)


def test_the_suite_measures_each_model_on_its_own(tiny, tmp_path):
    """Kind `lm_eval` through `run_suite` (as a flow's branch runs it): two models from the same
    directory get the same numbers, the base twice in a row included (no state carried over)."""
    from posttrain.steps.eval_suites import EvalData, ModelUnderTest
    from posttrain.steps.evaluate import join, run_suite

    _, tokenizer, model_dir = tiny
    config = sft_config_from_dict({**BASE, "eval": {"batch_size": 4}})
    suite = SuiteConfig("lm_eval", kwargs={"tasks": ["arith_demo"], "num_fewshot": 2}, max_examples=8)
    models = [ModelUnderTest("base", str(model_dir)), ModelUnderTest("tuned", str(model_dir))]
    result = run_suite(suite, models, EvalData(), config, tokenizer)
    assert result.error is None
    assert set(result.metrics) == {"base", "tuned"}
    assert result.metrics["base"] == result.metrics["tuned"]
    prompts = {label: [e["prompt"] for e in result.examples if e["model"] == label] for label in ("base", "tuned")}
    assert prompts["base"] == prompts["tuned"] and prompts["base"][0].count("What is") == 3  # the same 2 shots
    assert result.metrics["base"]["arith_demo/sample_len"] == 8
    assert {e["model"] for e in result.examples} == {"base", "tuned"} and all(e["suite"] == "lm_eval"
                                                                           for e in result.examples)
    joined = join([result], report=False)  # the suite's keys go into the table as they are
    assert "arith_demo/acc" in joined.metrics["tuned"]
    missing = run_suite(SuiteConfig("lm_eval", name="typo", kwargs={"tasks": ["arith_dmo"]}), models, EvalData(),
                        config, tokenizer)
    assert missing.error.startswith("LookupError: eval suite 'typo': no lm-eval task, group or tag named 'arith_dmo'; "
                                    "did you mean 'arith_demo'")


def test_lm_eval_suite_config_names_the_suite_and_the_key():
    with pytest.raises(ConfigError, match="eval suite 'lm_eval': kind 'lm_eval' needs kwargs.tasks"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "lm_eval"}]}})
    with pytest.raises(ConfigError, match="eval suite 'bench': kind 'lm_eval' needs kwargs.tasks to be a non-empty"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "lm_eval", "name": "bench",
                                                            "kwargs": {"tasks": "arith_demo"}}]}})
    with pytest.raises(ConfigError, match="unknown kwargs.num_fewshots for kind 'lm_eval'; did you mean 'num_fewshot'"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "lm_eval",
                                                            "kwargs": {"tasks": ["a"], "num_fewshots": 5}}]}})
    with pytest.raises(ConfigError, match="kwargs.backend to be 'model'"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "lm_eval", "kwargs": {"tasks": ["a"],
                                                                                         "backend": "hf"}}]}})
    with pytest.raises(ConfigError, match="kwargs.batch_size to be an int >= 1"):
        sft_config_from_dict({**BASE, "eval": {"suites": [{"kind": "lm_eval", "kwargs": {"tasks": ["a"],
                                                                                         "batch_size": 0}}]}})
    from posttrain.config.schema import RECIPES

    suites = [{"kind": "lm_eval", "kwargs": {"tasks": ["arith_demo"], "num_fewshot": 2, "backend": "vllm"},
               "max_examples": 50}]
    config = sft_config_from_dict({**BASE, "eval": {"suites": suites}})
    assert config.eval.suites[0].kwargs["num_fewshot"] == 2 and config.eval.suites[0].max_examples == 50
    assert all("lm_eval" in RECIPES[r].suites for r in ("sft", "dpo", "kto", "orpo", "distill", "grpo"))  # chat recipes
    with pytest.raises(ConfigError, match="kind 'lm_eval' does not apply to a rm recipe"):
        recipe_config_from_dict({**BASE, "eval": {"suites": suites}}, "rm")


def test_without_lm_eval_the_error_names_the_extra(monkeypatch):
    from posttrain.eval.harness_tasks import HarnessSettings, load_tasks
    from posttrain.eval.lm_harness import require_lm_eval

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"kind lm_eval needs the eval extra: pip install 'posttrain\[eval\]'"):
        require_lm_eval()
    with pytest.raises(ImportError, match="needs the eval extra"):
        load_tasks(HarnessSettings.from_kwargs({"tasks": ["arith_demo"]}))


def test_the_vllm_backend_without_vllm_says_so(tiny, monkeypatch):
    """`backend: vllm` hands the model directory to lm-eval's own vLLM model; without vLLM the
    suite fails with a sentence saying so (the other suites would still run)."""
    from posttrain.steps.eval_suites import EvalData, ModelUnderTest
    from posttrain.steps.evaluate import run_suite

    monkeypatch.setitem(sys.modules, "vllm", None)  # as where vLLM is not installed (its own virtualenv)
    _, tokenizer, model_dir = tiny
    config = sft_config_from_dict(BASE)
    suite = SuiteConfig("lm_eval", kwargs={"tasks": ["arith_demo"], "backend": "vllm",
                                           "model_args": {"gpu_memory_utilization": 0.5}})
    result = run_suite(suite, [ModelUnderTest("base", str(model_dir))], EvalData(), config, tokenizer)
    assert result.error.startswith("ImportError: kind lm_eval with kwargs.backend 'vllm' needs vLLM installed")
