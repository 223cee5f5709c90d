"""The SFT flow killed in the middle of its tokenize step (task and runtime SIGKILLed, as a lost
machine would be, after the first finished part: `POSTTRAIN_FAULT_AT_PART=1`), then resumed:
the resumed step reads the finished part from the store instead of rendering it again (its
shard is not rewritten), tokenizes the rest, and the samples are exactly what tokenizing the
same data in memory gives; the run then trains and registers as any other."""

from pathlib import Path

import pytest

from flow_pool import background_flow, run_flow, single_thread_env
from posttrain.train.faults import FAULT_AT_PART_ENV, FAULT_MODE_ENV
from test_sft_flow import FLOW, TINY, flow_env


@background_flow("tokenize-kill", priority=1)
def tokenize_kill_scenario(tmp: Path) -> dict:
    env = single_thread_env({**flow_env(), FAULT_AT_PART_ENV: "1", FAULT_MODE_ENV: "kill_flow"})
    overrides = {"output_dir": str(tmp / "outputs"), "register.registry_dir": str(tmp / "registry"),
                 "data.tokenize.part_records": 100, "train.max_steps": 2, "eval.report": False,
                 "eval.suites": [{"kind": "heldout_loss"}], "train.card_refresh_s": 600}
    killed = run_flow(FLOW, env=env, cwd=tmp, config=[("config", str(TINY))], config_value=[("overrides", overrides)])
    logs = killed.stdout + killed.stderr
    if killed.status != "failed":
        return {"error": f"the killed run ended {killed.status}:\n{logs}", "close": [killed]}
    resumed = run_flow(FLOW, env=env, cwd=tmp, resume_origin=killed.run.id)
    return {"running": resumed, "killed_logs": logs, "tmp": tmp, "close": [killed, resumed]}


@pytest.mark.slow
def test_a_flow_killed_while_tokenizing_resumes_from_its_finished_shards(flow_pool):
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.steps import ingest, tokenize
    from posttrain.steps.paths import resolve_tokenizer

    run, result = flow_pool.successful_run("tokenize-kill")
    assert "error" not in result, result.get("error")
    logs = result["running"].stdout + result["running"].stderr
    assert "1 finished part read from the store, not rendered again" in logs

    data = run["tokenize"].task.data
    shards = data.samples["arithmetic"]
    directory = Path(shards.directory)
    assert len(shards.files) == 3 and (directory.parent / "fault_injected_at_part_1").exists()
    # part 0 was written by the killed run and kept; parts 1 and 2 by the resumed one, after the
    # runtime had started again (seconds later), within a fraction of a second of each other
    written = [(directory / name).stat().st_mtime for name in shards.files]
    assert written[1] - written[0] > 2 > written[2] - written[1], written

    recipe, run_dir = data.recipe, Path(run["start"].task.data.run_dir)
    tokenizer = load_tokenizer(resolve_tokenizer(recipe, run_dir))
    parts = {s.name: ingest.stream_parts(s, run_dir, "conversations", 0.0, recipe.seed, 100)
             for s in recipe.data.sources}
    in_memory = tokenize.run_parts(parts, tokenizer, recipe.tokenizer.chat_template_kwargs, recipe.data.filters,
                                   recipe.pack)
    assert [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in shards] == \
        [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in in_memory.samples["arithmetic"]]
    assert run.successful and run.data.model_uri
