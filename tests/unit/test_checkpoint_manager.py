"""CheckpointManager: complete state round-trips, nothing pickled besides DCP's own metadata,
atomic saves (a crash inside `save` leaves the previous checkpoint whole), keep_last, and
clear errors for a wrong or incomplete checkpoint."""

import json
import random

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from posttrain.config.schema import TrainConfig
from posttrain.models.architectures import build_model, load_hf_checkpoint, save_hf_checkpoint, tiny_config
from posttrain.train.checkpoint import (
    STAGES,
    TrainingCheckpointError,
    CheckpointManager,
    export_hf_checkpoint,
    from_json_tree,
    to_json_tree,
)
from posttrain.objectives.sft import SFTObjective
from posttrain.train.trainer import Trainer

T = 16


def make_trainer(seed: int = 0, **config) -> Trainer:
    model = build_model(tiny_config(**config), seed=seed)
    return Trainer(model, TrainConfig(device="cpu", learning_rate=1e-2, warmup_steps=1), total_steps=20,
                   objective=SFTObjective())


def batch(i: int) -> dict:
    ids = torch.randint(0, 200, (2, T), generator=torch.Generator().manual_seed(i))
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": torch.arange(T).expand(2, T),
            "doc_ids": torch.zeros(2, T, dtype=torch.long)}


def trained(steps: int) -> Trainer:
    trainer = make_trainer()
    for i in range(steps):
        trainer.train_step([batch(i)])
    return trainer


def assert_same_state(a, b, path="state"):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same_state(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def test_json_tree_round_trips_tuples_int_keys_exact_floats_and_inline_tensors():
    value = {"t": (1, (2.5, None)), 3: [True, "x"], "f": 0.1 + 0.2, "tiny": 5e-324,
             "r": torch.tensor([[1, 255]], dtype=torch.uint8)}
    tree = json.loads(json.dumps(to_json_tree(value, "", None)))
    back = from_json_tree(tree)
    assert_same_state(back, value)


def test_json_tree_sends_tensors_aside_and_names_unsupported_values():
    tensors = {}
    tree = to_json_tree({"model": {"w": torch.ones(2)}, "opt": {"state": {0: {"m": torch.zeros(3)}}}}, "", tensors)
    assert set(tensors) == {"model.w", "opt.state.0.m"}
    assert from_json_tree(tree, tensors)["opt"]["state"][0]["m"] is tensors["opt.state.0.m"]
    with pytest.raises(TypeError, match="'opt.bad'"):
        to_json_tree({"opt": {"bad": object()}}, "", {})


def test_load_restores_model_optimizer_scheduler_step_health_and_rng(tmp_path):
    trainer = trained(3)
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    manager = CheckpointManager(tmp_path, every_steps=1)
    data_state = {"version": 1, "packer": {"consumed": 17, "pending": [[3, 4]]}, "batches": 6}
    path = manager.save(3, trainer, data_state, extra={"history": [{"step": 1, "loss": 1.25}]})
    expected = trainer.state_dict()
    draws = (random.random(), np.random.rand(), torch.rand(3))

    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    fresh = make_trainer(seed=1)
    assert manager.load("latest", fresh) == data_state
    assert_same_state(fresh.state_dict(), expected)
    assert fresh.step == 3 and manager.info(path).extra == {"history": [{"step": 1, "loss": 1.25}]}
    assert random.random() == draws[0] and np.random.rand() == draws[1] and torch.equal(torch.rand(3), draws[2])


def test_resumed_trainer_continues_bit_for_bit(tmp_path):
    reference = trained(3)
    expected = [reference.train_step([batch(i)])["loss"] for i in range(3, 6)]
    manager = CheckpointManager(tmp_path, every_steps=3)
    manager.save(3, trained(3), data_state=None)
    fresh = make_trainer(seed=5)
    manager.load("latest", fresh)
    assert [fresh.train_step([batch(i)])["loss"] for i in range(3, 6)] == expected


def test_only_tensors_go_to_dcp_and_the_rest_is_json(tmp_path):
    path = CheckpointManager(tmp_path, every_steps=1).save(2, trained(2), {"position": 4})
    names = sorted(p.name for p in path.iterdir())
    assert names == [".metadata", "__0_0.distcp", "meta.json", "rank_00000.json"]
    metadata = FileSystemReader(str(path)).read_metadata()  # DCP's own format
    kinds = {type(m) for m in metadata.state_dict_metadata.values()}
    assert kinds == {TensorStorageMetadata}  # no pickled byte blobs of non-tensor objects
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 2 and meta["state"]["step"] == 2
    assert meta["state"]["scheduler"]["last_epoch"] == 2
    assert "rng" not in meta["state"]
    assert set(json.loads((path / "rank_00000.json").read_text())) == {"rng", "data"}


def test_a_crafted_metadata_pickle_is_refused_before_it_runs(tmp_path):
    """DCP's `.metadata` is a pickle; a checkpoint from elsewhere must not run code on load."""
    import os
    import pickle

    path = CheckpointManager(tmp_path, every_steps=1).save(2, trained(2), data_state=None)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(TrainingCheckpointError, match=r"(posix|os)\.system, which a DCP checkpoint never holds"):
        CheckpointManager(tmp_path, every_steps=1).load(path, make_trainer())
    assert not marker.exists()


def test_enum_members_pickled_through_getattr_load_and_other_getattrs_are_refused():
    """CPython 3.11.0-3.11.4 (Debian 12's 3.11.2, say) pickle an enum member as `getattr(cls,
    name)`: a `.metadata` written so loads, and a `getattr` that reaches anything else is refused."""
    import io
    import pathlib
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as Encoding

    from posttrain.train.checkpoint import _MetadataUnpickler

    class ThroughGetattr(pickle.Pickler):  # a class's method pickles as getattr(cls, name) anyway
        def reducer_override(self, obj):
            if obj is Encoding.TORCH_CHANNELS_LAST:
                return getattr, (Encoding, obj.name)
            return NotImplemented

    def load(obj):
        buffer = io.BytesIO()
        ThroughGetattr(buffer).dump(obj)
        assert b"getattr" in buffer.getvalue()
        return _MetadataUnpickler(io.BytesIO(buffer.getvalue())).load()

    assert load([Encoding.TORCH_CHANNELS_LAST]) == [Encoding.TORCH_CHANNELS_LAST]
    with pytest.raises(TrainingCheckpointError, match=r"getattr\(<class 'pathlib.Path'>, 'home'\).*not an enum member"):
        load(pathlib.Path.home)


@pytest.mark.parametrize("stage", STAGES)
def test_crash_inside_save_leaves_the_previous_checkpoint_whole(tmp_path, stage):
    class Crash(Exception):
        pass

    def crash_at(name, tmp):
        if name == stage and tmp.name.endswith("step_00000004"):
            raise Crash

    manager = CheckpointManager(tmp_path, every_steps=2, keep_last=1, on_stage=crash_at)
    trainer = trained(2)
    good = manager.save(2, trainer, {"at": 2})
    trainer.train_step([batch(2)]), trainer.train_step([batch(3)])
    with pytest.raises(Crash):
        manager.save(4, trainer, {"at": 4})
    assert (tmp_path / ".tmp-step_00000004").is_dir()  # the partial save, never renamed
    assert manager.latest() == good  # keep_last=1, yet the old one was not deleted
    assert not (tmp_path / ".tmp-step_00000004").exists()  # latest() cleaned it up
    fresh = make_trainer()
    assert manager.load("latest", fresh) == {"at": 2} and fresh.step == 2


def test_keep_last_keeps_the_newest_and_a_repeated_step_replaces_its_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=2)
    trainer = trained(1)
    for step in (1, 2, 3, 4):
        manager.save(step, trainer, {"at": step})
    assert [p.name for p in manager.complete()] == ["step_00000003", "step_00000004"]
    manager.save(4, trainer, {"at": "again"})
    assert [p.name for p in manager.complete()] == ["step_00000003", "step_00000004"]
    assert manager.load("latest", make_trainer()) == {"at": "again"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]


def test_should_save_every_n_steps_and_at_the_end():
    manager = CheckpointManager("unused", every_steps=3)
    assert [s for s in range(1, 11) if manager.should_save(s, total_steps=10)] == [3, 6, 9, 10]


def test_wrong_or_incomplete_checkpoints_fail_clearly(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", every_steps=1, fingerprint={"model": {"hidden_size": 64}})
    with pytest.raises(TrainingCheckpointError, match="no complete checkpoint"):
        manager.load("latest", make_trainer())
    path = manager.save(1, trained(1), None)
    (tmp_path / "half").mkdir()
    with pytest.raises(TrainingCheckpointError, match="not a complete checkpoint"):
        manager.load(tmp_path / "half", make_trainer())

    other = CheckpointManager(tmp_path / "ckpt", every_steps=1, fingerprint={"model": {"hidden_size": 32}})
    with pytest.raises(TrainingCheckpointError, match="changed: model.hidden_size"):
        other.load(path, make_trainer())
    with pytest.raises(TrainingCheckpointError, match="'model.*' is float32\\[.*\\] in the checkpoint but float32\\["):
        manager.load(path, make_trainer(intermediate_size=48))


def test_hf_export_is_the_full_model(tmp_path):
    trainer = trained(2)
    export_hf_checkpoint(trainer, tmp_path / "export")
    save_hf_checkpoint(trainer.model, tmp_path / "direct")
    exported, direct = load_hf_checkpoint(tmp_path / "export"), load_hf_checkpoint(tmp_path / "direct")
    assert_same_state(exported.state_dict(), direct.state_dict())
    assert_same_state(exported.state_dict(), trainer.model.state_dict())
