"""Render conversations (or preference pairs) on several processes, in order.

Rendering a conversation through the chat template and deriving its assistant mask
(`posttrain.data.chat.render_conversation`) is Python work on one core, hundreds of
conversations a second with a real template; a corpus of millions takes hours on one process.
`parallel_map(work, items, context, num_proc)` spreads chunks of items over `num_proc` worker
processes, each holding `context` (the tokenizer and what else `work` needs), and gives
`work(context, item)` back in input order: the same results as a loop over the items (a test
checks it). `render_all` is that for conversations; the tokenize step's pair rendering passes
its own `work`, a module-level function (spawned workers import it by name). On Linux the workers are forked (they inherit the loaded tokenizer; no re-import);
elsewhere they are spawned with the tokenizer pickled, as the platform's default is. At most
`IN_FLIGHT_PER_PROC * num_proc` chunks are in flight, so a long input streams through in bounded
memory, yet the workers have work queued while the caller spends a while on results (the
tokenize step writing a part's shard). An error in a worker (a template
that cannot be masked) is raised in the caller.

`num_procs_for(requested, num_records)`: how many processes a step should use: the cores this
process may use when `requested` is None (`usable_cores`: its CPU affinity, within a cgroup
CPU quota such as a Kubernetes limit), one for inputs under `PARALLEL_MIN_RECORDS`, where
starting workers costs more than it saves, and never more than there are chunks to render.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import sys
from collections import deque
from typing import Any, Callable, Iterable, Iterator

from posttrain.data.chat import TokenizedSample, render_conversation

PARALLEL_MIN_RECORDS = 2048
CHUNK_SIZE = 256  # conversations a worker renders per task: large enough to amortise the hand-off
# chunks queued per worker (~0.2 s of rendering each): more than the tokenize step spends on a
# finished part (2 a worker left them idle at every part: 7% slower over 100,000 chats)
IN_FLIGHT_PER_PROC = 8

_WORKER: dict = {}  # in a worker: its `work` and `context`


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity where the platform reports it, capped
    by a cgroup v2 CPU quota (`/sys/fs/cgroup/cpu.max`, "QUOTA PERIOD", rounded up)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def num_procs_for(requested: int | None, num_records: int, announce: str | None = None) -> int:
    """The worker count for rendering `num_records` items (module docstring); with more than
    one, `announce` (e.g. "[tokenize a] rendering 9,000 pairs") is printed with the count."""
    procs = 1
    if num_records >= PARALLEL_MIN_RECORDS:
        procs = max(1, min(usable_cores() if requested is None else requested, math.ceil(num_records / CHUNK_SIZE)))
    if announce and procs > 1:
        print(f"{announce} on {procs} processes")
    return procs


def _start_worker(work: Callable[[Any, Any], Any], context: Any) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER["work"], _WORKER["context"] = work, context


def _work_chunk(items: list) -> list:
    work, context = _WORKER["work"], _WORKER["context"]
    return [work(context, item) for item in items]


def parallel_map(work: Callable[[Any, Any], Any], items: Iterable, context: Any, num_proc: int = 1,
                 chunk_size: int | None = None) -> Iterator:
    """`work(context, item)` for each item, in order, on `num_proc` processes (one: in this
    process), `chunk_size` (default `CHUNK_SIZE`) items per task; what `work` raises is raised
    here. Results travel back pickled."""
    if num_proc <= 1:
        for item in items:
            yield work(context, item)
        return
    chunk_size = chunk_size or CHUNK_SIZE
    start = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    chunks = iter(lambda it=iter(items): list(itertools.islice(it, chunk_size)), [])
    with start.Pool(num_proc, initializer=_start_worker, initargs=(work, context)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_work_chunk, (chunk,)))
            if len(pending) >= IN_FLIGHT_PER_PROC * num_proc:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


def _render(context: tuple, messages: list[dict]) -> TokenizedSample:
    tokenizer, template_kwargs = context
    return render_conversation(tokenizer, messages, **template_kwargs)


def render_all(tokenizer, conversations: Iterable[list[dict]], template_kwargs: dict | None = None,
               num_proc: int = 1, chunk_size: int | None = None) -> Iterator[TokenizedSample]:
    """`render_conversation(tokenizer, messages, **template_kwargs)` for each conversation, in
    order (`parallel_map`)."""
    return parallel_map(_render, conversations, (tokenizer, dict(template_kwargs or {})), num_proc, chunk_size)
