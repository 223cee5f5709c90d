"""Exact resume of an RL run after hard kills: SIGKILL the whole GRPO flow mid-round, `resume`, compare.

    python bench/grpo_resume.py [--rounds 6] [--per-task 2] [--kills 3,5]
    python bench/grpo_resume.py --async [--staleness 2] [--partial] --random-kills 5 [--seed 0]

Builds a tiny workspace (a random Qwen3 with the demo tokenizer, registered as the starting
model; generated arithmetic prompts), then runs `flows/grpo_flow.py` on it:

1. uninterrupted: the reference trajectory (every round's rollouts: prompt, completion token
   ids, reward; and every optimizer step's loss);
2. killed: the same flow with `POSTTRAIN_FAULT_MODE=kill_flow`, which SIGKILLs the task and the
   local Metaflow runtime in the middle of round K (after its rollouts are scored, before the
   update: `posttrain.steps.rl`), for each K of `--kills` in turn: after each kill the run is
   `resume`d (from the run the kill left), and the next kill lands in that resumed run.

`--async` runs both with `grpo.max_staleness: --staleness` (default 2): while a round trains,
the next rounds' rollouts are being produced on another thread, so a kill lands with
rollouts in flight, and the round checkpoints hold the queue of rollouts produced ahead; `--partial` adds `grpo.partial_rollouts`
(rounds generated in segments over the rounds before them: half-generated rounds in flight).
`--random-kills N` picks N distinct rounds at random (`--seed`) in place of `--kills`, and
SIGKILLs each a random 0 to `--max-delay` seconds after that round's rollouts are scored
(`POSTTRAIN_FAULT_DELAY_S`): in its update, in the rollouts produced beside it, in a
checkpoint's save, wherever the process is then.

The last resumed run's trajectory must equal the uninterrupted one bit for bit (rounds
before a kill come from cloned tasks, the rest were recomputed from round checkpoints).
The prompt check: the prompt indices the resumed run's rounds trained, in order, must be
the prompt sampler's own order (`posttrain.rl.controller.PromptSampler` over the run's
prompts and seed: one permutation per epoch), each drawn once, none skipped, and equal the
uninterrupted run's.
Progress goes to stderr; the LAST stdout line is one JSON object: {"benchmark":
"grpo_resume", "identical", "prompts_in_sampler_order", "rounds", "kills", "kill_delays_s",
"max_staleness", "resumes", "seconds_uninterrupted", "seconds_killed_and_resumed",
"settings"}. Exit status 1 when the trajectories differ or the prompt check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FLOW = REPO / "flows" / "grpo_flow.py"
START = "grpo-bench-start"


def log(message: str) -> None:
    print(f"[grpo_resume] {message}", file=sys.stderr, flush=True)


def workspace(tmp: Path, rounds: int, per_task: int, staleness: int = 0, partial: bool = False) -> Path:
    """A registered tiny starting model and the recipe file; returns the recipe's path."""
    from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config
    from posttrain.registry.local import register_model

    paths = write_arithmetic_dataset(tmp / "corpus", num_train=200, num_heldout=0, seed=0, max_digits=2)
    tokenizer = load_tokenizer(str(build_demo_tokenizer(tmp / "tokenizer", corpus_paths=[paths["train"]],
                                                        vocab_size=256)))
    config = tiny_config("qwen3", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model_dir = save_hf_checkpoint(build_model(config, seed=0), tmp / "start", tokenizer=tokenizer)
    register_model(tmp / "registry", START, model_dir, {"recipe": "bench-start"})
    recipe = tmp / "grpo.yaml"
    recipe.write_text(f"""name: grpo-resume-bench
output_dir: {tmp / 'outputs'}
data:
  generate: {{task: arithmetic, num_train: 64, num_heldout: 8, min_digits: 1, max_digits: 2, seed: 0}}
  sources: [{{name: arithmetic, kind: jsonl, path: "${{generated}}/train.jsonl"}}]
  heldout: {{name: heldout, kind: jsonl, path: "${{generated}}/heldout.jsonl"}}
tokenizer: {{name_or_path: "registry:{START}"}}
model: {{init_from: "registry:{START}"}}
pack: {{row_length: 160}}
train: {{micro_batch_size: 4, learning_rate: 0.001, warmup_steps: 0, weight_decay: 0.0}}
grpo: {{rounds: {rounds}, rounds_per_task: {per_task}, prompts_per_round: 4, sampling: {{n: 4, max_new_tokens: 4}}, passes: 2,
        dynamic_sampling: false, max_staleness: {staleness}, partial_rollouts: {str(partial).lower()}}}
eval: {{max_examples: 8, max_new_tokens: 4, batch_size: 8}}
register: {{registry_dir: "{tmp / 'registry'}", model_name: grpo-resume-bench}}
""")
    return recipe


def run_flow(args: list[str], env: dict, cwd: Path) -> tuple[int, str, str | None]:
    """(exit status, output, run id) of `grpo_flow.py ARGS`."""
    proc = subprocess.run([sys.executable, str(FLOW), *args], capture_output=True, text=True, env=env, cwd=cwd)
    output = proc.stdout + proc.stderr
    run_id = None
    for line in output.splitlines():
        if "Workflow starting (run-id " in line:
            run_id = line.split("run-id ", 1)[1].split(")")[0]
    return proc.returncode, output, run_id


def metaflow_run(run_id: str, env: dict):
    # Metaflow reads its datastore root when first imported: point it at the runs' first
    os.environ.update({k: env[k] for k in ("METAFLOW_DATASTORE_SYSROOT_LOCAL", "METAFLOW_USER")})
    from metaflow import Run, namespace

    namespace(None)
    return Run(f"GRPOFlow/{run_id}")


def trained_prompts(run_id: str, env: dict) -> tuple[list[int], int, int]:
    """(the prompt indices of every round's groups, in order; the run's prompt count; its seed)."""
    run = metaflow_run(run_id, env)
    order = []
    tasks = sorted(run["rl_round"].tasks(), key=lambda t: t.data.rounds_done)
    for task in tasks:
        for r in task.data.rounds:
            for x in r["rollouts"]:
                if x["sample"] == 0:
                    order.append(x["prompt_index"])
    return order, len(tasks[0].data.prompts.ids), tasks[0].data.recipe.seed


def trajectory(run_id: str, env: dict) -> list:
    run = metaflow_run(run_id, env)
    out = []
    for task in sorted(run["rl_round"].tasks(), key=lambda t: t.data.rounds_done):
        for r in task.data.rounds:
            out.append((r["round"], [(x["prompt_index"], x["completion_ids"],
                                      None if math.isnan(x["reward"]) else x["reward"]) for x in r["rollouts"]],
                        [m["loss"] for m in r["train_metrics"]]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--kills", default="3,5", help="rounds to SIGKILL the run in, in order")
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="grpo.max_staleness: --staleness (rollouts produced ahead, in flight at a kill)")
    parser.add_argument("--staleness", type=int, default=2, help="grpo.max_staleness with --async")
    parser.add_argument("--partial", action="store_true", help="grpo.partial_rollouts with --async")
    parser.add_argument("--random-kills", type=int, default=0,
                        help="N rounds drawn at random (in place of --kills), each killed a random delay in")
    parser.add_argument("--max-delay", type=float, default=0.5, help="seconds, with --random-kills")
    parser.add_argument("--seed", type=int, default=0, help="of --random-kills")
    args = parser.parse_args()
    import random

    rng = random.Random(args.seed)
    if args.random_kills:
        if args.random_kills > args.rounds:
            sys.exit("--random-kills: at most --rounds kills")
        kills = sorted(rng.sample(range(1, args.rounds + 1), args.random_kills))
        delays = [round(rng.uniform(0, args.max_delay), 3) for _ in kills]
    else:
        kills = [int(k) for k in args.kills.split(",") if k]
        delays = [0.0] * len(kills)
    staleness = args.staleness if args.asynchronous else 0
    if any(not 1 <= k <= args.rounds for k in kills) or kills != sorted(set(kills)):
        sys.exit("--kills: increasing rounds within 1..--rounds")
    import torch  # noqa: F401  (before metaflow's client: its typing patch breaks later torch imports)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        recipe = workspace(tmp, args.rounds, args.per_task, staleness, args.partial and staleness >= 2)
        env = {**os.environ, "METAFLOW_USER": "bench", "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(tmp / "mf"),
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        began = time.perf_counter()
        status, output, straight = run_flow(["--config", "config", str(recipe), "run"], env, tmp)
        if status != 0:
            sys.exit(f"the uninterrupted run failed:\n{output[-3000:]}")
        seconds_straight = time.perf_counter() - began
        log(f"uninterrupted run {straight}: {seconds_straight:.0f}s")

        began = time.perf_counter()
        latest, resumes = None, 0
        for k, delay in zip(kills, delays):
            fault = {**env, "POSTTRAIN_FAULT_AT_STEP": str(k), "POSTTRAIN_FAULT_MODE": "kill_flow",
                     "POSTTRAIN_FAULT_DELAY_S": str(delay)}
            command = (["--config", "config", str(recipe), "run"] if latest is None
                       else ["resume", "--origin-run-id", latest])
            status, output, run_id = run_flow(command, fault, tmp)
            resumes += latest is not None
            # the SIGKILL takes the runtime (and its unflushed logs) with it: the hook's marker says it fired
            fired = list((tmp / "outputs").glob(f"GRPOFlow/*/rl_state/fault_injected_at_step_{k}"))
            if status == 0 or not fired:
                sys.exit(f"the kill in round {k} did not happen (exit {status}):\n{output[-3000:]}")
            latest = run_id
            log(f"run {run_id} SIGKILLed {delay}s after round {k}'s rollouts were scored")
        status, output, final = run_flow(["resume", "--origin-run-id", latest], env, tmp)
        resumes += 1
        if status != 0:
            sys.exit(f"the last resume failed:\n{output[-3000:]}")
        seconds_killed = time.perf_counter() - began
        identical = trajectory(final, env) == trajectory(straight, env)
        log(f"resumed run {final}: trajectory identical to the uninterrupted one: {identical}")
        from posttrain.rl.controller import PromptSampler

        order, num_prompts, seed = trained_prompts(final, env)
        expected = PromptSampler(num_prompts, seed).take(len(order))
        in_order = order == expected and order == trained_prompts(straight, env)[0]
        log(f"prompts trained: {len(order)} groups in the sampler's order, none twice or skipped: {in_order}")
        out = {"benchmark": "grpo_resume", "identical": identical, "prompts_in_sampler_order": in_order,
               "groups_trained": len(order), "prompts": num_prompts, "rounds": args.rounds,
               "rounds_per_task": args.per_task, "kills": kills, "kill_delays_s": delays,
               "max_staleness": staleness, "partial_rollouts": bool(args.partial and staleness >= 2),
               "resumes": resumes,
               "seconds_uninterrupted": round(seconds_straight, 1),
               "seconds_killed_and_resumed": round(seconds_killed, 1), "settings": machine()}
    print(json.dumps(out))
    sys.exit(0 if identical and in_order else 1)


if __name__ == "__main__":
    main()
