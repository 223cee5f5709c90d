"""The distillation objective, the teacher step and the offline teacher cache, on tiny models:
gradients against the naive full-logit loss (tied and untied heads), the teacher's checks
(token ids, verifier, a missing teacher), its identity in the checkpoints, and the top-k cache
(lookup by document, size, the tail bucket)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from posttrain.config.schema import DistillSection
from posttrain.data.packer import iter_batches, pack_samples
from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config
from posttrain.objectives.distill import DistillObjective, VocabularyMismatch, check_shared_vocabulary
from posttrain.ops.kd import KD_LOSSES, naive_kd_loss
from posttrain.ops.losses import IGNORE_INDEX

VOCAB = 96


def _model(seed, tied=True, hidden=32, layers=2, vocab=VOCAB, dtype=torch.float32):
    config = tiny_config("qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         tie_word_embeddings=tied, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    return build_model(config, seed=seed).to(dtype)


def _samples(n=12, seed=0):
    from posttrain.data.chat import TokenizedSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        out.append(TokenizedSample(ids, mask))
    return out


def _batch(samples, row_length=48, rows=4):
    packed, _ = pack_samples(samples, row_length, pad_id=0)
    return next(iter(iter_batches(packed, rows)))


def _naive_objective(student, teacher, batch, vocab, **kw):
    keep = batch["labels"] != IGNORE_INDEX
    h = student(batch["input_ids"], batch["position_ids"], batch["doc_ids"])[keep]
    with torch.no_grad():
        t = teacher(batch["input_ids"], batch["position_ids"], batch["doc_ids"])[keep]
    return naive_kd_loss(h @ student.output_weight[:vocab].T, t @ teacher.output_weight[:vocab].T,
                         labels_N=batch["labels"][keep], **kw)


@pytest.mark.parametrize("loss", KD_LOSSES)
@pytest.mark.parametrize("tied", [True, False])
def test_objective_gradients_equal_the_naive_loss(loss, tied):
    """Every student parameter's gradient (the tied embedding gets both its uses) within 1e-5
    of the full-logit loss, in float32, with a teacher of another size and a padded output."""
    teacher = _model(1, tied=not tied, hidden=48, layers=3, vocab=VOCAB + 32)  # rows beyond VOCAB: padding
    batch = _batch(_samples())
    kw = dict(loss=loss, beta=0.4, temperature=2.0, hard_weight=0.3)
    grads = []
    for chunked in (True, False):
        student = _model(0, tied=tied)
        if chunked:
            out = DistillObjective(VOCAB, DistillSection(teacher="", **kw), teacher=teacher)(student, batch)
            assert int(out.count) == int((batch["labels"] != IGNORE_INDEX).sum())
            loss_sum = out.loss_sum
        else:
            loss_sum = _naive_objective(student, teacher, batch, VOCAB, **kw)
        loss_sum.backward()
        grads.append({n: p.grad.clone() for n, p in student.named_parameters()})
    assert not any(p.requires_grad for p in teacher.parameters())
    for name, ref in grads[1].items():
        rel = float((grads[0][name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        assert rel < 1e-5, (name, rel)


def test_a_student_equal_to_its_teacher_has_no_kd_loss():
    teacher = _model(0)
    objective = DistillObjective(VOCAB, DistillSection(teacher="", temperature=3.0), teacher=teacher)
    out = objective(_model(0), _batch(_samples()))
    assert abs(float(out.metric_sums["kd"])) < 1e-5 and float(out.metric_sums["ce"]) > 0


class _Tok:
    def __init__(self, tokens):
        self.tokens = tokens

    def get_vocab(self):
        return {t: i for i, t in enumerate(self.tokens)}


def test_shared_vocabulary_rules():
    assert check_shared_vocabulary(_Tok(["a", "b", "c"]), _Tok(["a", "b", "c"]), 3, 64) == 3
    with pytest.raises(VocabularyMismatch, match="differ at id 1: the student's token is 'b', the teacher's 'x'"):
        check_shared_vocabulary(_Tok(["a", "b"]), _Tok(["a", "x"]), 2, 2)
    with pytest.raises(VocabularyMismatch, match="tokens the student's lacks"):
        check_shared_vocabulary(_Tok(["a", "b"]), _Tok(["a", "b", "c"]), 2, 3)
    with pytest.raises(VocabularyMismatch, match="has no token for ids 1..1"):
        check_shared_vocabulary(_Tok(["a", "b"]), _Tok(["a"]), 2, 2)
    with pytest.raises(VocabularyMismatch, match="teacher model's output has 2 rows"):
        check_shared_vocabulary(_Tok(["a", "b", "c"]), _Tok(["a", "b", "c"]), 3, 2)


# ------------------------------------------------------------------------------ the teacher cache


def test_cache_lookup_follows_documents_into_any_packing(tmp_path):
    from posttrain.objectives.teacher_cache import TeacherCache, TeacherCacheError, build_teacher_cache
    from posttrain.ops.kd import chunked_topk_logprobs

    teacher = _model(1, hidden=48)
    samples = _samples(20)
    manifest = build_teacher_cache(teacher, samples + samples[:3], tmp_path / "cache", top_k=5, temperature=2.0,
                                   vocab_size=VOCAB, row_length=48, pad_id=0, identity={"sha256": "abc"},
                                   rows_per_batch=2, shard_samples=7)
    assert manifest["num_samples"] == 20 and len(manifest["shards"]) == 3  # repeats stored once
    positions = sum(sum(s.loss_mask[1:]) for s in samples)  # every trained target
    assert manifest["num_positions"] == positions
    # a 4-byte id and a 4-byte log-prob per entry, 24 bytes of key and offset per sample, a header per shard
    assert manifest["bytes"] <= positions * 8 * 5 + 24 * 20 + 3 * 512
    cache = TeacherCache.load(tmp_path / "cache", top_k=5, temperature=2.0, vocab_size=VOCAB,
                              identity={"sha256": "abc"})
    batch = _batch(list(reversed(samples)), row_length=64, rows=3)  # another packing, another order
    ids, logp = cache.lookup(batch)
    keep = batch["labels"] != IGNORE_INDEX
    with torch.no_grad():
        hidden = teacher(batch["input_ids"], batch["position_ids"], batch["doc_ids"])[keep]
    want_ids, want_logp = chunked_topk_logprobs(hidden, teacher.output_weight, VOCAB, 5, temperature=2.0)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(logp, want_logp, atol=1e-5)
    with pytest.raises(TeacherCacheError, match="made with temperature 2.0, the recipe asks for 1.0"):
        TeacherCache.load(tmp_path / "cache", top_k=5, temperature=1.0, vocab_size=VOCAB)
    with pytest.raises(TeacherCacheError, match="was made by teacher"):
        TeacherCache.load(tmp_path / "cache", top_k=5, temperature=2.0, vocab_size=VOCAB, identity={"sha256": "x"})
    with pytest.raises(TeacherCacheError, match="does not hold a document of this batch"):
        cache.lookup(_batch(_samples(4, seed=9)))


def test_cached_objective_trains_toward_the_teacher(tmp_path):
    """With the top-k covering almost all the teacher's mass the cached loss is the full one."""
    from posttrain.objectives.teacher_cache import TeacherCache, build_teacher_cache

    teacher, samples = _model(1, hidden=48), _samples(8)
    build_teacher_cache(teacher, samples, tmp_path / "c", top_k=VOCAB, temperature=1.0, vocab_size=VOCAB,
                        row_length=48, pad_id=0)
    cache = TeacherCache.load(tmp_path / "c", top_k=VOCAB, temperature=1.0, vocab_size=VOCAB)
    batch = _batch(samples)
    full = DistillObjective(VOCAB, teacher=teacher)(_model(0), batch)
    cached = DistillObjective(VOCAB, cache=cache)(_model(0), batch)
    assert torch.allclose(cached.loss_sum, full.loss_sum, rtol=1e-5)


# ------------------------------------------------------------------------------ the teacher step


def _write_model(path: Path, tokenizer, seed=1, hidden=32, vocab=None):
    model = _model(seed, hidden=hidden, vocab=vocab or len(tokenizer))
    return save_hf_checkpoint(model, path, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset
    from posttrain.data.tokenizer import load_tokenizer

    tmp = tmp_path_factory.mktemp("tok")
    paths = write_arithmetic_dataset(tmp / "corpus", num_train=100, num_heldout=0, seed=0, max_digits=2)
    return load_tokenizer(str(build_demo_tokenizer(tmp / "tokenizer", corpus_paths=[paths["train"]], vocab_size=256)))


def _recipe(tmp: Path, teacher: str, **distill):
    from posttrain.config.schema import DistillConfig
    from posttrain.config.strict import from_dict

    data = {"name": "distill-test", "data": {"sources": [{"name": "a", "kind": "jsonl", "path": str(tmp / "a.jsonl")}],
                                             "heldout_fraction": 0.1},
            "tokenizer": {"name_or_path": str(tmp)}, "distill": {"teacher": teacher, **distill},
            "register": {"registry_dir": str(tmp / "registry")}, "train": {"device": "cpu"}}
    return from_dict(DistillConfig, data, source="test")


def test_teacher_step_checks_identity_and_errors(tmp_path, demo_tokenizer):
    from posttrain.steps import teacher as teacher_step

    good = _write_model(tmp_path / "teacher", demo_tokenizer)
    spec = teacher_step.run(_recipe(tmp_path, str(good)), demo_tokenizer, {"a": _samples(3)}, tmp_path / "run")
    assert spec.vocab_size == len(demo_tokenizer) and spec.verdict["passed"]
    assert spec.identity == teacher_step.teacher_identity(good, str(good)) and len(spec.identity["sha256"]) == 64

    with pytest.raises(teacher_step.TeacherError, match="is not a model directory"):  # a missing teacher
        teacher_step.run(_recipe(tmp_path, str(tmp_path / "nowhere")), demo_tokenizer, {}, tmp_path / "run")

    from posttrain.data.tokenizer import load_tokenizer

    other_tok = load_tokenizer("builtin:qwen3")
    other = _write_model(tmp_path / "other", other_tok, vocab=len(other_tok))
    with pytest.raises(teacher_step.TeacherError, match="tokenizers differ at id"):
        teacher_step.run(_recipe(tmp_path, str(other)), demo_tokenizer, {}, tmp_path / "run")

    broken = tmp_path / "broken"  # a checkpoint the verifier cannot load as the config describes
    _write_model(broken, demo_tokenizer)
    from safetensors.torch import load_file, save_file

    [weights_file] = sorted(broken.glob("*.safetensors"))
    tensors = load_file(str(weights_file))
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:8]
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    with pytest.raises(teacher_step.TeacherError, match="fails the logit verifier"):
        teacher_step.run(_recipe(tmp_path, str(broken)), demo_tokenizer, {}, tmp_path / "run")


def test_a_resume_against_another_teacher_is_refused_by_name(tmp_path, demo_tokenizer):
    from posttrain.steps import teacher as teacher_step
    from posttrain.steps.train_state import check_same_teacher, checkpoint_manager
    from posttrain.train.checkpoint import TrainingCheckpointError

    spec = teacher_step.TeacherSpec("t", "native", VOCAB, {"reference": "registry:big", "sha256": "a" * 64})
    manager = checkpoint_manager(_recipe(tmp_path, "registry:big"), tmp_path, teacher_identity=spec.identity)
    assert manager.fingerprint["teacher"] == {"reference": "registry:big", "sha256": "a" * 64}
    check_same_teacher(tmp_path, manager.fingerprint, spec)  # the same teacher resumes
    other = dataclasses.replace(spec, identity={"reference": "registry:other", "sha256": "b" * 64})
    with pytest.raises(TrainingCheckpointError, match=r"trained against teacher registry:big .* this run's teacher is "
                                              r"registry:other"):
        check_same_teacher(tmp_path, manager.fingerprint, other)


def test_a_transformers_backend_teacher_we_do_not_implement(tmp_path, demo_tokenizer):
    """A teacher of an architecture we do not define runs through transformers (the verifier
    does not apply: nothing of ours to compare) and teaches through the same objective."""
    from transformers import MistralConfig, MistralForCausalLM

    from posttrain.steps import teacher as teacher_step

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(demo_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=None,
                           tie_word_embeddings=False, pad_token_id=demo_tokenizer.pad_token_id)
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    demo_tokenizer.save_pretrained(str(tmp_path / "mistral"))
    recipe = _recipe(tmp_path, str(tmp_path / "mistral"), teacher_backend="transformers")
    spec = teacher_step.run(recipe, demo_tokenizer, {}, tmp_path / "run")
    assert spec.verdict is None and spec.backend == "transformers"
    teacher = teacher_step.load_teacher(spec, "cpu")
    student = _model(0, vocab=len(demo_tokenizer))
    samples = [s.__class__([i % len(demo_tokenizer) for i in s.input_ids], s.loss_mask) for s in _samples()]
    objective = DistillObjective(spec.vocab_size, DistillSection(teacher="", temperature=2.0), teacher=teacher)
    out = objective(student, _batch(samples))
    out.loss_sum.backward()
    assert float(out.metric_sums["kd"]) > 0 and student.output_weight.grad.abs().sum() > 0


def test_train_step_against_the_cached_teacher_resumes_only_with_it(tmp_path, demo_tokenizer):
    """The train step with `distill.cache`: the teacher step stores the top-k, training reads it
    (no teacher in memory), and the checkpoint records the teacher."""
    from posttrain.steps import teacher as teacher_step
    from posttrain.steps import train

    good = _write_model(tmp_path / "teacher", demo_tokenizer)
    from posttrain.data.chat import TokenizedSample

    g = torch.Generator().manual_seed(3)
    samples = {"a": [TokenizedSample(torch.randint(3, len(demo_tokenizer), (n,), generator=g).tolist(),
                                     [0] * (n // 2) + [1] * (n - n // 2)) for n in range(8, 40)]}
    recipe = _recipe(tmp_path, str(good), temperature=2.0, cache={"top_k": 8})
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, hidden_size=32, intermediate_size=64,
                                                                   num_hidden_layers=1, num_attention_heads=2,
                                                                   num_key_value_heads=1, head_dim=16),
                                 pack=dataclasses.replace(recipe.pack, row_length=64),
                                 train=dataclasses.replace(recipe.train, max_steps=4, micro_batch_size=2,
                                                           warmup_steps=0, report_to=[], progress_bar=False),
                                 checkpoint=dataclasses.replace(recipe.checkpoint, every_steps=2))
    spec = teacher_step.run(recipe, demo_tokenizer, samples, tmp_path / "run")
    assert spec.cache_manifest["num_samples"] == 32 and Path(spec.cache_dir).is_dir()
    again = teacher_step.run(recipe, demo_tokenizer, samples, tmp_path / "run")  # reused, not rebuilt
    assert again.cache_manifest == spec.cache_manifest
    result = train.run(recipe, demo_tokenizer, samples, 16, tmp_path / "run", teacher=spec)
    assert [h["step"] for h in result.history] == [1, 2, 3, 4] and all(h["kd"] >= 0 for h in result.history)
    meta = json.loads((Path(result.checkpoints_dir) / "step_00000004" / "meta.json").read_text())
    assert meta["fingerprint"]["teacher"]["sha256"] == spec.identity["sha256"]
