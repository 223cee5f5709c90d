"""Render conversations on several processes, in order (`render_all`).

Rendering a conversation through the chat template and deriving its assistant mask
(`posttrain.data.chat.render_conversation`) is Python work on one core, hundreds of
conversations a second with a real template; a corpus of millions takes hours on one process.
`render_all` spreads chunks of conversations over `num_proc` worker processes and gives the
samples back in input order, identical to rendering them one after another (a test checks
it). On Linux the workers are forked (they inherit the loaded tokenizer; no re-import);
elsewhere they are spawned with the tokenizer pickled, as the platform's default is. At most `2 * num_proc` chunks are in
flight, so a long input streams through in bounded memory. An error in a worker (a template
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
from typing import Iterable, Iterator

from posttrain.data.chat import TokenizedSample, render_conversation

PARALLEL_MIN_RECORDS = 2048
CHUNK_SIZE = 256  # conversations a worker renders per task: large enough to amortise the hand-off

_WORKER: dict = {}  # in a worker: its tokenizer and template kwargs


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


def num_procs_for(requested: int | None, num_records: int) -> int:
    """The worker count for rendering `num_records` conversations (module docstring)."""
    if num_records < PARALLEL_MIN_RECORDS:
        return 1
    procs = usable_cores() if requested is None else requested
    return max(1, min(procs, math.ceil(num_records / CHUNK_SIZE)))


def _start_worker(tokenizer, template_kwargs: dict) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER["tokenizer"], _WORKER["kwargs"] = tokenizer, template_kwargs


def _render_chunk(conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    tokenizer, kwargs = _WORKER["tokenizer"], _WORKER["kwargs"]
    out = []
    for messages in conversations:
        sample = render_conversation(tokenizer, messages, **kwargs)
        out.append((sample.input_ids, sample.loss_mask))
    return out


def render_all(tokenizer, conversations: Iterable[list[dict]], template_kwargs: dict | None = None,
               num_proc: int = 1, chunk_size: int | None = None) -> Iterator[TokenizedSample]:
    """`render_conversation(tokenizer, messages, **template_kwargs)` for each conversation, in
    order, on `num_proc` processes (one: in this process), `chunk_size` (default `CHUNK_SIZE`)
    conversations per task."""
    kwargs = dict(template_kwargs or {})
    chunk_size = chunk_size or CHUNK_SIZE
    if num_proc <= 1:
        for messages in conversations:
            yield render_conversation(tokenizer, messages, **kwargs)
        return
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    chunks = iter(lambda it=iter(conversations): list(itertools.islice(it, chunk_size)), [])
    with context.Pool(num_proc, initializer=_start_worker, initargs=(tokenizer, kwargs)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_render_chunk, (chunk,)))
            if len(pending) >= 2 * num_proc:
                yield from _samples(pending.popleft().get())
        while pending:
            yield from _samples(pending.popleft().get())


def _samples(rendered: list[tuple[list[int], list[int]]]) -> Iterator[TokenizedSample]:
    for input_ids, loss_mask in rendered:
        yield TokenizedSample(input_ids, loss_mask)
