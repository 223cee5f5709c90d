"""Where a run writes its files, and the `${generated}` placeholder in config paths."""

from __future__ import annotations

from pathlib import Path

GENERATED = "${generated}"


def run_directory(output_dir: str, flow_name: str, run_id: str) -> Path:
    """`output_dir/flow_name/run_id`, created; everything a run writes lives below it."""
    path = Path(output_dir).expanduser().resolve() / flow_name / str(run_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def generated_directory(run_dir: Path) -> Path:
    return Path(run_dir) / "generated"


def resolve(path: str, run_dir: Path) -> str:
    """Replace `${generated}` with this run's generated-data directory."""
    if GENERATED in path:
        return path.replace(GENERATED, str(generated_directory(run_dir)))
    return path
