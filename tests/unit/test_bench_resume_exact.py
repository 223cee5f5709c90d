"""bench/resume_exact.py with small settings: both SIGKILLed runs and a chain of randomly
killed runs resume bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


# Not in the background pool (tests/flow_pool.py): its kills land at wall-clock times calibrated on
# a reference run, so it must not share the cores with other runs.
@pytest.mark.slow  # nine training processes (forked from one that imported torch and transformers)
def test_killed_runs_resume_exactly_and_an_interrupted_save_leaves_the_previous_checkpoint():
    # one thread per child: the pool's flows run beside this test, and a child that got fewer
    # threads than another would sum in another order (the bench also turns dynamic threading off)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "resume_exact.py"),
         "--steps", "5", "--every", "2", "--kill-after", "3", "--kill-in-save", "4",
         "--random-kills", "2", "--random-steps", "8"],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "resume_exact" and len(result["reference_losses"]) == 5
    assert result["resumed_ok"] is True, result
    assert result["max_abs_loss_diff"] == 0 and result["max_abs_weight_diff"] == 0
    between, in_save = result["cases"]["kill_between_checkpoints"], result["cases"]["kill_during_save"]
    assert between["killed"] == "after step 3" and between["resumed_from"].endswith("step_00000002")
    assert in_save["killed"].startswith("inside save of step 4")
    assert in_save["partial_temporary_left"] and ".metadata" in in_save["partial_files"]
    assert "meta.json" not in in_save["partial_files"]
    assert in_save["complete_checkpoints"] == ["step_00000002"]
    assert in_save["previous_checkpoint_whole"] and in_save["temporary_cleaned"]
    assert in_save["resumed_from"].endswith("step_00000002")
    # a chain of processes SIGKILLed at 2 seeded random wall-clock points, each resuming the last
    chain = result["cases"]["random_kills"]["chains"][0]
    assert result["random_kills"] == 2 and len(chain["attempts"]) == 2 and sum(chain["landed"].values()) == 2
    assert chain["steps_mismatched"] == 0 and chain["max_abs_loss_diff"] == 0 and chain["max_abs_weight_diff"] == 0
    assert chain["latest_always_loadable"] and not any(a["finished_before_kill"] for a in chain["attempts"])
    assert chain["steps_reported"] >= 8  # every step of the final run, restored or trained, was compared
