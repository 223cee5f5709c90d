"""`RecipeSpec`: everything that makes one recipe differ from another, in one object.

A recipe is declared in three places and no others: its config class (`posttrain.config.recipes`:
its own section, the evaluation suites that apply, whether it starts from a trained model),
its objective (`posttrain.objectives`), and its spec (a subclass of `RecipeSpec` in this
package, registered by `register`). Flows and steps ask the spec; they never test a config's
type. What the spec answers:

- `config_cls`, `kind` and `default_config`: what its flow parses, and the embedded demo;
- `records`: what its ingest step reads (`conversations`, `pairs`, `prompts`, `sequences`);
- `objective(config, inputs)`: what the trainer optimises (`posttrain.train.objective`);
- `batches(config, samples, ...)`: the endless packed training stream;
- `prepare_pairs(pairs, config)`: pair recipes, a transform of the tokenized pairs before
  packing (KTO's split of pairs into labelled examples); `pair_tables(...)`: per-pair values
  the stream attaches to each batch beside the reference's log-probabilities;
- `scores_reference`: whether its flow runs the `reference` step (DPO, KTO);
- the model's life cycle, with defaults for a causal LM that the reward model overrides:
  `prepare_start`, `load_start`, `load_model`, `export`; `stops_generation` (whether its
  export must stop at the end-of-turn token: a reward model scores, it does not generate).

The generic parts of the life cycle (random init, pretrained or registry start, LoRA,
merged and PEFT exports, the unsharded copy of a sharded model) are in
`posttrain.recipes.start`; a spec overrides only what its recipe does differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from posttrain.config.recipes import RecipeConfig
from posttrain.recipes import start as model_start
from posttrain.recipes.start import Start

if TYPE_CHECKING:  # the registry imports without torch (an ingest step reads `records` only)
    import torch


@dataclass
class ObjectiveInputs:
    """What an objective may need beyond the config, on the rank that builds it: the model it
    trains (`model`, already sharded), its `device` and `mesh` (None: one worker), where
    training started (`start`), and a distillation recipe's teacher (`teacher`, the teacher
    step's `TeacherSpec`)."""

    model: torch.nn.Module
    device: torch.device
    start: Start
    mesh: Any = None
    teacher: Any = None


class RecipeSpec:
    """See the module docstring. Subclasses set `config_cls` (and `records` when not conversations)."""

    config_cls: ClassVar[type[RecipeConfig]]
    records: ClassVar[str] = "conversations"
    scores_reference: ClassVar[bool] = False
    stops_generation: ClassVar[bool] = True

    @property
    def kind(self) -> str:
        return self.config_cls.kind

    def default_config(self) -> str:
        """The recipe's embedded demo config, `configs/<kind>/demo.yaml`."""
        from posttrain.config.loader import default_config

        return default_config(self.kind)

    # --- training -------------------------------------------------------------------------

    def objective(self, config: RecipeConfig, inputs: ObjectiveInputs | None = None):
        """The objective the trainer optimises (default: SFT's token cross-entropy)."""
        from posttrain.objectives.sft import SFTObjective

        return SFTObjective()

    def batches(self, config: RecipeConfig, samples: dict[str, list], pad_id: int, rows_per_rank: int,
                state: dict | None, rank: int, world_size: int, ref_logps: torch.Tensor | None = None):
        """The endless packed training stream (a context manager with `state_dict()`): rows of
        token samples packed best-fit (default), or pairs (`PairRecipeSpec`)."""
        from posttrain.data.training_stream import training_batches

        return training_batches(samples, config.data.sources, config.seed, config.pack, pad_id, rows_per_rank,
                                state=state, rank=rank, world_size=world_size)

    # --- the model's life cycle -----------------------------------------------------------

    def prepare_start(self, config: RecipeConfig, tokenizer, base_dir: Path, keep_model: bool) -> Start:
        """Resolve (pretrained, registry) or build and write to `base_dir` (random init) the
        starting model; `keep_model`: also return the built model (the one-worker path trains
        it directly)."""
        model_start.check_model_recipe(config)
        return model_start.causal_lm_start(config, tokenizer, base_dir, keep_model)

    def load_model(self, config: RecipeConfig, model_dir: str | Path, device: torch.device | None = None,
                   backend: str | None = None) -> torch.nn.Module:
        """A model directory this recipe wrote (or started from), loaded the way it trains;
        `backend` ("native" or "transformers") loads another model's way (a teacher's)."""
        from posttrain.models.architectures import load_causal_lm

        return load_causal_lm(model_dir, backend or config.model.backend, device)

    def load_start(self, config: RecipeConfig, tokenizer, start: Start, device: torch.device) -> torch.nn.Module:
        """The starting model on `device`, with LoRA adapters when `model.lora` is set."""
        model = start.model if start.model is not None else self.load_model(config, start.source, device)
        return model_start.ready_to_train(model, config, tokenizer, start, device)

    def unsharded_structure(self, config: RecipeConfig, model: torch.nn.Module, start: Start) -> torch.nn.Module:
        """A plain single-process model of the trained model's structure (before LoRA), to be
        filled with the gathered weights of a sharded one."""
        from posttrain.models.architectures import build_model

        return build_model(model.config, seed=0)

    def export(self, trainer, config: RecipeConfig, tokenizer, start: Start, run_dir: Path) -> dict[str, str | None]:
        """Write the trained model as an HF directory `<run dir>/checkpoint` (merged, for LoRA)
        and, for LoRA, the PEFT adapter `<run dir>/adapter`. Collective under
        torch.distributed; rank 0 writes. Returns `{"checkpoint_dir": ..., "adapter_dir": ...}`."""
        return model_start.export_causal_lm(self, trainer, config, tokenizer, start, Path(run_dir))


SPECS: dict[str, RecipeSpec] = {}


def register(spec: RecipeSpec) -> RecipeSpec:
    """Add a recipe's spec to the registry, under its config class's `kind` (each recipe module
    of this package registers its specs when the package is imported)."""
    if spec.kind in SPECS:
        raise ValueError(f"recipe {spec.kind!r} is registered twice")
    SPECS[spec.kind] = spec
    return spec


def recipe_spec(recipe) -> RecipeSpec:
    """The spec of a recipe config (any `RecipeConfig`) or of a recipe kind (`"dpo"`)."""
    kind = recipe if isinstance(recipe, str) else type(recipe).kind
    try:
        return SPECS[kind]
    except KeyError:
        raise ValueError(f"unknown recipe {kind!r}; known: {sorted(SPECS)}") from None


class PairRecipeSpec(RecipeSpec):
    """A recipe trained on preference pairs packed as trees (prompt once, both responses
    attending to it): DPO, reward models, KTO, ORPO."""

    records = "pairs"

    def prepare_pairs(self, pairs: dict[str, list], config: RecipeConfig, heldout: bool = False) -> dict[str, list]:
        """The tokenized pairs as this recipe trains on them (default: as they are)."""
        return pairs

    def precomputed_reference(self, config: RecipeConfig) -> bool:
        """Whether the `reference` step scores every pair once (`scores_reference` recipes)."""
        return self.scores_reference

    def pair_tables(self, config: RecipeConfig, samples: dict[str, list]) -> dict[str, torch.Tensor]:
        """Per-pair values attached to each batch by pair id, beside `ref_logps` (default: none)."""
        return {}

    def batches(self, config, samples, pad_id, rows_per_rank, state, rank, world_size, ref_logps=None):
        from posttrain.data.pair_stream import preference_batches

        return preference_batches(samples, config.data.sources, config.seed, config.pack, pad_id, rows_per_rank,
                                  ref_logps=ref_logps, tables=self.pair_tables(config, samples),
                                  shared_prompt=config.shared_prompt, state=state, rank=rank, world_size=world_size)
