"""The recipes of non-language sequences: next-item models of interaction histories trained
from scratch, and semantic IDs (a text model's vocabulary grown by a token per item code)."""

from __future__ import annotations

from pathlib import Path

from posttrain.config.recipes import SemanticIDConfig, SequenceConfig
from posttrain.recipes import start as model_start
from posttrain.recipes.spec import RecipeSpec, register
from posttrain.recipes.start import Start


class SequenceSpec(RecipeSpec):
    """Next-item language modelling of interaction histories (token cross-entropy)."""

    config_cls = SequenceConfig
    records = "sequences"


class SemanticIDSpec(RecipeSpec):
    """SFT of a text model on sessions of items named by codes. A starting model whose
    vocabulary is smaller than the recipe's tokenizer (the codes were added to it) is grown to
    it and written with the recipe's model files to `<run dir>/base`: existing rows, and so old
    logits, unchanged; the new rows drawn at random (seeded by `train.seed`), not set to the mean
    of the old ones: codes that start identical are indistinguishable as inputs, and a model
    fine-tuned from there learned only the codes' marginal distribution."""

    config_cls = SemanticIDConfig
    records = "sequences"

    def prepare_start(self, config: SemanticIDConfig, tokenizer, base_dir: Path, keep_model: bool) -> Start:
        from posttrain.models.architectures import load_hf_checkpoint, save_hf_checkpoint
        from posttrain.models.vocab import extend_vocabulary

        model_start.check_model_recipe(config)
        parent = model_start.trained_start_dir(config)
        if parent is None:
            return model_start.causal_lm_start(config, tokenizer, base_dir, keep_model)
        model = load_hf_checkpoint(parent)
        vocab = tokenizer.get_vocab()
        added = sorted((t for t, i in vocab.items() if i >= model.config.vocab_size), key=vocab.get)
        extend_vocabulary(model, tokenizer, added, init="normal", seed=config.train.seed)
        print(f"[train] starting model {parent}: vocabulary grown by {len(added)} tokens to {model.config.vocab_size}")
        save_hf_checkpoint(model, base_dir, tokenizer=tokenizer)
        model_start.copy_model_files(model_start.RECIPE_MODEL_FILES, Path(base_dir).parent, Path(base_dir))
        return Start(Path(base_dir), model if keep_model else None, parent=parent)


register(SequenceSpec())
register(SemanticIDSpec())
