"""Every step runs on the device the recipe trains on: no step moves a model to the CPU when
`train.device` names another. Checked through the seam every step uses: a model is loaded or
built only by the loaders below, and every call of one in steps/ and flows/ passes the
recipe's device (`pick_device(config.train.device)`, or a worker's `worker_device()`, passed
on as `device`); nothing there names the CPU or calls `.cpu()` on its own.

The behavioural half: `steps.verify.run` (the check that ran on the CPU before) places both
models on the device it is given, so a CUDA recipe verifies on CUDA.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
STEP_SOURCES = sorted((REPO_ROOT / "steps").glob("*.py")) + sorted((REPO_ROOT / "flows").glob("*.py"))

# loader -> the index of its positional device argument (None: keyword only)
MODEL_LOADERS = {
    "load_hf_checkpoint": 1, "load_causal_lm": 2, "load_hf_backend": None, "load_teacher": 1,
    "load_model": 2, "load_start": 3, "build_model": 2, "from_pretrained": None,
}
# `verify.run` loads ours and transformers' model on its device
DEVICE_TAKERS = {("verify", "run"): None}


def _name(call: ast.Call) -> tuple[str | None, str]:
    func = call.func
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else None
        return owner, func.attr
    return None, func.id if isinstance(func, ast.Name) else ""


def _passes_device(call: ast.Call, position: int | None) -> bool:
    if any(k.arg == "device" for k in call.keywords):
        return True
    return position is not None and len(call.args) > position


def _calls(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def test_every_model_loader_in_a_step_gets_the_recipes_device():
    missing, loaders_seen = [], 0
    for path in STEP_SOURCES:
        for call in _calls(path):
            owner, name = _name(call)
            if name in MODEL_LOADERS or (owner, name) in DEVICE_TAKERS:
                position = MODEL_LOADERS.get(name, DEVICE_TAKERS.get((owner, name)))
                if name == "from_pretrained" and owner not in ("NativeEngine", "engine_class"):
                    continue
                loaders_seen += 1
                if not _passes_device(call, position):
                    missing.append(f"{path.relative_to(REPO_ROOT)}:{call.lineno} {owner + '.' if owner else ''}{name}")
    assert loaders_seen >= 10, "the scan found too few loader calls: has the seam moved?"
    assert not missing, f"model loaders called without the recipe's device (they default to the CPU): {missing}"


def test_no_step_names_the_cpu_or_moves_a_model_there():
    offenders = []
    for path in STEP_SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "cpu":
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} 'cpu'")
            if isinstance(node, ast.Call) and _name(node)[1] == "cpu" and not node.args:
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} .cpu()")
    assert not offenders, offenders


def test_verify_places_both_models_on_the_device_it_is_given(tmp_path, monkeypatch):
    """`verify.run(device=...)` loads ours and transformers' model there (spied: every model
    it builds is moved to, or loaded on, the given device)."""
    from posttrain.config.schema import VerifyConfig
    from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config
    from posttrain.steps import verify
    import posttrain.verify.logits as logits

    save_hf_checkpoint(build_model(tiny_config("qwen3"), seed=0), tmp_path / "model")
    device = torch.device("cpu", 0)  # a device object distinct from the default "cpu" string
    seen = []
    real_load = logits.load_hf_checkpoint

    def spy_load(path, device="cpu", *args, **kwargs):
        seen.append(("ours", device))
        return real_load(path, "cpu", *args, **kwargs)  # safetensors refuses "cpu:0"; tensors do not mind

    monkeypatch.setattr(logits, "load_hf_checkpoint", spy_load)
    real_to = torch.nn.Module.to

    def spy_to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and type(self).__name__.endswith("ForCausalLM"):
            seen.append(("transformers", target))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy_to)
    verdict = verify.run(str(tmp_path / "model"), VerifyConfig(seq_len=16, batch_size=1), device=device)
    assert verdict["passed"]
    assert {who for who, _ in seen} == {"ours", "transformers"}, seen
    assert all(torch.device(d) == device for _, d in seen), seen


def test_verify_requires_a_device():
    from posttrain.config.schema import VerifyConfig
    from posttrain.steps import verify

    with pytest.raises(TypeError):
        verify.run("unused", VerifyConfig())


def test_weight_sync_stays_on_the_accelerator_for_an_engine_beside_the_policy():
    """An in-process engine on the policy's accelerator gets the weights device to device
    (`export_weights(on_device=True)`); a CPU pair, or an engine elsewhere, goes through the CPU.
    The "meta" device stands in for an accelerator here."""
    from types import SimpleNamespace

    from posttrain.rl.controller import engine_beside_policy
    from posttrain.rl.policy import LocalPolicy

    def pair(engine_device, model_device):
        model = torch.nn.Linear(2, 2, device=model_device)
        return SimpleNamespace(device=engine_device), LocalPolicy(SimpleNamespace(model=model))

    assert engine_beside_policy(*pair(torch.device("meta"), "meta"))
    assert not engine_beside_policy(*pair(torch.device("cpu"), "cpu"))  # the CPU default: unchanged
    assert not engine_beside_policy(*pair(torch.device("meta"), "cpu"))
    assert not engine_beside_policy(object(), LocalPolicy(SimpleNamespace(model=torch.nn.Linear(2, 2))))
    assert not engine_beside_policy(SimpleNamespace(device=torch.device("meta")), object())  # a policy group
