"""The one worker runtime (`posttrain.parallel.workers.WorkerGroup`) and the one remote-role
wrapper (`posttrain.parallel.roles.RemoteRole`): a group keeps each rank's state across calls
inside one process group and names the first rank that fails; a role hands back an actor's own
error, and an actor that dies is a `RoleLost`, raised, or (with `lost_ok`) returned in its
place while the actor is replaced."""

from __future__ import annotations

import os

import pytest
import ray

from posttrain.parallel.distributed import WorkerError
from posttrain.parallel.roles import RemoteRole, RoleLost
from posttrain.parallel.workers import WorkerGroup


class Counter:
    def __init__(self, start: int):
        self.value = start

    def add(self, k: int) -> int:
        self.value += k
        return self.value

    def fail(self) -> None:
        raise KeyError("no such item")

    def die(self) -> None:
        import os

        os._exit(1)


def make_counter(start: int) -> Counter:
    return Counter(start)


def add_and_sum(counter: Counter, k: int) -> int:
    import torch
    import torch.distributed as dist

    total = torch.tensor([counter.add(k)])
    dist.all_reduce(total)
    return int(total)


def niceness(_counter: Counter) -> int:
    import os

    return os.nice(0)


def fail_on_rank_one(counter: Counter) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one fails")
    dist.barrier()  # rank 0 waits for a peer that never comes


def test_a_worker_group_keeps_each_ranks_state_across_calls_and_names_the_first_failure(ray_cluster):
    ray.cloudpickle.register_pickle_by_value(__import__(__name__))
    group = WorkerGroup(2, torch_threads=1)
    try:
        group.setup(make_counter, (10,))
        assert group.call(add_and_sum, (1,)) == [22, 22]  # 11 + 11 on both ranks
        assert group.call(add_and_sum, per_rank_args=[(1,), (3,)]) == [26, 26]  # 12 + 14: the state stayed
        # the ranks run at the driver's CPU priority, not at Ray's lowered one (niceness 15)
        assert group.call(niceness) == [os.nice(0)] * 2
        with pytest.raises(WorkerError, match="(?s)rank 1.*ValueError: rank one fails"):
            group.call(fail_on_rank_one, timeout_s=120)
        assert group.ranks == 0  # a failed call closes the group
    finally:
        group.close()


def test_a_remote_role_returns_its_actors_errors_and_replaces_an_actor_that_died(ray_cluster):
    ray.cloudpickle.register_pickle_by_value(__import__(__name__))
    role = RemoteRole(Counter, (0,), num_actors=2, num_cpus=0.5)
    try:
        assert role.call("add", 2) == [2, 2]
        with pytest.raises(KeyError, match="no such item"):
            role.call("fail")
        parts = role.call_each("die", [(), ()], lost_ok=True)
        assert all(isinstance(p, RoleLost) for p in parts) and role.replaced == 2
        assert role.call("add", 5) == [5, 5]  # replacements start afresh
        with pytest.raises(RoleLost, match="Counter actor 0 died"):
            role.call_each("die", [()])
    finally:
        role.close()
