"""Supervised fine-tuning, end to end: ingest -> tokenize -> pack -> train -> verify -> evaluate (a foreach over the suites) -> register.

    python flows/sft_flow.py run                                   # the embedded demo (offline, CPU)
    python flows/sft_flow.py --config config configs/sft/qwen3-0.6b.yaml run
    python flows/sft_flow.py --config-value overrides '{"train.max_steps": 20}' run

Every step calls one plain function from `posttrain.steps` and stores what it returns as
artifacts, so a notebook can inspect any stage (`notebooks/inspect_run.ipynb`). Files
(checkpoints, rejected rows, metrics.jsonl) go to `<output_dir>/SFTFlow/<run id>/`; the
registered model is the artifact `model_path` (a local directory:
`AutoModelForCausalLM.from_pretrained(run.data.model_path)`), its registry reference `model_uri`
(`posttrain.registry.resolve_model_dir` turns any reference into a local directory).

Checkpoints: the train step saves complete training state under
`<output_dir>/SFTFlow/<run id>/train_state/` (`checkpoint` in the recipe) and resumes from the
newest complete one there, with the same loss trajectory as an uninterrupted run. The run
directory is an artifact of `start`, which `resume` clones, so it names the original run's
directory in a task retry (`@retry` on train), in `python flows/sft_flow.py resume` and in a
resume of a resume alike:

    python flows/sft_flow.py resume train      # after a failed or killed train step

Workers: `parallel.num_workers: 2` (`strategy: fsdp` or `ddp`) trains on that many Ray actors
with the same loss trajectory as one worker (configs/sft/tiny-2workers.yaml). Other recipe
variants: `model.arch` (random init of any registered architecture), `model.lora`
(configs/sft/tiny-lora.yaml; merged export, PEFT adapter in the artifact `adapter_dir`),
`model.backend: transformers` (any local `AutoModelForCausalLM`; see docs/architecture.md).

Cards: data sources and rejected rows (ingest), length histogram (tokenize), packing
efficiency (pack), live loss and throughput (train), the logit verdict (verify), the
evaluation table and an evidently report in a card of its own (evaluate), and an overview of
the run (end).
"""

from chat_flow import ChatRecipeFlow
from recipe_configs import ValidateRecipe, recipe_configs


@ValidateRecipe
class SFTFlow(ChatRecipeFlow):
    RECIPE = "sft"
    config, overrides = recipe_configs(RECIPE)


if __name__ == "__main__":
    SFTFlow()
