"""Where a run writes its files, and the `${generated}` placeholder in config paths."""

from __future__ import annotations

from pathlib import Path

GENERATED = "${generated}"


def run_directory(output_dir: str, flow_name: str, run_id: str) -> Path:
    """`output_dir/flow_name/run_id`, created; everything a run writes lives below it."""
    path = Path(output_dir).expanduser().resolve() / flow_name / str(run_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def tracking_run(config, run_dir: Path):
    """Who the flow run in `run_dir` is to the experiment trackers (`train.report_to`,
    `posttrain.train.trackers.TrackingRun`): the project `train.tracking_project`, else the
    recipe's name; the same for the train step, its resumes and the register step."""
    from posttrain.train.trackers import tracking_run as make

    return make(config.train.tracking_project or config.name, run_dir, Path(config.output_dir).expanduser())


def generated_directory(run_dir: Path) -> Path:
    return Path(run_dir) / "generated"


def resolve(path: str, run_dir: Path) -> str:
    """Replace `${generated}` with this run's generated-data directory."""
    if GENERATED in path:
        return path.replace(GENERATED, str(generated_directory(run_dir)))
    return path


def vocabulary_directory(run_dir: Path) -> Path:
    """Where a run that builds its tokenizer from its data writes it (`${vocabulary}`)."""
    return Path(run_dir) / "vocabulary"


def resolve_tokenizer(config, run_dir: Path) -> str:
    """Where the recipe's tokenizer is: `${generated}` resolved, the run's own vocabulary for
    `${vocabulary}`, or a registry reference (`registry:NAME[:VERSION]`, e.g. the starting
    model's own tokenizer) resolved to its model directory in the recipe's registry."""
    name = config.tokenizer.name_or_path
    if config.builds_tokenizer:
        return str(vocabulary_directory(run_dir))
    if name.startswith("registry:"):
        from posttrain.registry import resolve_model_dir

        return str(resolve_model_dir(name, registry_dir=config.register.registry_dir))
    return resolve(name, run_dir)


def load_recipe_tokenizer(config, run_dir: Path):
    """The recipe's tokenizer (`resolve_tokenizer`) with a pad token: one without takes its
    starting model's config.json `pad_token_id` first (`posttrain.data.tokenizer`)."""
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.launch_check import starting_checkpoint

    start = starting_checkpoint(config)
    model = None if start is None else start[1]
    if model is not None and model.startswith("registry:"):
        from posttrain.registry import resolve_model_dir

        model = str(resolve_model_dir(model, registry_dir=config.register.registry_dir))
    return load_tokenizer(resolve_tokenizer(config, run_dir), model=model)
