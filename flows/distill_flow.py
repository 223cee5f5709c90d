"""Knowledge distillation, end to end: ingest -> tokenize -> pack -> teacher -> train -> verify ->
evaluate -> register.

    make run                                          # the SFT demo model the demo distils (once)
    python flows/distill_flow.py run                  # the embedded demo (offline, CPU)
    python flows/distill_flow.py --config config configs/distill/demo.yaml \\
        --config-value overrides '{"distill.cache": {"top_k": 16}}' run     # against the stored top-k

The same steps as `SFTFlow` (conversations: `ChatRecipeFlow`), one more (`teacher`), and a
train step whose objective is the teacher's distribution (`posttrain.objectives.distill`,
losses chunked in `posttrain.ops.kd`). The `teacher` step resolves `distill.teacher` (a
registry entry, a directory or a hub id), checks it shares the student's token ids, verifies
its logits against transformers, records its identity (a resume against another teacher is
refused by name), and with `distill.cache` stores its top-k per loss position once (reused by
later runs). Each failure stops the run there, before training, saying what to fix; a teacher
that does not exist stops it at launch. The student is any model section (a random init of
a smaller model in the demo). Evaluation reports the base, the student and the teacher.

Cards: data (ingest), lengths (tokenize), packing (pack), the teacher (identity, verdict,
cache size), live loss with the KD and CE terms (train), the logit verdict (verify), the
evaluation table with the teacher's row and an evidently report (evaluate), an overview (end).
"""

from metaflow import card, step

import recipe_cards as cards
from chat_flow import ChatRecipeFlow
from recipe_configs import ValidateRecipe, recipe_configs


@ValidateRecipe
class DistillFlow(ChatRecipeFlow):
    RECIPE = "distill"
    config, overrides = recipe_configs(RECIPE)

    @card(type="blank", id="pack")
    @step
    def pack(self):
        """One pass over the weighted mixture, best-fit packed: rows per epoch and efficiency."""
        self._pack_samples()
        self.next(self.teacher)

    @card(type="blank", id="teacher")
    @step
    def teacher(self):
        """Resolve, check, verify and identify the teacher; store its top-k with `distill.cache`."""
        from posttrain.steps import teacher

        self.teacher_spec = teacher.run(self.recipe, self._tokenizer(), self.samples, self.run_dir)
        cards.teacher_section(cards.card("teacher"), self.teacher_spec)
        self.next(self.train)

    def _eval_others(self) -> dict:
        """The teacher is evaluated beside base and student."""
        return {"teacher": (self.teacher_spec.model_dir, self.teacher_spec.backend)}


if __name__ == "__main__":
    DistillFlow()
