"""RL on a business metric: session prompts over the synthetic world in a semantic-ID model's
codes, the simulated user's reward and the novelty term, and rollouts constrained to the
catalogue."""

import dataclasses
import json

import numpy as np
import pytest

from posttrain.config.schema import GRPOSection, WorldConfig
from posttrain.data.interactions import InteractionWorld, item_index, write_world
from posttrain.data.records import PromptRecord
from posttrain.data.semantic_ids import assign_semantic_ids
from posttrain.rl.rewards import RewardError, item_novelty, simulated_user
from posttrain.steps.semantic import session_messages

WORLD = WorldConfig(num_users=30, num_items=40, num_topics=4, feature_dim=6, min_length=5, max_length=9, seed=2)


@pytest.fixture(scope="module")
def world_and_codes(tmp_path_factory):
    out = tmp_path_factory.mktemp("world")
    world = InteractionWorld.build(WORLD)
    paths = write_world(out, world)
    rows = [json.loads(line) for line in open(paths["sequences"])]
    semantic = assign_semantic_ids(list(range(1, 41)), world.features_ID, levels=2, codebook_size=4)
    codes = semantic.save(out / "semantic_ids.json")
    return world, rows, semantic, {"world": str(out), "semantic_ids": str(codes)}


def prompt(row: dict, semantic, paths: dict) -> PromptRecord:
    history = row["ids"][:-1]
    return PromptRecord(session_messages(semantic, history[-3:]), semantic.item_text(row["ids"][-1]),
                        {"user": row["user"], "history": history, **paths}, "s", 1)


def test_the_simulated_user_scores_the_recommended_item(world_and_codes):
    world, rows, semantic, paths = world_and_codes
    record = prompt(rows[0], semantic, paths)
    probs = world.next_item_probs(0, [item_index(i) for i in record.meta["history"]])
    best, worst = int(np.argmax(probs)) + 1, int(np.argmin(probs)) + 1
    scores = simulated_user([semantic.item_text(best), f"  {semantic.item_text(worst)}", "item 3", ""],
                            [record] * 4)
    assert scores[0] == 1.0 and 0 <= scores[1] < 1.0 and scores[2:] == [0.0, 0.0]
    assert scores[1] == pytest.approx(probs[worst - 1] / probs.max())
    seen, new = record.meta["history"][-1], next(i for i in range(1, 41) if i not in record.meta["history"])
    assert item_novelty([semantic.item_text(seen), semantic.item_text(new), "nothing"], [record] * 3) == [0.0, 1.0, 0.0]
    assert item_novelty([semantic.item_text(record.meta["history"][0])], [record], window=1) == [
        float(record.meta["history"][0] != record.meta["history"][-1])]
    with pytest.raises(RewardError, match="meta to name"):
        simulated_user(["x"], [PromptRecord([{"role": "user", "content": "q"}], None, {}, "s", 1)])


def test_rollout_sampling_constrains_rollouts_to_the_catalogue(world_and_codes):
    _, _, semantic, _ = world_and_codes
    from posttrain.data.semantic_ids import TokenTrie

    trie = TokenTrie()
    trie.add([1, 2, 9], 5)
    sampling = dataclasses.replace(GRPOSection().sampling, allowed=trie, seed=3)
    assert sampling.allowed is trie and sampling.seed == 3
    assert GRPOSection().sampling.allowed is None