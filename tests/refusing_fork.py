"""A user module whose import makes the process's next `os.fork` calls fail as a process limit
would (`POSTTRAIN_TEST_REFUSED_FORKS` of them, EAGAIN): imported by a fork server as a preloaded
function's module, it makes the server's forks of workers fail (tests of `posttrain.rl.user_code`)."""

from __future__ import annotations

import errno
import os

_fork = os.fork
_refusals = int(os.environ.get("POSTTRAIN_TEST_REFUSED_FORKS", "0"))


def _refusing_fork() -> int:
    global _refusals
    if _refusals > 0:
        _refusals -= 1
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
    return _fork()


os.fork = _refusing_fork


def echo(x):
    return x
