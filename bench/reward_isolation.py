"""GRPO rounds whose reward function misbehaves on a few percent of samples, against the same rounds
with it behaving: user code in the reward role's worker processes (posttrain's default,
`isolation: process`) and, as the baseline, on a thread of the role's process (`isolation:
thread`: what posttrain did before, and more isolation than rewards called in the trainer's
process, as TRL calls them, have).

    python bench/reward_isolation.py [--quick] [--rounds 5] [--timeout 0.2] [--processes 8]
                                     [--rates raise=2,spin=5,exit=2,allocate=2] [--max-staleness 0] [--nice 19]

The rounds are bench/grpo_round.py's (`run_ours`: the SFT demo's model shape, random weights,
arithmetic prompts, `--prompts` x `--n` samples of `--new-tokens`, one optimizer step a round),
scored by bench/misbehaving_rewards.py's exact-answer reward, which raises, spins forever, ends
its process or allocates without bound on the samples a hash of the completion picks (`--rates`,
percent of samples). Four runs, one after the other, the same seeds:

1. `process`, behaving (rates empty), 2. `process`, misbehaving, 3. `thread`, behaving,
4. `thread`, misbehaving on `raise` and `spin` only: a sample that exits or allocates without
   bound on a thread ends or swamps the whole process (this bench's), so the baseline cannot run
   them; its spinning calls are abandoned and keep their CPU, so it runs last, and the thread
   runs measure `--baseline-rounds` rounds (each slower than the one before).

A call that spins costs its `--timeout` on one worker whatever the scheduling: `--processes`
of them are waited out at once. The default 8 waits out a round's spinning samples (5% of 16 x
8 = 6.4 on average) in one wave, as a user who expects that many hangs a round sets
`grpo.reward_processes`; with 4 the floor alone is two waves (0.4 s on a 0.42 s round). That
floor is what a synchronous round pays; `--max-staleness k` runs every round asynchronously
(`grpo.max_staleness`, behaving and misbehaving alike): the next rounds' rollouts are generated
while this one trains and scored behind their generation on a thread of their own
(`posttrain.rl.scoring_stage`), so a hanging call's timeout runs beside the next generation and
the update instead of before them (`ratio_floor` is then no floor). A call that has used a
quarter of its timeout in CPU (at most 0.1 s) goes on at `--nice` (`grpo.reward_nice`, 19: a
spinning call takes the cores the run leaves; 0: the run's own priority, always).

Progress on stderr; the LAST stdout line is one JSON object: `ratio_misbehaving_vs_behaving` (the
median of `ratio`), `ratio` (misbehaving / behaving round time, round by round, `process`) and
`ratio_thread` (the same for the baseline; null with `--no-baseline`) as {min, median, max, n},
`extra_seconds_per_round` (misbehaving - behaving, round by round), `timeout_floor_seconds_per_round`
(what the round's timed-out calls cost at the least: `ceil(timeouts / processes) x timeout`, the
hung calls waited out `--processes` at a time, nothing else) and `ratio_floor` (the behaving
round plus that floor, over the behaving round: the best ratio any scheduling of these calls
could reach at these settings),
`goal` (the median ratio <= 1.5) and `met`, `seconds_per_round` per run, the failed samples per
round by reason, and the settings.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from posttrain.config.rl_sections import USER_CODE_NICE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, spread  # noqa: E402
from grpo_round import add_round_arguments, build_workspace, run_ours  # noqa: E402

FUNCTION = "misbehaving_rewards:sometimes_misbehaves"
GOAL = 1.5


def log(message: str) -> None:
    print(f"[reward_isolation] {message}", file=sys.stderr, flush=True)


def scorer_for(isolation: str, rates: str, args):
    from posttrain.rl.rewards import RewardScorer, RewardTerm

    term = RewardTerm(FUNCTION, kwargs={"rates": rates}, timeout_s=args.timeout, isolation=isolation,
                      retry_budget_s=args.retry_budget)
    return RewardScorer([term], processes=args.processes, memory_mb=args.memory_mb, nice=args.nice)


class RecordingScorer:
    """The reward role, with the errors of each `score` call kept (`calls`)."""

    def __init__(self, scorer):
        self.scorer, self.calls = scorer, []

    def score(self, completions, records):
        scores = self.scorer.score(completions, records)
        self.calls.append(scores.errors)
        return scores

    def close(self) -> None:
        self.scorer.close()


def timeout_floor(calls: list[list], processes: int, timeout_s: float) -> list[float]:
    """Per `score` call, the least time its timed-out calls cost at all: `processes` hung calls
    waited out at once, each for `timeout_s` (`ceil(timeouts / processes)` waves)."""
    return [math.ceil(sum(1 for index, _, message in errors if index >= 0 and "timed out after" in message)
                      / processes) * timeout_s for errors in calls]


def failure_reasons(calls: list[list]) -> dict[str, float]:
    """Failed samples per round (per `score` call), by the reason their error gives."""
    counts: collections.Counter = collections.Counter()
    for errors in calls:
        for index, _, message in errors:
            if index >= 0:
                counts[message.partition(":")[0]] += 1
    return {reason: round(n / max(len(calls), 1), 2) for reason, n in sorted(counts.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(parser, "a 1-layer model, 2 rounds of 4 prompts x 4 samples")
    parser.add_argument("--timeout", type=float, default=0.2, help="the reward term's timeout_s")
    parser.add_argument("--retry-budget", type=float, default=30.0, help="the reward term's retry_budget_s")
    parser.add_argument("--processes", type=int, default=8, help="grpo.reward_processes")
    parser.add_argument("--max-staleness", type=int, default=0, help="grpo.max_staleness of every run")
    parser.add_argument("--memory-mb", type=int, default=1024, help="grpo.reward_memory_mb")
    parser.add_argument("--nice", type=int, default=USER_CODE_NICE, help="grpo.reward_nice (0: the run's priority)")
    parser.add_argument("--rates", default="raise=2,spin=5,exit=2,allocate=2",
                        help="percent of samples that raise, spin, exit, allocate")
    parser.add_argument("--no-baseline", action="store_true",
                        help="the process runs only (a smoke run: the baseline spins a core for its rounds)")
    parser.add_argument("--baseline-rounds", type=int, default=1,
                        help="measured rounds of the thread runs (after one warm-up): the misbehaving one slows "
                             "down round after round (minutes a round)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.prompts, args.n, args.new_tokens = 2, 4, 4, 4
    baseline_rates = ",".join(p for p in args.rates.split(",") if p.split("=")[0] in ("raise", "spin"))
    began = time.perf_counter()
    runs = [("process", ""), ("process", args.rates)]
    if not args.no_baseline:
        runs += [("thread", ""), ("thread", baseline_rates)]
    times, failures = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        count = args.prompts * (args.rounds + 1)
        model_dir, tokenizer, records = build_workspace(Path(tmp), "quick" if args.quick else "demo", None, count)
        for isolation, rates in runs:
            name = f"{isolation}/{'misbehaving' if rates else 'behaving'}"
            scorer = RecordingScorer(scorer_for(isolation, rates, args))
            run_args = argparse.Namespace(**{**vars(args), "rounds": args.baseline_rounds}) if isolation == "thread" \
                else args
            log(f"{name}: {run_args.rounds + 1} rounds (one a warm-up)")
            try:
                times[name], _, _ = run_ours(model_dir, tokenizer, records, args=run_args, scorer=scorer)
            finally:
                scorer.close()
            # one `score` call a round, in round order: those of rounds produced ahead of the last are left out
            calls = scorer.calls[:run_args.rounds + 1]
            failures[name] = failure_reasons(calls)
            if name == "process/misbehaving":  # the warm-up round's call left out, as its time is
                floor = timeout_floor(calls[1:], args.processes, args.timeout)
            log(f"{name}: {statistics.median(times[name]):.3f}s a round; failed samples a round {failures[name]}")
    ratio = [m / b for m, b in zip(times["process/misbehaving"], times["process/behaving"])]
    ratio_thread = [m / b for m, b in zip(times.get("thread/misbehaving", []), times.get("thread/behaving", []))]
    extra = [m - b for m, b in zip(times["process/misbehaving"], times["process/behaving"])]
    ratio_floor = [(b + f) / b for b, f in zip(times["process/behaving"], floor)]
    out = {
        "benchmark": "reward_isolation",
        "baseline": "isolation: thread (the reward role's process; a call past its timeout abandoned on a daemon "
                    "thread), misbehaving on raise and spin only",
        "ratio_misbehaving_vs_behaving": round(statistics.median(ratio), 4),
        "ratio": spread(ratio),
        "ratio_thread": spread(ratio_thread) if ratio_thread else None,
        "extra_seconds_per_round": spread(extra),
        "timeout_floor_seconds_per_round": spread(floor),
        "ratio_floor": spread(ratio_floor),
        "goal": {"ratio_misbehaving_vs_behaving": f"<= {GOAL}"},
        "met": {"ratio_misbehaving_vs_behaving": statistics.median(ratio) <= GOAL},
        "seconds_per_round": {name: spread(values) for name, values in times.items()},
        "failed_per_round": failures,
        "settings": {"rates_percent": args.rates, "baseline_rates_percent": baseline_rates, "timeout_s": args.timeout,
                     "reward_processes": args.processes, "reward_memory_mb": args.memory_mb, "reward_nice": args.nice,
                     "rounds": args.rounds,
                     "max_staleness": args.max_staleness,
                     "prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens,
                     "torch_threads": torch.get_num_threads()},
        "machine": machine(),
        "seconds": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
