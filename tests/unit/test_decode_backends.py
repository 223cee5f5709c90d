"""The decode-backend seam (`posttrain.rl.decode_backends`): the default install never imports
the CPU kernels and the model's code never names them; the kernels' package ships every file
their build reads; backends are picked by name and refused where they cannot run; a resume
under another decode identity says so, naming both."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.rl.decode_backends import (
    DecodeBackendChanged,
    TorchDecode,
    check_resume,
    decode_backend,
    describe,
)

ROOT = Path(__file__).resolve().parents[2]
KERNELS_DIR = ROOT / "lib" / "posttrain" / "rl" / "cpu_kernels"


def test_the_default_path_never_imports_the_kernels():
    """A fresh interpreter: the models, the native engine generating with the default backend,
    and backends refused or resolved off the CPU, without `posttrain.rl.cpu_kernels` loaded."""
    script = """
import re
import sys
import torch
import posttrain.models
import posttrain.rl.native
from posttrain.models.architectures import build_model, tiny_config
from posttrain.rl.decode_backends import decode_backend
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.native import NativeEngine

engine = NativeEngine(build_model(tiny_config("qwen3"), seed=0).eval())
engine.generate([[3, 4, 5]], SamplingConfig(n=2, max_new_tokens=3, seed=1))
assert engine.decode_identity()["backend"] == "torch"
assert decode_backend("auto", "meta").name == "torch"  # not the CPU: torch, nothing compiled
try:
    decode_backend("cpu_kernels", "meta")
except ValueError as err:
    assert "CPU only" in str(err), err
else:
    raise AssertionError("cpu_kernels accepted a model off the CPU")
print(sorted(m for m in sys.modules if m.startswith("posttrain.") and re.search("cpu_kernels|kernel|fused", m)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_model_code_never_names_the_kernels():
    """models/ is plain torch: no C kernels, ctypes, fused plans or prepared calls, no rl import."""
    forbidden = re.compile(r"cpu_kernels|decode_kernel|ctypes|fused_step|fused_decode|prepared_step|"
                           r"AttentionStepCall|StepProgram|(from|import) posttrain\.rl\b")
    hits = [f"{path.relative_to(ROOT)}: {match.group(0)}"
            for path in sorted((ROOT / "lib" / "posttrain" / "models").rglob("*.py"))
            for match in [forbidden.search(path.read_text())] if match]
    assert hits == []


def test_the_package_ships_every_file_the_build_reads():
    """setup.cfg, as setuptools reads it: the kernels' package is listed, and its package data
    matches every file under csrc/ (so a wheel cannot lack a header the build includes)."""
    from setuptools.config.setupcfg import read_configuration

    from posttrain.rl.cpu_kernels import kernels

    options = read_configuration(str(ROOT / "setup.cfg"))["options"]
    assert "posttrain.rl.cpu_kernels" in options["packages"]
    globs = options["package_data"]["posttrain.rl.cpu_kernels"]
    shipped = {path for pattern in globs for path in KERNELS_DIR.glob(pattern)}
    needed = {*kernels.SOURCES, *kernels.HEADERS}
    assert needed <= shipped, sorted(str(p) for p in needed - shipped)
    assert shipped == {path for path in (KERNELS_DIR / "csrc").iterdir() if path.is_file()}
    included = {name for source in kernels.SOURCES for name in re.findall(r'#include "([^"]+)"', source.read_text())}
    assert {kernels.CSRC / name for name in included} <= shipped


def test_backends_by_name():
    assert isinstance(decode_backend("torch", "cpu"), TorchDecode)
    backend = TorchDecode("cpu")
    assert decode_backend(backend, "cpu") is backend
    with pytest.raises(ValueError, match="unknown decode backend 'fast'"):
        decode_backend("fast", "cpu")
    identity = backend.identity()
    assert identity["backend"] == "torch" and identity["device"] == "cpu" and identity["cpu"]
    assert identity["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_auto_takes_the_kernels_on_the_cpu_where_they_build():
    from posttrain.rl.cpu_kernels import kernels

    chosen = decode_backend("auto", "cpu")
    assert chosen.name == ("cpu_kernels" if kernels.load() is not None else "torch")
    if chosen.name == "cpu_kernels":
        identity = chosen.identity()
        assert identity["isa"] == (" ".join(kernels.isa_flags()) or "compiler default") and identity["compiler"]


def test_a_resume_under_another_identity_says_so():
    torch_cpu = {"backend": "torch", "device": "cpu", "cpu": "AMD EPYC", "torch_cpu_capability": "AVX2"}
    kernels_cpu = {**torch_cpu, "backend": "cpu_kernels", "isa": "-march=x86-64-v3", "compiler": "gcc 12"}
    assert check_resume(kernels_cpu, dict(kernels_cpu)) is None
    assert check_resume(None, kernels_cpu) is None  # a checkpoint from before identities were recorded
    with pytest.warns(RuntimeWarning, match="cpu_kernels .-march=x86-64-v3. on AMD EPYC.*torch on AMD EPYC"):
        message = check_resume(kernels_cpu, torch_cpu)
    assert "backend: 'cpu_kernels' -> 'torch'" in message and "isa: '-march=x86-64-v3' -> None" in message
    other_cpu = {**kernels_cpu, "cpu": "Intel Xeon"}
    with pytest.raises(DecodeBackendChanged, match="cpu: 'AMD EPYC' -> 'Intel Xeon'"):
        check_resume(kernels_cpu, other_cpu, strict=True)
    with pytest.warns(RuntimeWarning, match="reports no decode identity"):
        check_resume(torch_cpu, None)
    assert describe(kernels_cpu) == "cpu_kernels (-march=x86-64-v3) on AMD EPYC"


def test_the_grpo_recipe_chooses_the_native_engines_backend():
    """`grpo.decode_backend` (default torch) goes to the native engines; vLLM refuses any other."""
    from posttrain.config.loader import default_config, load_recipe_config
    from posttrain.config.strict import ConfigError

    path = default_config("grpo")
    assert load_recipe_config(path, "grpo").grpo.decode_backend == "torch"
    assert load_recipe_config(path, "grpo", overrides={"grpo.decode_backend": "auto"}).grpo.decode_backend == "auto"
    with pytest.raises(ConfigError, match="grpo.decode_backend"):
        load_recipe_config(path, "grpo", overrides={"grpo.decode_backend": "cpu_kernels", "grpo.engine": "vllm_actor"})
    from posttrain.models.architectures import build_model, tiny_config
    from posttrain.steps.rl import build_engine

    model = build_model(tiny_config("qwen3"), seed=0)
    engine = build_engine(load_recipe_config(path, "grpo"), model, tokenizer=None)
    assert engine.decode_identity()["backend"] == "torch" and engine.model is not model
