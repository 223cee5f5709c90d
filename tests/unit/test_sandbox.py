"""The sandbox for code-execution rewards (`posttrain.rl.sandbox`): a program that passes or
fails, loops forever, allocates, forks without bound, connects to the network or writes files
is bounded, cut off or cleaned up; `code_execution` scores a completion's code block against the
record's tests; without namespaces a run fails closed unless the network is allowed."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from posttrain.data.records import PromptRecord
from posttrain.rl import sandbox
from posttrain.rl.rewards import BUILTINS, RewardError, RewardScorer, RewardTerm
from posttrain.rl.sandbox import SandboxUnavailable, code_execution, extract_code, run_python


def _namespaces() -> str | None:
    try:
        run_python("pass")
        return None
    except SandboxUnavailable as err:
        return str(err)


NO_NAMESPACES = _namespaces()
needs_namespaces = pytest.mark.skipif(NO_NAMESPACES is not None, reason=f"no namespaces here: {NO_NAMESPACES}")


@needs_namespaces
def test_a_program_that_passes_and_one_that_fails():
    passed = run_python("import sys\nprint('hello')\nprint('oops', file=sys.stderr)")
    assert passed.passed and passed.returncode == 0 and passed.isolation == "namespaces"
    assert passed.stdout == "hello\n" and passed.stderr == "oops\n"
    failed = run_python("assert 1 + 1 == 3, 'arithmetic'")
    assert not failed.passed and failed.returncode == 1 and "AssertionError: arithmetic" in failed.stderr


@needs_namespaces
def test_an_endless_loop_is_stopped_by_the_cpu_limit_and_a_sleeping_one_by_the_wall_clock():
    spinning = run_python("while True:\n    pass", wall_s=30, cpu_s=1)
    assert spinning.returncode == 128 + 24 and not spinning.timed_out  # SIGXCPU
    assert spinning.seconds < 10
    sleeping = run_python("import time\nwhile True:\n    time.sleep(1)", wall_s=1)
    assert sleeping.timed_out and sleeping.returncode is None and not sleeping.passed
    assert sleeping.seconds < 5


@needs_namespaces
def test_a_memory_bomb_fails_at_the_address_space_cap():
    bomb = "hoard = []\nwhile True:\n    hoard.append(bytearray(16 * 1024 * 1024))"
    result = run_python(bomb, memory_mb=128, wall_s=30)
    assert result.returncode == 1 and "MemoryError" in result.stderr
    assert result.seconds < 10


@needs_namespaces
def test_a_fork_bomb_stops_at_the_process_limit_and_what_it_left_ends_with_the_program():
    bomb = ("import os, time\nforked = 0\nfor _ in range(1000):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
            "    forked += 1\nprint(forked)")
    result = run_python(bomb, processes=8, wall_s=30)
    assert result.passed and 1 <= int(result.stdout) <= 8
    # its sleeping children held the output pipes: the run ended at once because they were killed
    assert result.seconds < 10


@needs_namespaces
def test_the_network_is_cut_off_even_to_a_server_on_this_machine():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(5)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('in')")
    assert not result.passed and "OSError" in result.stderr and "in" not in result.stdout
    socket.create_connection(("127.0.0.1", port), timeout=3).close()  # outside, the server answers
    time.sleep(0.2)
    assert accepted == [True]  # the one connection made is ours, from outside
    server.close()


def _accept(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
        return True
    except OSError:
        return False


@needs_namespaces
def test_a_fresh_directory_and_environment_deleted_after_and_the_output_capped(monkeypatch, tmp_path):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    program = ("import os\nopen('left.txt', 'w').write('x')\nos.makedirs(os.path.expanduser('~/sub'))\n"
               "os.chmod(os.path.expanduser('~/sub'), 0)\nprint(os.getcwd())\nprint(os.environ['HOME'])\n"
               "print(sorted(os.environ))")
    result = run_python(program)
    cwd, home, names = result.stdout.splitlines()
    assert result.passed and cwd == home and "posttrain-sandbox-" in cwd
    assert not os.path.exists(cwd)  # with what the program wrote, even a directory it locked
    assert "SECRET_TOKEN" not in names and "hunter2" not in result.stdout
    loud = run_python("print('x' * 1_000_000)", output_bytes=1000)
    assert loud.passed and loud.truncated and loud.stdout == "x" * 1000


@needs_namespaces
def test_the_program_sees_its_own_processes_in_proc_not_the_hosts():
    seen = run_python(f"import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
                      f"print(os.path.exists('/proc/{os.getpid()}/environ'))")
    if seen.isolation == sandbox.HOST_PROC:
        pytest.skip("this machine lets the sandbox make no /proc of its own")
    assert seen.passed and seen.isolation == "namespaces"
    assert seen.stdout.splitlines() == ["[1, 2]", "False"]  # the namespace's first process and the program


def test_without_namespaces_a_run_fails_closed_unless_the_network_is_allowed(monkeypatch):
    def refused(name, *args):
        raise PermissionError(1, f"{name}: Operation not permitted")

    monkeypatch.setattr(sandbox, "_libc_call", refused)
    with pytest.raises(SandboxUnavailable, match="allow_network"):
        sandbox._isolate(allow_network=False)
    assert sandbox._isolate(allow_network=True) == "none"

    def unavailable(*_, **__):
        raise SandboxUnavailable("no namespaces")

    monkeypatch.setattr(sandbox, "run_python", unavailable)
    with pytest.raises(RewardError, match="code_execution: no namespaces"):
        code_execution(["```python\nx = 1\n```"], [_record("assert x == 1")])


def test_output_is_read_until_the_launcher_ends_even_when_a_process_it_left_holds_the_pipes():
    import signal
    import subprocess

    # where no PID namespace ends them, what a program leaves behind may keep its pipes open
    process = subprocess.Popen(["sh", "-c", "sleep 30 & echo done"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        start = time.monotonic()
        stdout, _, truncated, timed_out = sandbox._collect(process, time.monotonic() + 20, 1000)
        assert stdout == b"done\n" and not truncated and not timed_out and time.monotonic() - start < 5
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
        process.stderr.close()


def _record(tests, line: int = 1) -> PromptRecord:
    return PromptRecord([{"role": "user", "content": "write it"}], None, {"tests": tests}, "t.jsonl", line)


def test_the_last_fenced_block_is_the_code():
    assert extract_code("no code here") is None
    assert extract_code("```python\na = 1\n```\nthen\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"


@needs_namespaces
def test_code_execution_rewards_code_that_passes_the_records_tests():
    assert "code_execution" in BUILTINS
    completions = ["Here:\n```python\ndef add(a, b):\n    return a + b\n```",  # right
                   "```python\ndef add(a, b):\n    return a - b\n```",  # wrong
                   "I cannot write code.",  # no block
                   "```python\ndef add(a, b):\n    while True:\n        pass\n```",  # hangs
                   "```python\nimport sys\nsys.exit(0)\n```",  # exits before the tests run
                   "```python\nimport os\nos._exit(0)\n```"]
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
    records = [_record(tests, i) for i in range(len(completions))]
    scorer = RewardScorer([RewardTerm("code_execution", kwargs={"wall_s": 2}, timeout_s=None)])
    scores = scorer.score(completions, records)
    assert scores.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0] and not any(scores.failed)
    with pytest.raises(RewardError, match="timeout_s: null"):
        RewardScorer([RewardTerm("code_execution")])
    with pytest.raises(RewardError, match="meta\\['tests'\\]"):
        code_execution(["```python\nx = 1\n```"], [PromptRecord([], None, {}, "t.jsonl", 1)])
