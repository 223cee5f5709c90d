"""The sequence flow end to end through `metaflow.Runner`, on a tiny synthetic world plus a file of
broken histories: one run is shared by the assertions that read it. Bad rows are kept aside with
file and line, the item vocabulary is a tokenizer `AutoTokenizer` loads, the model trains from
scratch, passes the logit verifier and the skew gate, is ranked beside the popularity and Markov
baselines, and the registered directory alone serves next-item predictions through transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Import torch (and its typing_extensions) before metaflow's Runner.
import torch

from flow_pool import background_flow, run_flow, single_thread_env
from test_sft_flow import REPO_ROOT, flow_env

FLOW = REPO_ROOT / "flows" / "sequence_flow.py"


def recipe_yaml(tmp: Path) -> Path:
    broken = tmp / "broken.jsonl"
    broken.write_text("\n".join([
        json.dumps({"user": "x1", "ids": [1, 2, 3, 4], "timestamps": [1, 2, 3, 4]}),
        json.dumps({"user": "x2", "ids": [5, "six", 7]}),
        json.dumps({"user": "x3", "ids": [1, 2, 3], "timestamps": [30, 20, 40]}),
    ]) + "\n")
    text = f"""name: sequence-tiny
output_dir: {tmp / 'outputs'}
data:
  generate:
    task: interactions
    world: {{num_users: 500, num_items: 120, num_topics: 6, min_length: 6, max_length: 24, seed: 0}}
  sources:
    - {{name: interactions, kind: jsonl, format: sequence, path: "${{generated}}/sequences.jsonl"}}
    - {{name: broken, kind: jsonl, format: sequence, path: "{broken}"}}
model: {{arch: qwen3, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 32, max_position_embeddings: 128}}
pack: {{row_length: 16, window: 32}}
train: {{max_steps: 60, micro_batch_size: 16, learning_rate: 0.005, warmup_steps: 5, log_every: 20, card_refresh_s: 600}}
checkpoint: {{every_steps: 30, keep_last: 1}}
sequence: {{sampled_negatives: 50}}
eval: {{max_examples: 300, batch_size: 64}}
register: {{registry_dir: "{tmp / 'registry'}", model_name: sequence-tiny}}
production: {{cards: false}}  # this test reads no card: none is rendered (two processes a card)
"""
    path = tmp / "sequence.yaml"
    path.write_text(text)
    return path


@background_flow("sequence", priority=3)
def sequence_scenario(tmp: Path) -> dict:
    running = run_flow(FLOW, env=single_thread_env(flow_env()), cwd=tmp, config=[("config", str(recipe_yaml(tmp)))])
    return {"running": running, "tmp": tmp, "close": [running]}


@pytest.fixture(scope="module")
def sequence_run(flow_pool):
    run, result = flow_pool.successful_run("sequence")
    return run, result["tmp"]


@pytest.mark.slow
def test_sequence_flow_keeps_bad_rows_aside_and_builds_a_vocabulary(sequence_run):
    run, tmp = sequence_run
    ingest = run["ingest"].task.data
    assert ingest.data_counts["broken"] == {"kept": 1, "rejected": 2, "read": 3}
    reasons = {(Path(r.source).name, r.line): r.reason for r in ingest.rejected}
    assert reasons == {("broken.jsonl", 2): "ids[1]: not an integer (got str)",
                       ("broken.jsonl", 3): "timestamps[1] (20) is before timestamps[0] (30): the history is not in "
                                            "time order"}
    assert (Path(ingest.run_dir) / "rejected.jsonl").is_file()
    vocabulary = ingest.vocabulary
    assert 0 < vocabulary["items"] <= 120 and vocabulary["vocab_size"] % 64 == 0
    assert len(ingest.test_cases) == len(ingest.heldout_cases) >= 450  # every user of 3+ items holds one out
    tokenized = run["tokenize"].task.data
    stats = tokenized.tokenize_stats
    assert stats.filters["interactions"]["over_row_length"] > 0  # long histories became several windows
    # the histories streamed into shards: the artifact is a reference; every sample <bos> + an item or more
    from posttrain.data.token_shards import TokenShards

    shards = tokenized.samples["interactions"]
    assert isinstance(shards, TokenShards) and len(shards) == stats.lengths["interactions"]["samples"]
    assert all(len(s) >= 2 and s.loss_mask[0] == 0 and s.loss_mask[1:].all() for s in shards)


@pytest.mark.slow
def test_sequence_model_learns_and_is_ranked_beside_the_baselines(sequence_run):
    run, _ = sequence_run
    history = run["train"].task.data.history
    assert len(history) == 60 and history[-1]["loss"] < history[0]["loss"] - 1.0
    assert run["verify"].task.data.verdict["passed"]
    skew = run["verify"].task.data.skew
    assert skew["passed"] and skew["checked"].get("history", 0) >= 32
    metrics = run["evaluate"].task.data.eval_metrics
    assert set(metrics) == {"base", "tuned", "popularity", "markov"}
    for label in metrics:
        assert {"recall@10", "recall@10_se", "ndcg@10", "mrr", "recall@10_new", "recall@10_sampled50"} <= set(
            metrics[label]), label
    base, tuned = metrics["base"], metrics["tuned"]
    assert tuned["recall@10"] > base["recall@10"] + 3 * tuned["recall@10_se"], metrics
    assert metrics["markov"]["recall@10"] > metrics["popularity"]["recall@10"]  # the world has sequels
    assert run["evaluate"].task.data.evidently_html.lstrip().startswith("<")


@pytest.mark.slow
def test_the_registered_directory_alone_serves_next_items(sequence_run):
    """`AutoTokenizer` + `AutoModelForCausalLM` on the registered directory rank items as our model
    does, and an item the vocabulary never saw maps to `<unk>`, counted."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.data.item_vocab import ItemCodec
    from posttrain.eval.next_item import score_cases
    from posttrain.models.architectures import load_hf_checkpoint

    run, _ = sequence_run
    model_dir = run["register"].task.data.model_path
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    codec = ItemCodec(tokenizer)
    cases = run["ingest"].task.data.heldout_cases[:4]
    catalogue = run["ingest"].task.data.catalogue
    ours, _ = score_cases(load_hf_checkpoint(model_dir), codec, cases, catalogue, max_tokens=16)
    for i, case in enumerate(cases):
        ids, _ = codec.encode(case.history[-15:])
        assert tokenizer(codec.to_text(case.history[-15:])).input_ids == ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        theirs = torch.tensor([logits[codec.item_to_token[item]].item() if item in codec.item_to_token
                               else float("-inf") for item in catalogue])
        assert torch.allclose(theirs, ours[i], atol=1e-4)
        assert theirs.topk(10).indices.tolist() == ours[i].topk(10).indices.tolist()
    model = load_hf_checkpoint(model_dir)
    _, before = score_cases(model, codec, cases[:1], catalogue, max_tokens=64)
    unknown = type(cases[0])(history=[*cases[0].history, 987654], target=cases[0].target)
    _, after = score_cases(model, codec, [unknown], catalogue, max_tokens=64)
    assert after == before + 1
