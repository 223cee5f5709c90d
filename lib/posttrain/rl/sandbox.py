"""Running untrusted Python (code a policy wrote) in a sandboxed child process, and the
`code_execution` reward built on it.

    result = run_python(code, wall_s=5, memory_mb=512)   # -> SandboxResult
    result.passed, result.returncode, result.stdout, result.stderr, result.timed_out

What a run gets:

- **No network.** The program runs in new user, network, PID and mount namespaces
  (`unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS)`): its network namespace
  holds only a loopback interface that is down, so every connection fails (127.0.0.1 of the
  host included).
  Where namespaces cannot be made (a container whose seccomp filter forbids `unshare`,
  unprivileged user namespaces turned off), a run fails closed with `SandboxUnavailable`,
  unless the caller passes `allow_network=True` (then the program runs with the host's network,
  and `result.isolation` says so).
- **No other processes in sight.** Its `/proc` is the PID namespace's own (mounted in its
  mount namespace): the host's processes, their command lines and environments (a trainer's
  API keys) are not there. Where the mount namespace or that mount cannot be made (a container
  that masks parts of its `/proc`), the program sees the host's `/proc` and `result.isolation`
  says "namespaces (host /proc)".
- **A fresh temporary directory** as its working directory, `HOME` and `TMPDIR`, deleted after
  the run with whatever was written there; a scrubbed environment (`PATH`, `HOME`, `TMPDIR`,
  the locale, one thread for numeric libraries: nothing of the caller's); `python -I -B`
  (no `PYTHON*` variables, no user site, no bytecode written); stdin is empty.
- **Limits** (`setrlimit`, inherited by what it starts): CPU seconds (`cpu_s`, default the wall
  limit rounded up; SIGXCPU, then SIGKILL a second later), address space (`memory_mb`: an
  allocation past it fails with `MemoryError`), the size of any file it writes (`file_mb`),
  open files (`open_files`), processes (`processes`: counted in its own user namespace, so a
  fork bomb stops there and other sandboxes are not starved), no core dumps.
- **A wall-clock limit** (`wall_s`): past it, the whole process group is killed, and with it the
  PID namespace's first process, which ends every process of the namespace (even one that left
  the process group). When the program ends, what it left running ends too.
- **Capped output**: the first `output_bytes` of stdout and of stderr are kept, the rest read
  and dropped (`result.truncated`).
- Run as root, the program runs as `nobody` (it cannot write root's files).

What it does not do: the file system is the host's, read and write as the user running it can
(as `nobody` when that is root): a program can read what that user can read and write outside
its directory where that user can write. Each file is capped at `file_mb`, not their number or
total; no system calls are filtered (no seccomp), and the mount namespace replaces `/proc`
only, not the file system. Treat it as a guard against accidents and runaway programs (loops,
memory bombs, fork bombs, network calls, stray files), not as a boundary for hostile code: for
that, run the reward role in a container or VM with no secrets mounted.

`code_execution` (a built-in reward, `posttrain.rl.rewards.BUILTINS`): the completion's last
fenced Python block, followed by the record's tests (`record.meta["tests"]`), run in the
sandbox; 1.0 when it exits with status 0.

This file is also the sandbox's launcher: `python -I sandbox.py SETTINGS` (standard library
only, so it runs without the package on the path) makes the namespaces, drops root, sets the
limits, then forks the namespace's first process, which runs the program and reaps.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWNS = 0x10000000, 0x40000000, 0x20000000, 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
HOST_PROC = "namespaces (host /proc)"
NOBODY = 65534
PROGRAM = "main.py"
START_S = 10.0  # the launcher says whether it could isolate the program within this (on top of wall_s)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot isolate a program as asked (no namespaces, and the network not allowed)."""


@dataclass
class SandboxResult:
    """One run: `returncode` (None: killed at the wall-clock limit; 128 + n: ended by signal n,
    e.g. 152 for SIGXCPU), what it wrote (`stdout`, `stderr`, each at most `output_bytes`;
    `truncated` when either was cut), `timed_out`, `isolation` ("namespaces"; `HOST_PROC`
    where its own `/proc` could not be mounted; with `allow_network` where none could be made
    "none"), `seconds` (wall)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    isolation: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _scrubbed_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _nobody() -> tuple[int, int]:
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return NOBODY, NOBODY


def _remove(directory: str) -> None:
    """Delete the run's directory, whatever the program did to the permissions in it."""
    for root, subdirectories, _ in os.walk(directory):  # top down: each made readable before it is listed
        for name in subdirectories:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(directory)


def _ended(pid: int) -> bool:
    """Whether child `pid` has ended, without reaping it (its process group id stays its own)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _collect(process: subprocess.Popen, deadline: float, limit: int) -> tuple[bytes, bytes, bool, bool]:
    """`(stdout, stderr, truncated, timed_out)`: read both pipes until they close (or the
    launcher ended and they have nothing more to read: a process the program left behind may
    hold them where no PID namespace ends it), keeping the first `limit` bytes of each, until
    `deadline`."""
    kept = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    open_fds, truncated = set(kept), False
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(kept[process.stdout.fileno()]), bytes(kept[process.stderr.fileno()]), truncated, True
        readable = select.select(list(open_fds), [], [], min(left, 0.1))[0]
        if not readable and _ended(process.pid):
            break
        for fd in readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                continue
            room = limit - len(kept[fd])
            kept[fd] += chunk[:max(room, 0)]
            truncated = truncated or len(chunk) > room
    return bytes(kept[process.stdout.fileno()]), bytes(kept[process.stderr.fileno()]), truncated, False


def run_python(code: str, *, wall_s: float = 5.0, cpu_s: int | None = None, memory_mb: int = 512,
               file_mb: int = 16, processes: int = 16, open_files: int = 64, output_bytes: int = 65536,
               allow_network: bool = False) -> SandboxResult:
    """Run the Python program `code` in the sandbox (module docstring); raises
    `SandboxUnavailable` when it cannot be isolated as asked."""
    if wall_s <= 0 or memory_mb < 64 or processes < 1:
        raise ValueError(f"need wall_s > 0, memory_mb >= 64 and processes >= 1, got {wall_s}, {memory_mb}, "
                         f"{processes}")
    directory = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    status_read = status_write = -1
    try:
        Path(directory, PROGRAM).write_text(code)
        owner = _nobody() if os.geteuid() == 0 else None
        if owner is not None:
            os.chown(directory, *owner)
        status_read, status_write = os.pipe()
        settings = {"status_fd": status_write, "owner": owner, "allow_network": allow_network,
                    "cpu_s": cpu_s or max(1, math.ceil(wall_s)), "memory_mb": memory_mb, "file_mb": file_mb,
                    "processes": processes, "open_files": open_files}
        began = time.monotonic()
        process = subprocess.Popen([sys.executable, "-I", "-B", os.path.abspath(__file__), json.dumps(settings)],
                                   cwd=directory, env=_scrubbed_env(directory), stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_write,),
                                   start_new_session=True)
        os.close(status_write)
        status_write = -1
        try:
            status = _read_status(status_read, began + START_S)
            if "error" not in status:
                stdout, stderr, truncated, timed_out = _collect(process, time.monotonic() + wall_s, output_bytes)
            elif status["error"] is None:  # the launcher failed before it could say why: its stderr says
                said = _collect(process, time.monotonic() + 1.0, 4096)[1].decode(errors="replace").strip()
                raise SandboxUnavailable(f"the sandbox's launcher ended before it was ready: {said[-2000:]}")
            else:
                raise SandboxUnavailable(status["error"])
        finally:
            try:  # before it is reaped: its group id cannot name another group yet
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
            process.stdout.close()
            process.stderr.close()
        code = process.returncode
        return SandboxResult(None if timed_out else (code if code >= 0 else 128 - code),
                             stdout.decode(errors="replace"), stderr.decode(errors="replace"), timed_out, truncated,
                             status["isolation"], round(time.monotonic() - began, 4))
    finally:
        for fd in (status_read, status_write):
            if fd >= 0:
                os.close(fd)
        _remove(directory)


def _read_status(fd: int, deadline: float) -> dict:
    data = b""
    while select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return json.loads(data) if data else {"error": None}


# ---------------------------------------------------------------- the code_execution reward

FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str | None:
    """The last fenced code block of `completion` (```python, ```py or a bare ```), else None."""
    blocks = FENCED.findall(completion)
    return blocks[-1] if blocks else None


def _tests(record, key: str) -> str:
    from posttrain.rl.rewards import RewardError

    tests = (record.meta or {}).get(key)
    if tests is None:
        raise RewardError(f"code_execution needs each prompt record's meta[{key!r}] (Python that checks the "
                          "answer's code, e.g. asserts)")
    return tests if isinstance(tests, str) else "\n".join(tests)


def code_execution(completions: list[str], records: list, tests_key: str = "tests", wall_s: float = 5.0,
                   memory_mb: int = 512, processes: int = 16, parallel: int | None = None,
                   allow_network: bool = False, **_) -> list[float]:
    """1.0 where the completion's last fenced Python block, followed by the record's tests
    (`record.meta[tests_key]`: Python, e.g. asserts, or a list of such lines), runs to their end
    (a nonce they print last, so an early `sys.exit(0)` does not pass) and exit status 0 in the sandbox (`run_python`, each program within `wall_s`, `memory_mb`,
    `processes`); 0.0 otherwise (no code block, an exception, a failed assert, a limit
    reached). `parallel` programs at once (default the CPU count). A record without tests, or a
    sandbox that cannot isolate the network (unless `allow_network`), is a `RewardError`."""
    from concurrent.futures import ThreadPoolExecutor

    from posttrain.rl.rewards import RewardError

    import secrets

    # the tests end by printing a fresh nonce: a program that exits early (sys.exit(0), os._exit(0))
    # to skip them does not pass
    nonce = secrets.token_hex(16)
    programs = [None if (code := extract_code(c)) is None else
                f"{code}\n\n{_tests(r, tests_key)}\nprint({nonce!r}, flush=True)\n"
                for c, r in zip(completions, records)]

    def score(program: str | None) -> float:
        if program is None:
            return 0.0
        result = run_python(program, wall_s=wall_s, memory_mb=memory_mb, processes=processes,
                            allow_network=allow_network)
        lines = result.stdout.strip().splitlines()
        return float(result.passed and not result.truncated and bool(lines) and lines[-1] == nonce)

    try:
        with ThreadPoolExecutor(max_workers=parallel or os.cpu_count() or 1) as pool:
            return list(pool.map(score, programs))
    except SandboxUnavailable as err:
        raise RewardError(f"code_execution: {err}") from None


# ---------------------------------------------------------------- the launcher (a child process)


def _libc_call(name: str, *args) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _isolate(allow_network: bool) -> str:
    """Make the namespaces (module docstring); the isolation made ("namespaces" with a mount
    namespace, `HOST_PROC` without one), or `SandboxUnavailable`."""
    try:
        try:
            _libc_call("unshare", CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS)
            return "namespaces"
        except OSError:
            _libc_call("unshare", CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID)
            return HOST_PROC
    except OSError as err:
        if not allow_network:
            raise SandboxUnavailable(
                f"cannot cut the program off the network: unshare(CLONE_NEWUSER | CLONE_NEWNET) failed ({err}; "
                "unprivileged user namespaces may be off, or a seccomp filter forbids unshare); pass "
                "allow_network=True (code_execution's kwargs: allow_network: true) to run without "
                "network isolation") from None
    return "none"


def _tasks_of(uid: int) -> int:
    """The processes and threads of `uid` on this machine (RLIMIT_NPROC counts them all where
    no user namespace scopes it)."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in Path(entry.path, "status").read_text().splitlines()
                          if line.startswith(("Uid:", "Threads:")))
        except (OSError, ValueError):
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _limit(settings: dict, isolation: str) -> None:
    import resource

    megabyte = 1024 * 1024
    # our launcher and the namespace's first process count as two processes of the program's
    processes = settings["processes"] + 2 + (_tasks_of(os.getuid()) if isolation == "none" else 0)
    for name, value in (("RLIMIT_AS", settings["memory_mb"] * megabyte),
                        ("RLIMIT_FSIZE", settings["file_mb"] * megabyte), ("RLIMIT_NOFILE", settings["open_files"]),
                        ("RLIMIT_NPROC", processes), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (settings["cpu_s"], settings["cpu_s"] + 1))


def _own_proc() -> str:
    """In the PID namespace's first process, with a mount namespace of its own: mounts stop
    propagating to the host, and `/proc` becomes this namespace's. The isolation made."""
    try:
        _libc_call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
        _libc_call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        return "namespaces"
    except OSError:  # e.g. a container that masks parts of its /proc forbids a new one
        return HOST_PROC


def _first_process() -> None:
    """The PID namespace's first process: run the program, reap what is left to it, end with
    the program's status (128 + n for signal n); its end ends the namespace's other processes."""
    program = os.fork()
    if program == 0:
        try:
            os.execv(sys.executable, [sys.executable, "-I", "-B", PROGRAM])
        finally:
            os._exit(127)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(127)
        if pid == program:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def _launch(settings: dict) -> None:
    status = os.fdopen(settings["status_fd"], "w")
    try:
        if settings["owner"] is not None:  # root: the program runs as nobody
            uid, gid = settings["owner"]
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        isolation = _isolate(settings["allow_network"])
        _limit(settings, isolation)
    except (OSError, SandboxUnavailable) as err:
        status.write(json.dumps({"error": str(err)}))
        status.close()
        os._exit(125)
    try:  # before the status is told: a fork refused (EAGAIN under RLIMIT_NPROC) is the sandbox's failure
        first = os.fork()
    except OSError as err:
        status.write(json.dumps({"error": f"cannot start the program: {err}"}))
        status.close()
        os._exit(125)
    if first == 0:  # the status is the first process's to tell, once its /proc is mounted
        status.write(json.dumps({"isolation": _own_proc() if isolation == "namespaces" else isolation}))
        status.close()
        _first_process()
    status.close()  # the parent reads the status pipe to its end: the first process's copy
    _, code = os.waitpid(first, 0)
    os._exit(os.waitstatus_to_exitcode(code) & 0xFF)


if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]))
