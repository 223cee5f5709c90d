"""The semantic-ID flow end to end through `metaflow.Runner`, on a tiny synthetic world and a tiny
registered text model: items get codes (collisions counted), the codes become tokens of the text
model (its old logits unchanged, its vocabulary padded to 64), it is fine-tuned on history ->
next-item conversations, and decoding constrained to the catalogue answers only real items.
One run is shared by the assertions that read it."""

from __future__ import annotations

from pathlib import Path

import pytest

# Import torch (and its typing_extensions) before metaflow's Runner.
import torch

from flow_pool import background_flow, run_flow, single_thread_env
from test_preference_flows import START_NAME, register_starting_model
from test_sft_flow import REPO_ROOT, flow_env

FLOW = REPO_ROOT / "flows" / "semantic_id_flow.py"


def recipe_yaml(tmp: Path) -> Path:
    text = f"""name: semantic-tiny
output_dir: {tmp / 'outputs'}
data:
  generate:
    task: interactions
    world: {{num_users: 300, num_items: 60, num_topics: 4, feature_dim: 8, min_length: 5, max_length: 12, seed: 0}}
  sources: [{{name: interactions, kind: jsonl, format: sequence, path: "${{generated}}/sequences.jsonl"}}]
tokenizer: {{name_or_path: "registry:{START_NAME}"}}
model: {{init_from: "registry:{START_NAME}"}}
semantic_ids: {{levels: 2, codebook_size: 6, history_items: 4, beam_width: 10, ks: [5, 10]}}
pack: {{row_length: 64, window: 32}}
train: {{max_steps: 30, micro_batch_size: 16, learning_rate: 0.005, warmup_steps: 3, log_every: 10, card_refresh_s: 600}}
checkpoint: {{every_steps: 30, keep_last: 1}}
eval: {{max_examples: 40, batch_size: 16, report: false, suites: [{{kind: heldout_loss}}, {{kind: semantic_next_item}}]}}
register: {{registry_dir: "{tmp / 'registry'}", model_name: semantic-tiny}}
production: {{cards: false}}  # this test reads no card: none is rendered (two processes a card)
"""
    path = tmp / "semantic.yaml"
    path.write_text(text)
    return path


def prepare(tmp: Path) -> Path:
    register_starting_model(tmp)  # the text model: a tiny Qwen3 with the demo tokenizer, in tmp/registry
    return tmp


@background_flow("semantic", priority=2, prepare=prepare)
def semantic_scenario(tmp: Path) -> dict:
    running = run_flow(FLOW, env=single_thread_env(flow_env()), cwd=tmp, config=[("config", str(recipe_yaml(tmp)))])
    return {"running": running, "tmp": tmp, "close": [running]}


@pytest.fixture(scope="module")
def semantic_run(flow_pool):
    run, result = flow_pool.successful_run("semantic")
    return run, result["tmp"]


@pytest.mark.slow
def test_codes_become_tokens_of_the_text_model_with_its_old_logits_unchanged(semantic_run):
    from posttrain.data.semantic_ids import SemanticIDs
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.architectures import load_hf_checkpoint
    from posttrain.registry import resolve_model_dir

    run, tmp = semantic_run
    ingest = run["ingest"].task.data
    stats = ingest.semantic_stats
    semantic = SemanticIDs.load(ingest.semantic_ids_path)
    assert len(semantic.codes) == stats["items"] == 60 and stats["collisions"] == semantic.collisions
    assert len(set(semantic.codes.values())) == 60  # every item its own tuple, collisions resolved
    chat = ingest.heldout_records[0]
    assert chat.messages[0]["role"] == "user" and chat.messages[0]["content"].startswith("<a_")
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * (len(chat.messages) // 2)
    assert semantic.parse_item(chat.messages[-1]["content"]) == ingest.heldout_cases[0].target
    # the training conversations were written as chat JSONL and streamed into shards (a reference)
    from posttrain.data.token_shards import TokenShards

    (session_source,) = ingest.session_sources
    assert session_source.format == "chat" and Path(session_source.path).is_file()
    shards = run["tokenize"].task.data.samples[session_source.name]
    with open(session_source.path, encoding="utf-8") as written:
        assert isinstance(shards, TokenShards) and 0 < len(shards) <= sum(1 for _ in written)

    start_dir = resolve_model_dir(f"registry:{START_NAME}", registry_dir=tmp / "registry")
    base_dir = run["train"].task.data.base_dir
    start, base = load_hf_checkpoint(start_dir).eval(), load_hf_checkpoint(base_dir).eval()
    tokenizer = load_tokenizer(base_dir)
    assert base.config.vocab_size == len(tokenizer) == start.config.vocab_size + len(semantic.tokens())
    assert base.config.padded_vocab_size % 64 == 0
    ids_BT = torch.randint(0, start.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        old = start.compute_logits(start(ids_BT, positions, torch.zeros_like(ids_BT)))
        new = base.compute_logits(base(ids_BT, positions, torch.zeros_like(ids_BT)))
    assert torch.equal(new[..., :start.config.vocab_size], old)  # bit for bit
    registered = Path(run["register"].task.data.model_path)
    assert SemanticIDs.load(registered / "semantic_ids.json").codes == semantic.codes  # the codes travel with it


@pytest.mark.slow
def test_constrained_decoding_answers_only_real_items_and_is_ranked_beside_the_baselines(semantic_run):
    run, _ = semantic_run
    assert run["verify"].task.data.verdict["passed"] and run["verify"].task.data.skew["passed"]
    metrics = run["evaluate"].task.data.eval_metrics
    assert set(metrics) == {"base", "tuned", "popularity", "markov"}
    for label in ("base", "tuned"):
        assert metrics[label]["valid_items_constrained"] == 1.0  # every constrained answer is a real item
        assert {"recall@5", "recall@10", "ndcg@10", "recall@10_se", "valid_items_unconstrained"} <= set(metrics[label])
    assert metrics["tuned"]["heldout_loss"] < metrics["base"]["heldout_loss"] - 0.5
    assert metrics["tuned"]["recall@10"] >= metrics["tuned"]["recall@5"]
    examples = [e for e in run["evaluate"].task.data.eval_examples if e["model"] == "tuned"]
    assert examples and all(e["prediction"].count("<a_") == 1 for e in examples)
