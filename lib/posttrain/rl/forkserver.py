"""Starting worker processes: forked from a fork server of our own, or as fresh interpreters.

A starter gives each worker two pipes to its parent and a process group of its own (a kill of
its process group reaches what the worker started too). Both kinds have one interface:

    starter.start()                   # -> (handle, to_worker, from_worker): at once, never waiting for the worker
    starter.alive()                   # False once a fork server ended (its workers with it)
    starter.pid(handle)               # its process id (None: not known, the fork server ended, or reaped)
    starter.exit_status(handle, s)    # how it ended (negative: the signal), waiting at most s; None: not yet
    starter.refusal(handle)           # why it never started (a fork the system refused), else None
    starter.forget(handle)            # it was killed: reap it without waiting
    starter.session                   # the pid of the session every worker shares, or None: one each
    starter.close()

`ForkServer(server_argv, env)` runs `server_argv` (a fresh interpreter whose entry point calls
`serve`) once and asks it for each worker over a Unix SOCK_SEQPACKET socket: the request
carries the worker's two pipe ends (SCM_RIGHTS); the server forks, the child runs `child(read_fd,
write_fd)` in a process group of its own, in the server's session (its own, apart from the
parent's: where Linux schedules tasks in groups by session, its autogroups, all the pool's
workers weigh as one group against the parent's), and the server answers the child's pid, and later its exit
status (it reaps its children), or why the fork was refused (the process limit, memory: the
server goes on). A fork takes about a millisecond where a fresh interpreter
takes tens (hundreds on busy cores). The server must not start a thread (a fork copies
another thread's locks, held or not, without the thread); it ends when the parent closes the
socket or is gone. `ForkServer` raises `OSError` where Unix SOCK_SEQPACKET sockets are
missing. `FreshInterpreters(argv_for)` starts each worker with `Popen`
(`argv_for(read_fd, write_fd)`): there, or after a fork server ended.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Callable


PARENT_CHECK_S = 1.0


def pipes() -> tuple[tuple[int, int], Connection, Connection]:
    """`((the worker's read fd, its write fd), the parent's connection to it, from it)`."""
    parent_read, child_write = os.pipe()
    child_read, parent_write = os.pipe()
    return (child_read, child_write), Connection(parent_write, readable=False), Connection(parent_read, writable=False)


class FreshInterpreters:
    """Each worker a fresh interpreter: `Popen(argv_for(read_fd, write_fd))`, a session of its own."""

    session = None  # each worker's is its own

    def __init__(self, argv_for: Callable[[int, int], list[str]], env: dict):
        self.argv_for, self.env = argv_for, env
        self.ended: list[subprocess.Popen] = []  # killed, not reaped yet

    def start(self) -> tuple[subprocess.Popen, Connection, Connection]:
        (child_read, child_write), to_worker, from_worker = pipes()
        try:
            process = subprocess.Popen(self.argv_for(child_read, child_write), pass_fds=(child_read, child_write),
                                       env=self.env, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(child_read)
            os.close(child_write)
        return process, to_worker, from_worker

    def alive(self) -> bool:
        return True

    def pid(self, process: subprocess.Popen) -> int | None:
        return None if process.poll() is not None else process.pid  # reaped: its pid may be another's now

    def exit_status(self, process: subprocess.Popen, timeout_s: float) -> int | None:
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def refusal(self, process: subprocess.Popen) -> str | None:
        return None  # a start the system refuses raises in `start`

    def forget(self, process: subprocess.Popen) -> None:
        self.ended = [p for p in self.ended if p.poll() is None] + [process]

    def close(self) -> None:
        for process in self.ended:
            process.wait()
        self.ended = []


class Forked:
    """A worker the fork server started: `pid` once the server said it, `status` once it ended
    (1 and `refused`, the reason, when the fork was refused)."""

    __slots__ = ("pid", "status", "refused")

    def __init__(self):
        self.pid: int | None = None
        self.status: int | None = None
        self.refused: str | None = None


class ForkServer:
    """Workers forked from a server process (module docstring); `OSError` from `start` when the
    server cannot be reached (it ended: its workers end with it)."""

    def __init__(self, server_argv: Callable[[int], list[str]], env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(server_argv(theirs.fileno()), pass_fds=(theirs.fileno(),), env=env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self.socket = ours
        self.session = self.process.pid  # the server leads the session its workers share
        self.awaiting: collections.deque[Forked] = collections.deque()  # asked for, pid not said yet (in order)
        self.live: dict[int, Forked] = {}  # by pid, until the server says it ended
        self.ended = False  # its socket said so

    def _read(self, timeout_s: float) -> bool:
        """Take one message of the server's (False: none within `timeout_s`)."""
        if self.socket.fileno() < 0 or self.ended:
            raise OSError("the fork server ended")
        if not select.select([self.socket], [], [], timeout_s)[0]:
            return False
        data = self.socket.recv(4096)
        if not data:
            self.ended = True
            raise OSError("the fork server ended")
        message = json.loads(data)
        if "refused" in message:
            forked = self.awaiting.popleft()
            forked.status, forked.refused = 1, message["refused"]
        elif "pid" in message:
            forked = self.awaiting.popleft()
            forked.pid = message["pid"]
            self.live[forked.pid] = forked
        else:
            forked = self.live.pop(message["ended"], None)
            if forked is not None:
                forked.status = message["status"]
        return True

    def _read_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        try:
            while not done():
                if not self._read(max(0.0, deadline - time.monotonic())):
                    return False
        except OSError:
            return done()
        return True

    def start(self) -> tuple[Forked, Connection, Connection]:
        self._read_until(lambda: False, 0.0)  # what the server said so far: its socket never fills up
        if self.ended:
            raise OSError("the fork server ended")
        (child_read, child_write), to_worker, from_worker = pipes()
        try:
            socket.send_fds(self.socket, [b"fork"], [child_read, child_write])
        except OSError:
            to_worker.close()
            from_worker.close()
            raise
        finally:
            os.close(child_read)
            os.close(child_write)
        forked = Forked()
        self.awaiting.append(forked)
        return forked, to_worker, from_worker

    def alive(self) -> bool:
        self._read_until(lambda: False, 0.0)  # what it said so far: its socket's end, if it ended
        return not self.ended and self.process.poll() is None

    def pid(self, forked: Forked) -> int | None:
        self._read_until(lambda: forked.pid is not None or forked.refused is not None, 60.0)
        return None if forked.status is not None else forked.pid  # reaped: its pid may be another's now

    def exit_status(self, forked: Forked, timeout_s: float) -> int | None:
        self._read_until(lambda: forked.status is not None, timeout_s)
        return forked.status

    def refusal(self, forked: Forked) -> str | None:
        self._read_until(lambda: forked.pid is not None or forked.refused is not None, 0.0)
        return forked.refused

    def forget(self, forked: Forked) -> None:
        pass  # the server reaps it; its status, when said, is dropped with the handle

    def close(self) -> None:
        self.socket.close()  # the server ends when its socket does
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ---------------------------------------------------------------------- the server process


def _report_ended(control: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        control.send(json.dumps({"ended": pid, "status": os.waitstatus_to_exitcode(status)}).encode())


def serve(parent_pid: int, control_fd: int, child: Callable[[int, int], None]) -> None:
    """The fork server's loop: for each request on the `control_fd` socket (a worker's read and
    write fds), fork; the child takes a process group of its own and runs `child(read_fd, write_fd)`,
    then exits (status 0, or 1 after an exception); the server answers `{"pid"}` (`{"refused"}`
    when the system refuses the fork: the request fails, the server goes on), and `{"ended",
    "status"}` when a child ends. Returns when the parent closes the socket or is
    gone (`parent_pid`, checked every `PARENT_CHECK_S`: not the parent-death signal, which a
    parent's thread that ends would send)."""
    control = socket.socket(fileno=control_fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's end wakes the loop through wake_read
    while True:
        readable = select.select([control, wake_read], [], [], PARENT_CHECK_S)[0]
        if os.getppid() != parent_pid:
            return
        try:
            if wake_read in readable:
                os.read(wake_read, 4096)
                _report_ended(control)
            if control not in readable:
                continue
            message, fds, _, _ = socket.recv_fds(control, 64, 2)
        except OSError:  # the parent closed the socket with answers unread, or is gone
            return
        if not message:
            return
        try:
            pid = os.fork()
        except OSError as err:  # the process limit (EAGAIN) or memory: this worker, not the server
            try:  # said before its pipes close: the parent reads why as it sees them end
                control.send(json.dumps({"refused": f"{type(err).__name__}: {err}"}).encode())
            except OSError:
                return
            finally:
                for fd in fds:
                    os.close(fd)
            continue
        if pid == 0:
            code = 1
            try:
                os.setpgid(0, 0)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (control_fd, wake_read, wake_write):
                    os.close(fd)
                child(fds[0], fds[1])
                code = 0
            except BaseException:  # noqa: BLE001 - said on stderr, as an interpreter would
                import traceback

                traceback.print_exc()
            finally:
                try:  # what the child printed, as an interpreter's exit would
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)  # never back into the server's loop
        for fd in fds:
            os.close(fd)
        try:
            control.send(json.dumps({"pid": pid}).encode())
        except OSError:
            return
