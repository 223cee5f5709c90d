"""User code in worker processes (`posttrain.rl.user_code`): a call that raises, hangs, exits its
process, segfaults or allocates without bound fails alone, with its reason, and the workers go
on answering the next calls."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from posttrain.rl import forkserver
from posttrain.rl.user_code import UserCodeError, UserCodeWorkers

FN = "misbehaving_code:misbehave"


@pytest.fixture
def workers():
    with UserCodeWorkers(num_workers=2, memory_mb=256) as pool:  # a low cap: reached in milliseconds
        yield pool


def test_a_well_behaved_call_returns_its_json_value(workers):
    assert workers.call("misbehaving_code:echo", ([1, 2.5],), {"k": "v"}, timeout_s=30) == {
        "doubled": [2, 5.0], "kwargs": {"k": "v"}}


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads a worker's CPU time from /proc")
def test_a_call_that_uses_the_cpu_goes_on_at_the_pools_nice_and_its_worker_is_replaced():
    """A call of a few milliseconds keeps the run's priority (a busy machine cannot starve it
    into a timeout); one past `NICE_AFTER_CPU_S` of CPU goes on at nice 19 (the RL recipe's
    `grpo.reward_nice`), its session's autogroup too where the kernel has them (a worker's
    session is its own, and would otherwise weigh as much as the whole run's); its worker is
    then replaced, so the next call starts at the run's priority again."""
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    with UserCodeWorkers(num_workers=1, nice=19) as pool:
        quick = pool.call("misbehaving_code:cpu_priority", ([],), timeout_s=30)
        busy = pool.call("misbehaving_code:cpu_priority", ([],), {"spin_s": 0.3}, timeout_s=30)
        after = pool.call("misbehaving_code:cpu_priority", ([],), timeout_s=30)
        assert pool.lowered == 1 and pool.restarts == 0
    assert quick["nice"] == ours and after["nice"] == ours
    assert busy["nice"] == max(19, ours)
    if busy["autogroup"] is not None:
        assert busy["autogroup"] == 19 and quick["autogroup"] == after["autogroup"] == 0
    with UserCodeWorkers(num_workers=1, nice=0) as pool:  # 0: the run's priority, always
        assert pool.call("misbehaving_code:cpu_priority", ([],), {"spin_s": 0.3}, timeout_s=30)["nice"] == ours
        assert pool.lowered == 0
    with pytest.raises(ValueError, match="nice value in 0..19"):
        UserCodeWorkers(num_workers=1, nice=20)


def test_a_session_nice_change_refused_as_too_soon_is_tried_again(monkeypatch):
    """Without CAP_SYS_ADMIN, Linux refuses (EAGAIN) an autogroup nice change within 0.1 s of the
    last: the pool tries again then, so the workers' group does not stay low while a call that
    was not lowered runs. (The kernel's refusal is simulated: this machine's tests run as root.)"""
    from posttrain.rl import user_code

    real, attempts = user_code._set_session_nice, []

    def refuse_the_first_return(pid, nice):
        attempts.append((nice, time.monotonic()))
        if nice == 0 and sum(n == 0 for n, _ in attempts) == 1:
            return "later"
        return real(pid, nice)

    monkeypatch.setattr(user_code, "_set_session_nice", refuse_the_first_return)
    with UserCodeWorkers(num_workers=2, nice=19) as pool:
        # two calls that use the CPU, both lowered (the group goes to 19); as the first ends, a
        # call that waits without the CPU (never lowered) starts beside the second
        spin = ("misbehaving_code:cpu_priority", ([],), {"spin_s": 0.3})
        results = pool.map([spin, spin, ("misbehaving_code:misbehave", (["sleep:0.5"],), {})], timeout_s=30)
        assert pool._session_nice == 0
    assert [r["nice"] for r in results[:2]] == [19, 19] and results[2] == [len("sleep:0.5")]
    back = [t for n, t in attempts if n == 0]
    assert [n for n, _ in attempts][:1] == [19] and len(back) == 2
    assert back[1] - back[0] >= user_code.SESSION_RETRY_S * 0.9


@pytest.mark.parametrize("item, reason, message", [
    ("raise", "raised", "ConnectionError: grader unavailable"),
    ("spin", "timeout", "timed out after 1s (worker killed)"),
    ("exit", "died", "exited with status 7"),
    ("segfault", "died", "killed by signal 11"),
    ("allocate", "memory", "MemoryError"),
    ("object", "raised", "TypeError: object is not JSON"),
])
def test_each_misbehaviour_fails_its_call_with_its_reason_and_the_workers_go_on(workers, item, reason, message):
    with pytest.raises(UserCodeError) as failed:
        workers.call(FN, (["ok", item],), timeout_s=1 if item == "spin" else 30)
    assert failed.value.reason == reason and message in failed.value.message
    assert workers.call(FN, (["fine", "x"],), timeout_s=30) == [4, 1]  # the next call is answered


def test_a_batch_of_calls_fails_only_the_misbehaving_ones(workers):
    items = ["a", "raise", "bb", "spin", "ccc", "exit", "dddd", "allocate", "eeeee", "segfault", "ffffff"]
    results = workers.map([(FN, ([item],), {}) for item in items], timeout_s=2)
    reasons = {i: r.reason for i, r in enumerate(results) if isinstance(r, UserCodeError)}
    assert reasons == {1: "raised", 3: "timeout", 5: "died", 7: "memory", 9: "died"}
    assert [r for r in results if not isinstance(r, UserCodeError)] == [[1], [2], [3], [4], [5], [6]]
    assert workers.restarts == 4  # spin, exit, allocate, segfault: each worker replaced once


def test_a_hanging_call_holds_its_own_worker_while_the_others_drain_the_queue(workers):
    items = ["spin"] + ["x" * i for i in range(1, 40)]
    start = time.monotonic()
    results = workers.map([(FN, ([item],), {}) for item in items], timeout_s=1.0)
    assert time.monotonic() - start < 1.9  # one timeout, not one per chunk or per wave
    assert isinstance(results[0], UserCodeError) and results[0].reason == "timeout"
    assert results[1:] == [[i] for i in range(1, 40)]


def test_workers_start_again_as_fresh_interpreters_when_the_fork_server_ends(workers):
    assert workers.call("misbehaving_code:echo", ([1],), timeout_s=30)["doubled"] == [2]
    assert isinstance(workers._starter, forkserver.ForkServer)
    pids = [pid for w in workers.workers if (pid := w.starter.pid(w.process)) is not None]  # None: already reaped
    workers._starter.process.kill()  # its workers end with it (their parent-death signal)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)  # none lives on as an orphan (e.g. forked just before the kill)
    assert workers.call("misbehaving_code:echo", ([3],), timeout_s=30)["doubled"] == [6]
    assert isinstance(workers._starter, forkserver.FreshInterpreters)
    with pytest.raises(UserCodeError, match="exited with status 7"):
        workers.call(FN, (["exit"],), timeout_s=30)


def test_a_worker_whose_parent_ended_before_it_ran_ends_at_once():
    """A worker forked just before its fork server was killed runs after its parent is gone: it
    must not read its parent then (it would read the process it was orphaned to and live on)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    (read_fd, write_fd), to_worker, from_worker = forkserver.pipes()
    worker = subprocess.Popen([sys.executable, "-m", "posttrain.rl.user_code", "worker", str(gone.pid), str(read_fd),
                               str(write_fd), "0", "[]"], pass_fds=(read_fd, write_fd))
    os.close(read_fd)
    os.close(write_fd)
    try:
        assert worker.wait(60) == 0
        with pytest.raises(EOFError):  # it ended before it said it was ready
            from_worker.recv_bytes()
    finally:
        worker.kill()
        to_worker.close()
        from_worker.close()


def test_a_fork_the_system_refuses_fails_a_call_and_the_fork_server_goes_on():
    """The process limit refuses the fork server's first two forks (EAGAIN): two calls fail with
    the reason, the server goes on forking, and a process that cannot start at all (fresh
    interpreters that fail to execute) fails the calls, not the caller."""
    with UserCodeWorkers(num_workers=2, memory_mb=512, preload=["refusing_fork:echo"],
                         env={"POSTTRAIN_TEST_REFUSED_FORKS": "2"}) as pool:
        results = pool.map([("refusing_fork:echo", (i,), {}) for i in range(8)], timeout_s=30)
        failed = [r for r in results if isinstance(r, UserCodeError)]
        assert len(failed) == 2 and all(f.reason == "died" and "BlockingIOError" in f.message for f in failed)
        assert [r for r in results if not isinstance(r, UserCodeError)] == [i for i in range(8) if i not in
                                                                             [results.index(f) for f in failed]]
        assert isinstance(pool._starter, forkserver.ForkServer)
        assert pool.map([("refusing_fork:echo", (i,), {}) for i in range(4)], timeout_s=30) == [0, 1, 2, 3]
    with UserCodeWorkers(num_workers=2) as pool:
        pool._starter = forkserver.FreshInterpreters(lambda read_fd, write_fd: ["/nonexistent/python"], pool.env)
        results = pool.map([("misbehaving_code:echo", ([1],), {}) for _ in range(3)], timeout_s=30)
        assert all(r.reason == "died" and "no worker process could start: FileNotFoundError" in r.message
                   for r in results)


def test_a_module_that_starts_a_thread_as_it_is_imported_gets_fresh_interpreters_not_forks():
    with UserCodeWorkers(num_workers=2, memory_mb=512, preload=["starts_a_thread:echo"]) as pool:
        assert pool.map([("starts_a_thread:echo", ([i],), {}) for i in range(4)], timeout_s=30) == [[0], [1], [2], [3]]
        assert isinstance(pool._starter, forkserver.FreshInterpreters)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_functions_import_from_the_callers_path_and_a_missing_one_is_reported(workers):
    with pytest.raises(UserCodeError, match="cannot import 'no_such_module'"):
        workers.call("no_such_module:f", ([],), timeout_s=30)
    with pytest.raises(ValueError):
        UserCodeWorkers(num_workers=0)


def test_a_reward_that_raises_spins_exits_or_allocates_fails_those_samples_only():
    """The reward role with a user function in its worker processes: 40 completions, five of which
    make the function raise, spin forever, exit its process, segfault or allocate without bound."""
    from posttrain.config.rl_sections import RewardTermConfig
    from posttrain.data.records import PromptRecord
    from posttrain.rl.rewards import RewardScorer

    completions = [f"answer {i}" for i in range(40)]
    for i, marker in zip((3, 11, 19, 27, 35), ("RAISE", "SPIN", "EXIT", "ALLOC", "SEGV")):
        completions[i] += f" {marker}"
    records = [PromptRecord([{"role": "user", "content": "q"}], "1", {}, "test", i) for i in range(len(completions))]
    term = RewardTermConfig("misbehaving_code:marked_reward", timeout_s=2.0, retry_budget_s=30.0)
    scorer = RewardScorer([term], processes=2, memory_mb=256)
    try:
        scores = scorer.score(completions, records)
        assert [i for i, failed in enumerate(scores.failed) if failed] == [3, 11, 19, 27, 35]
        reasons = {i: message.partition(":")[0] for i, _, message in scores.errors}
        assert reasons == {3: "raised", 11: "timeout", 19: "died", 27: "memory", 35: "died"}
        assert scores.rewards[0] == pytest.approx(0.8) and scores.rewards[39] == pytest.approx(0.9)
        again = scorer.score(completions[:2], records[:2])  # the role goes on
        assert again.num_failed == 0
    finally:
        scorer.close()


def test_a_call_that_cannot_be_sent_raises_and_leaves_no_answer_for_the_next(workers):
    with pytest.raises(Exception):
        workers.map([(FN, (["sleep:0.5"],), {}), (FN, ([lambda: 0],), {})], timeout_s=30)  # a lambda: not picklable
    assert workers.call("misbehaving_code:echo", (["second"],), timeout_s=30)["doubled"] == ["secondsecond"]


def test_start_up_and_imports_do_not_count_against_a_call_and_a_worker_that_cannot_start_fails_the_call():
    with UserCodeWorkers(num_workers=1, memory_mb=256, preload=["misbehaving_code:echo"]) as pool:
        assert pool.call("misbehaving_code:echo", ([1],), timeout_s=0.05)["doubled"] == [2]  # a cold worker
    with UserCodeWorkers(num_workers=1, preload=["no_such_module:f"]) as pool:
        with pytest.raises(UserCodeError) as failed:
            pool.call("no_such_module:f", ([],), timeout_s=30)
        assert failed.value.reason == "died" and failed.value.error_type == "LookupError"


def test_a_broken_reward_function_stops_the_run_and_any_iterable_of_values_is_taken():
    from posttrain.config.rl_sections import RewardTermConfig
    from posttrain.data.records import PromptRecord
    from posttrain.rl.rewards import RewardError, RewardScorer

    records = [PromptRecord([{"role": "user", "content": "q"}], "1", {}, "test", i) for i in range(4)]
    broken = RewardScorer([RewardTermConfig("misbehaving_code:broken_reward")], processes=2, memory_mb=256)
    try:
        with pytest.raises(RewardError, match="'target' is required"):
            broken.score(["a", "b", "c", "d"], records)
    finally:
        broken.close()
    generator = RewardScorer([RewardTermConfig("misbehaving_code:as_generator")], processes=2, memory_mb=256)
    try:
        assert generator.score(["a", "b", "c", "d"], records).rewards == [0.5] * 4
    finally:
        generator.close()


def test_a_term_goes_sample_by_sample_after_a_batch_with_a_failed_call_and_back_in_chunks_after_a_clean_one():
    from posttrain.config.rl_sections import RewardTermConfig
    from posttrain.data.records import PromptRecord
    from posttrain.rl.rewards import RewardScorer

    records = [PromptRecord([{"role": "user", "content": "q"}], "1", {}, "test", i) for i in range(8)]
    scorer = RewardScorer([RewardTermConfig("misbehaving_code:chunk_sizes", timeout_s=30)], processes=2, memory_mb=256)
    clean, failing = ["a"] * 8, ["a"] * 7 + ["RAISE"]
    try:
        assert scorer.score(clean, records).rewards == [4.0] * 8  # one chunk per worker
        scores = scorer.score(failing, records)  # the failed chunk's samples alone
        assert scores.rewards[:4] == [4.0] * 4 and scores.rewards[4:7] == [1.0] * 3 and scores.failed[7]
        assert scorer.score(clean, records).rewards == [1.0] * 8  # after a failed call: sample by sample
        assert scorer.score(clean, records).rewards == [4.0] * 8  # after a clean batch: chunks again
    finally:
        scorer.close()
