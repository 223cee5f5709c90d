"""The recipes trained on conversations: supervised fine-tuning and distillation."""

from __future__ import annotations

from posttrain.config.recipes import DistillConfig, SFTConfig
from posttrain.recipes.spec import ObjectiveInputs, RecipeSpec, register


class SFTSpec(RecipeSpec):
    """Supervised fine-tuning: token cross-entropy on the assistant turns (the base's defaults)."""

    config_cls = SFTConfig


class DistillSpec(RecipeSpec):
    """Knowledge distillation: the student against its teacher (the `teacher` step's
    `TeacherSpec`): the teacher's stored top-k (`distill.cache`), or the teacher itself, loaded
    frozen on the student's device and sharded over its mesh as the student is."""

    config_cls = DistillConfig

    def objective(self, config: DistillConfig, inputs: ObjectiveInputs):
        from posttrain.objectives.distill import DistillObjective, freeze_teacher
        from posttrain.models.architectures import load_causal_lm
        from posttrain.recipes.start import RecipeModelError

        spec = inputs.teacher
        if spec is None:
            raise RecipeModelError("a distillation recipe trains against its teacher: run the teacher step "
                                   "(posttrain.steps.teacher.run) and pass its TeacherSpec as teacher=")
        d = config.distill
        if spec.cache_dir is not None:
            from posttrain.objectives.teacher_cache import TeacherCache

            cache = TeacherCache.load(spec.cache_dir, top_k=d.cache.top_k, temperature=d.temperature,
                                      vocab_size=spec.vocab_size, identity=spec.identity)
            return DistillObjective(spec.vocab_size, d, cache=cache)
        teacher = freeze_teacher(load_causal_lm(spec.model_dir, spec.backend, inputs.device).to(inputs.device))
        if inputs.mesh is not None:
            from posttrain.parallel.apply import apply_parallelism

            teacher = apply_parallelism(teacher, config.parallel, inputs.mesh,
                                        config.train.for_device(inputs.device.type).mixed_precision)
        return DistillObjective(spec.vocab_size, d, teacher=teacher)


register(SFTSpec())
register(DistillSpec())
