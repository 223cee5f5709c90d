"""The package as setup.cfg builds it: every Python package under lib/posttrain (and steps/,
flows/, configs/) is listed, so a wheel install carries all of them (setup.cfg lists them by
hand because steps/, flows/ and configs/ install as posttrain.steps, posttrain.flows and
posttrain.configs). tests/integration/test_package.py installs the wheel itself."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_setup_cfg_lists_every_package_under_lib():
    from setuptools.config.setupcfg import read_configuration

    listed = set(read_configuration(str(ROOT / "setup.cfg"))["options"]["packages"])
    lib = ROOT / "lib"
    on_disk = {".".join(init.parent.relative_to(lib).parts) for init in lib.rglob("__init__.py")}
    on_disk |= {"posttrain.steps", "posttrain.flows", "posttrain.configs"}
    package_dir = read_configuration(str(ROOT / "setup.cfg"))["options"]["package_dir"]
    assert {package_dir[name] for name in ("posttrain.steps", "posttrain.flows", "posttrain.configs")} == {
        "steps", "flows", "configs"}
    assert on_disk - listed == set(), f"packages missing from setup.cfg: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"setup.cfg lists packages that do not exist: {sorted(listed - on_disk)}"
