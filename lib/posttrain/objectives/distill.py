"""Knowledge distillation: the student learns the teacher's next-token distribution at every
loss position (the positions with a label: the assistant tokens of packed chat rows).

Per loss position the loss is `(1 - hard_weight) * T^2 * D(teacher || student) + hard_weight
* CE(label)` (`posttrain.ops.kd`: forward KL, reverse KL or generalised JSD at temperature
`T`), normalised like SFT by the loss tokens of the step across micro-batches and workers.
Metrics per loss token: `kd` (`T^2 D`) and `ce` (the student's cross-entropy on the labels,
whether or not it is mixed in).

Where the teacher's distribution comes from:
- a live teacher (`teacher`): a frozen model (`freeze_teacher`: eval mode, no gradients,
  outside the optimizer and the checkpoints) run under `no_grad` on the same packed batch;
  the two output projections are formed one chunk of positions at a time, never two
  `[N, V]` logits; a teacher sharded by FSDP2 is resharded after each use;
- the offline cache (`cache`, `posttrain.objectives.teacher_cache.TeacherCache`): its stored
  top-k per position, the tail as one bucket; no teacher in memory.

Both models must share token ids (`check_shared_vocabulary`): the loss runs over the shared
vocabulary `[0, vocab_size)`, so rows of either output weight beyond it (padding) never get
probability. A MoE student's router load-balancing loss is not added (use SFT for that).
"""

from __future__ import annotations

import torch

from posttrain.config.recipes import DistillSection
from posttrain.ops.kd import chunked_kd_loss, chunked_kd_topk_loss
from posttrain.ops.losses import IGNORE_INDEX
from posttrain.train.objective import Objective, ObjectiveOutput, label_count


class VocabularyMismatch(ValueError):
    """Teacher and student do not share token ids."""


def check_shared_vocabulary(student_tokenizer, teacher_tokenizer, student_vocab: int, teacher_vocab: int) -> int:
    """The size of the vocabulary both models share, or `VocabularyMismatch` naming the first
    token that differs. The teacher must have the student's tokens at the same ids; the teacher's
    output may have more rows (a padded vocabulary, e.g. Qwen3's 151,936 rows for 151,669
    tokens), and those are excluded from the softmax. A teacher with real tokens the student
    lacks is refused (the student could never produce them)."""
    student_ids = _id_to_token(student_tokenizer)
    teacher_ids = _id_to_token(teacher_tokenizer)
    size = len(student_ids)
    for i in range(min(size, len(teacher_ids))):
        if student_ids[i] != teacher_ids[i]:
            raise VocabularyMismatch(f"teacher and student tokenizers differ at id {i}: the student's token is "
                                     f"{student_ids[i]!r}, the teacher's {teacher_ids[i]!r}; distillation needs the "
                                     "same token ids (use the teacher's tokenizer for the student)")
    if len(teacher_ids) < size:
        raise VocabularyMismatch(f"the teacher's tokenizer has {len(teacher_ids)} tokens, the student's {size}: the "
                                 f"teacher has no token for ids {len(teacher_ids)}..{size - 1} "
                                 f"(first: {student_ids[len(teacher_ids)]!r})")
    if len(teacher_ids) > size:
        raise VocabularyMismatch(f"the teacher's tokenizer has {len(teacher_ids) - size} tokens the student's lacks "
                                 f"(first: id {size}, {teacher_ids[size]!r}); distillation needs the same token ids")
    for who, rows in (("student", student_vocab), ("teacher", teacher_vocab)):
        if rows < size:
            raise VocabularyMismatch(f"the {who} model's output has {rows} rows for a {size}-token vocabulary")
    return size


def _id_to_token(tokenizer) -> list[str]:
    vocab = tokenizer.get_vocab()  # includes added tokens
    tokens = [None] * (max(vocab.values()) + 1 if vocab else 0)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens


def freeze_teacher(teacher: torch.nn.Module) -> torch.nn.Module:
    """The teacher as the objective uses it: eval mode, no parameter requires a gradient."""
    teacher.eval().requires_grad_(False)
    return teacher


class DistillObjective(Objective):
    """See the module docstring. Exactly one of `teacher` (a frozen model) and `cache` (a
    loaded `TeacherCache`) is given. `vocab_size`: the shared vocabulary
    (`check_shared_vocabulary`)."""

    name = "distill"
    unit = "tokens"
    metric_names = ("kd", "ce")

    def __init__(self, vocab_size: int, settings: DistillSection | None = None, teacher: torch.nn.Module | None = None,
                 cache=None):
        """`settings`: the recipe's `distill` section (its loss, `beta`, `temperature` and
        `hard_weight`, each with its one default and bounds); `teacher` or `cache`: what the
        student learns from."""
        d = settings or DistillSection(teacher="")
        if (teacher is None) == (cache is None):
            raise ValueError("a distillation objective needs exactly one of a teacher model and a teacher cache")
        self.vocab_size = int(vocab_size)
        self.teacher = None if teacher is None else freeze_teacher(teacher)
        self.cache = cache
        self.loss, self.beta, self.temperature, self.hard_weight = d.loss, float(d.beta), float(d.temperature), float(
            d.hard_weight)
        self.name = f"distill_{d.loss}"

    def count(self, batch: dict) -> torch.Tensor:
        return label_count(batch)

    def __call__(self, model: torch.nn.Module, batch: dict) -> ObjectiveOutput:
        hidden_BTD = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
        labels_BT = batch["labels"]
        keep_BT = labels_BT != IGNORE_INDEX
        student_MD = hidden_BTD[keep_BT]
        labels_M = labels_BT[keep_BT]
        settings = dict(loss=self.loss, beta=self.beta, temperature=self.temperature, labels_N=labels_M,
                        hard_weight=self.hard_weight, student_softcap=getattr(model, "logit_softcap", None))
        if self.cache is not None:
            ids_MK, logp_MK = self.cache.lookup(batch)
            out = chunked_kd_topk_loss(student_MD, model.output_weight, ids_MK, logp_MK, self.vocab_size, **settings)
        else:
            with torch.no_grad():
                teacher_MD = self.teacher(batch["input_ids"], batch["position_ids"], batch["doc_ids"])[keep_BT]
                teacher_weight = self.teacher.output_weight
            out = chunked_kd_loss(student_MD, model.output_weight, teacher_MD, teacher_weight, self.vocab_size,
                                  teacher_softcap=getattr(self.teacher, "logit_softcap", None), **settings)
            reshard = getattr(self.teacher, "reshard", None)
            if reshard is not None:  # FSDP2: free the gathered teacher weights until its next forward
                reshard()
        return ObjectiveOutput(out.loss_sum, keep_BT.sum(), {"kd": out.kd_sum, "ce": out.ce_sum})
