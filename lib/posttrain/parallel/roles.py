"""The one remote-role wrapper: a role of the RL controller (rollout engine, reward workers,
reference) as Ray actors, with one failure policy.

    role = RemoteRole(EngineActor, (spec, 1), num_actors=2, num_cpus=1)
    results = role.call("generate", prompts, sampling)                 # every actor, same args
    parts = role.call_each("score", [(texts[:8], recs[:8]), (texts[8:], recs[8:])])
    role.close()

Each actor holds `cls(*args)`, built in the actor (no model object is pickled); a start that
fails raises the actor's own error from the constructor. The failure policy, the same for
every role:
- an exception raised by the actor's method comes back as itself (Ray's wrapping removed);
- an actor that dies (its process killed, or ended by Ray's memory monitor: `OutOfMemoryError`,
  which is not a `RayActorError`) raises `RoleLost` naming the actor; with `call_each(...,
  lost_ok=True)` its part comes back as a `RoleLost` instead and the actor is replaced before
  the next call, so a role that can lose one part (the reward workers: a chunk's samples fail)
  goes on while the others raise (the controller rebuilds a lost engine).

Ray: an instance already running is used and left running; otherwise a local one is started
(`posttrain.parallel.workers.ensure_local_ray`) and shut down by `close()`.
"""

from __future__ import annotations

from typing import Any

import ray


class RoleLost(RuntimeError):
    """An actor of a role died (`index`, the Ray error as the cause)."""

    def __init__(self, role: str, index: int, cause: BaseException):
        super().__init__(f"the {role} actor {index} died: {type(cause).__name__}: {cause}")
        self.role, self.index = role, index


def _died(err: BaseException) -> bool:
    """Whether a Ray error says the actor itself is gone (not that its method raised)."""
    return isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError))


class RemoteRole:
    """`num_actors` actors of `cls(*args)` (module docstring). `num_cpus` / `num_gpus` per
    actor place them apart from the trainer; `runtime_env` as Ray takes it (e.g. the driver's
    `PYTHONPATH`, so user functions named by import path resolve in the actors)."""

    def __init__(self, cls: type, args: tuple = (), num_actors: int = 1, num_cpus: float = 1, num_gpus: float = 0,
                 runtime_env: dict | None = None):
        from posttrain.parallel.workers import ensure_local_ray

        if num_actors < 1:
            raise ValueError(f"a role needs at least one actor, got {num_actors}")
        self.name, self._args = cls.__name__, args
        self.started_ray = ensure_local_ray(num_actors * num_cpus, num_actors * num_gpus)
        options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0}
        if runtime_env is not None:
            options["runtime_env"] = runtime_env
        self._actor_cls = ray.remote(**options)(cls)
        self.actors = [self._actor_cls.remote(*args) for _ in range(num_actors)]
        self.replaced = 0  # actors replaced after they died
        try:  # a start that fails says so here, by its own error
            self.call("__ray_ready__")
        except BaseException:
            self.close()
            raise

    def call(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every actor; the results in actor order."""
        return self.call_each(method, [args] * len(self.actors))

    def call_each(self, method: str, per_actor_args: list[tuple], lost_ok: bool = False) -> list[Any]:
        """`method(*per_actor_args[k])` on actor `k` (as many actors as argument tuples, from the
        first); the results in that order. `lost_ok`: an actor that died gives a `RoleLost` as
        its result and is replaced; otherwise it raises one."""
        if len(per_actor_args) > len(self.actors):
            raise ValueError(f"{len(per_actor_args)} calls for {len(self.actors)} {self.name} actors")
        refs = [getattr(actor, method).remote(*args) for actor, args in zip(self.actors, per_actor_args)]
        results = []
        for k, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayTaskError as err:
                raise (getattr(err, "cause", None) or err) from None
            except ray.exceptions.RayError as err:
                if not _died(err):
                    raise
                lost = RoleLost(self.name, k, err)
                if not lost_ok:
                    raise lost from err
                self.actors[k] = self._actor_cls.remote(*self._args)
                self.replaced += 1
                results.append(lost)
        return results

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False
