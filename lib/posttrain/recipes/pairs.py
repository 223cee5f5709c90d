"""The recipes trained on preference pairs that were here first: DPO and reward models."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.config.recipes import DPOConfig, RMConfig
from posttrain.recipes import start as model_start
from posttrain.recipes.spec import ObjectiveInputs, PairRecipeSpec, register
from posttrain.recipes.start import RecipeModelError, Start

if TYPE_CHECKING:
    import torch

SEQUENCE_CLASSIFIER_DIR = "sequence_classifier"  # inside a reward model's export


class DPOSpec(PairRecipeSpec):
    """Direct preference optimisation against the reference's log-probabilities: precomputed
    by the flow's `reference` step, or (`dpo.reference: on_the_fly`) scored per batch by the
    policy with its LoRA adapters disabled, else by a frozen copy of the starting model."""

    config_cls = DPOConfig
    scores_reference = True

    def objective(self, config: DPOConfig, inputs: ObjectiveInputs):
        from posttrain.models.lora import has_lora
        from posttrain.objectives.dpo import DPOObjective, on_the_fly_reference

        objective = DPOObjective(config.dpo)
        if config.dpo.reference == "on_the_fly" and objective.needs_reference:
            frozen = None if has_lora(inputs.model) else self.load_model(config, inputs.start.source, inputs.device)
            objective.reference = on_the_fly_reference(inputs.model, frozen=frozen)
        return objective

    def precomputed_reference(self, config: DPOConfig) -> bool:
        """`dpo.reference: precomputed` (else the train step scores each batch)."""
        return config.dpo.reference == "precomputed"


class RewardModelSpec(PairRecipeSpec):
    """A reward model: the starting model's backbone under a scalar value head (new, seeded by
    `train.seed`, or the one the starting model has), written with the backbone to
    `<run dir>/base`; exported in the same format plus, inside it, `sequence_classifier/`:
    the model as transformers' `AutoModelForSequenceClassification`, which verification
    compares ours with."""

    config_cls = RMConfig
    stops_generation = False  # a reward model scores; it is not asked to stop

    def objective(self, config: RMConfig, inputs: ObjectiveInputs):
        from posttrain.objectives.reward import RewardObjective

        return RewardObjective(config.rm)

    def prepare_start(self, config: RMConfig, tokenizer, base_dir: Path, keep_model: bool) -> Start:
        from posttrain.models.architectures import load_causal_lm
        from posttrain.models.heads import (HEAD_CONFIG, RewardModel, ValueHead, backbone_backend, load_with_head,
                                            save_with_head)

        model_start.check_model_recipe(config)
        parent = model_start.trained_start_dir(config)
        if (parent / HEAD_CONFIG).is_file():
            model = load_with_head(parent)
            if not isinstance(model, RewardModel):
                raise RecipeModelError(f"{parent} holds a model with a {type(model.head).__name__}, not a value head")
            if backbone_backend(model.backbone) != config.model.backend:
                raise RecipeModelError(f"{parent}'s backbone was trained with model.backend "
                                       f"'{backbone_backend(model.backbone)}': set model.backend to it")
        else:
            backbone = load_causal_lm(parent, config.model.backend)
            head = ValueHead(backbone.config.hidden_size, bias=False)  # transformers' score has no bias
            head.init_weights(config.train.seed, std=config.rm.head_init_std)
            model = RewardModel(backbone, head)
        save_with_head(model, base_dir, tokenizer=tokenizer)
        return Start(Path(base_dir), model if keep_model else None, parent=parent)

    def load_model(self, config, model_dir, device=None, backend=None) -> torch.nn.Module:
        if backend is not None:  # another model's way (not this recipe's reward model)
            return super().load_model(config, model_dir, device, backend)
        from posttrain.models.heads import load_with_head

        return load_with_head(model_dir, device=device)

    def unsharded_structure(self, config, model, start: Start) -> torch.nn.Module:
        from posttrain.models.heads import load_with_head

        return load_with_head(start.source)  # the structure (the starting weights are overwritten)

    def export(self, trainer, config: RMConfig, tokenizer, start: Start, run_dir: Path) -> dict[str, str | None]:
        """`save_with_head` at `<run dir>/checkpoint` (LoRA merged) and the sequence-classifier
        export in it. Collective under torch.distributed; rank 0 writes."""
        from posttrain.models.heads import export_sequence_classifier, load_with_head, save_with_head
        from posttrain.models.lora import has_lora
        from posttrain.parallel.distributed import barrier

        checkpoint_dir = Path(run_dir) / "checkpoint"
        classifier_dir = checkpoint_dir / SEQUENCE_CLASSIFIER_DIR
        model = model_start.unsharded_copy(self, trainer, config, start)
        if model is not None:
            save_with_head(model, checkpoint_dir, tokenizer=tokenizer)
            if has_lora(model):  # the sequence classifier holds plain weights: merge a copy
                model = load_with_head(checkpoint_dir)
            export_sequence_classifier(model, classifier_dir, pad_token_id=tokenizer.pad_token_id)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(classifier_dir))
        barrier()
        model_start.finish_export(self, config, tokenizer, checkpoint_dir, Path(run_dir))
        return {"checkpoint_dir": str(checkpoint_dir), "adapter_dir": None,
                "sequence_classifier_dir": str(classifier_dir)}


register(DPOSpec())
register(RewardModelSpec())
