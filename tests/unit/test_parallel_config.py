"""ParallelConfig validation and loading, mesh construction errors, and the local launcher's
error reporting (the first failing rank's traceback, not its peers' echoes)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from posttrain.config.schema import ParallelConfig, SFTConfig
from posttrain.config.strict import ConfigError, from_dict
from posttrain.parallel.apply import apply_parallelism
from posttrain.parallel.distributed import WorkerError, spawn_local
from posttrain.parallel.mesh import build_device_mesh, dp_rank_and_size


def test_defaults_are_one_worker():
    config = ParallelConfig()
    config.validate()
    assert (config.strategy, config.num_workers, config.dp, config.tp_size) == ("none", 1, 1, 1)
    assert build_device_mesh(config) is None and dp_rank_and_size(None) == (0, 1)
    model = object()
    assert apply_parallelism(model, config, None) is model


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(strategy="fsdp", num_workers=2, dp_size=1), "must equal num_workers"),
        (dict(strategy="fsdp", num_workers=2, tp_size=2), "has no tensor parallelism"),
        (dict(strategy="tp", num_workers=4, tp_size=2), "needs dp_size 1"),
        (dict(strategy="none", num_workers=2), "runs one worker"),
    ],
)
def test_inconsistent_configs_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kwargs).validate()


def test_sft_config_reads_a_parallel_section():
    raw = {"name": "x", "data": {"sources": [{"name": "a", "kind": "jsonl", "path": "a.jsonl"}],
                                 "heldout_fraction": 0.1},
           "tokenizer": {"name_or_path": "t"}, "parallel": {"strategy": "fsdp+tp", "num_workers": 4, "tp_size": 2}}
    config = from_dict(SFTConfig, raw, source="test.yaml")
    assert config.parallel.dp == 2 and config.parallel.strategy == "fsdp+tp"
    raw["parallel"]["stratgy"] = "fsdp"
    with pytest.raises(ConfigError, match="strategy"):
        from_dict(SFTConfig, raw, source="test.yaml")


def test_mesh_needs_an_initialised_group():
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        build_device_mesh(ParallelConfig(strategy="fsdp", num_workers=2))


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise KeyError("rank one's own error")
    dist.barrier()  # loses its peer: fails after rank 1


def test_spawn_local_reports_the_first_failure():
    with pytest.raises(WorkerError, match="(?s)worker rank 1 failed.*KeyError: \"rank one's own error\"") as err:
        spawn_local(_fail_on_rank_one, 2)
    assert err.value.rank == 1 and "_fail_on_rank_one" in err.value.worker_traceback
