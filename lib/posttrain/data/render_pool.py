"""Render conversations on several processes, in order (`render_all`).

Rendering a conversation through the chat template and deriving its assistant mask
(`posttrain.data.chat.render_conversation`) is Python work on one core, hundreds of
conversations a second with a real template; a corpus of millions takes hours on one process.
`render_all` spreads chunks of conversations over `num_proc` worker processes and gives the
samples back in input order, identical to rendering them one after another (a test checks
it). Workers are forked where the platform allows (they inherit the loaded tokenizer; no
re-import), else spawned with the tokenizer pickled. At most `2 * num_proc` chunks are in
flight, so a long input streams through in bounded memory. An error in a worker (a template
that cannot be masked) is raised in the caller.

`num_procs_for(requested, num_records)`: how many processes a step should use: all the cores
this process may run on when `requested` is None, and one for inputs under
`PARALLEL_MIN_RECORDS`, where starting workers costs more than it saves.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from typing import Iterable, Iterator

from posttrain.data.chat import TokenizedSample, render_conversation

PARALLEL_MIN_RECORDS = 2048
CHUNK_SIZE = 256  # conversations a worker renders per task: large enough to amortise the hand-off

_WORKER: dict = {}  # in a worker: its tokenizer and template kwargs


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform reports it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def num_procs_for(requested: int | None, num_records: int) -> int:
    """The worker count for rendering `num_records` conversations (module docstring)."""
    if num_records < PARALLEL_MIN_RECORDS:
        return 1
    return max(1, usable_cores() if requested is None else requested)


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
               num_proc: int = 1, chunk_size: int = CHUNK_SIZE) -> Iterator[TokenizedSample]:
    """`render_conversation(tokenizer, messages, **template_kwargs)` for each conversation, in
    order, on `num_proc` processes (one: in this process)."""
    kwargs = dict(template_kwargs or {})
    if num_proc <= 1:
        for messages in conversations:
            yield render_conversation(tokenizer, messages, **kwargs)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
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
