"""The native rollout engine (posttrain.rl.native): greedy output equals transformers' `generate`
token for token on all five architectures and through the transformers fallback, alone and
batched; seeded samples are reproducible in any batch; the log-probs it reports equal the
trainer's recomputation; weight updates apply whole or not at all; bad input is refused.
Those first three hold under both decode backends (`decode_backend`: the torch reference and
the CPU kernels); the rest run the default (torch)."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.architectures import (
    ARCHITECTURES,
    build_model,
    hf_named_tensors,
    load_hf_checkpoint,
    save_hf_checkpoint,
    tiny_config,
)
from posttrain.rl.engine import Completion, PromptTooLong, RolloutEngine, SamplingConfig, WeightUpdateError
from posttrain.rl.native import NativeEngine, left_pad
from posttrain.rl.sync import recompute_logprobs

EOS = 1  # tiny_config's eos_token_id
MAX_NEW = 10
GREEDY = SamplingConfig(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=(EOS,))


def tiny(arch: str, seed: int = 3):
    # a larger init spread than the default keeps the argmax away from near-ties, so the
    # comparisons test the implementation rather than float rounding
    return build_model(tiny_config(arch, initializer_range=0.2), seed=seed).eval()


@pytest.fixture(params=["torch", "cpu_kernels"])
def decode_backend(request) -> str:
    if request.param == "cpu_kernels":
        from posttrain.rl.cpu_kernels import kernels

        if kernels.load() is None:
            pytest.skip("no C compiler for the decode kernels")
    return request.param


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, 250, (n,), generator=gen).tolist() for n in (5, 1, 9, 3, 12, 5, 2, 20)]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_model(request, tmp_path_factory):
    """(arch, our model, its HF directory, transformers' model of it)."""
    from transformers import AutoModelForCausalLM

    model = tiny(request.param)
    hf_dir = save_hf_checkpoint(model, tmp_path_factory.mktemp(request.param) / "hf")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return request.param, model, hf_dir, hf


def hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy `generate` of a left-padded batch, each row cut after its EOS."""
    ids, _, docs = left_pad(prompts, "cpu")
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=(docs >= 0).long(), do_sample=False, max_new_tokens=MAX_NEW,
                          eos_token_id=EOS, pad_token_id=EOS)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return rows


def token_ids(groups: list[list[Completion]]) -> list[list[int]]:
    return [g[0].token_ids for g in groups]


def test_cached_forward_equals_the_full_forward(arch_model):
    """Prefill part of each left-padded row, then one token at a time: the logits of every real
    position equal one uncached forward of the whole batch."""
    _, model, _, _ = arch_model
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in (20, 7, 13)]
    ids, pos, docs = left_pad(seqs, "cpu")
    with torch.no_grad():
        full = model.compute_logits(model(ids, pos, docs))
        cache = model.new_cache(3, ids.shape[1])
        steps = [model.compute_logits(model(ids[:, :5], pos[:, :5], docs[:, :5], cache=cache))]
        for t in range(5, ids.shape[1]):
            steps.append(model.compute_logits(model(ids[:, t:t + 1], pos[:, t:t + 1], docs[:, t:t + 1], cache=cache)))
    real = docs >= 0
    assert (torch.cat(steps, dim=1) - full)[real].abs().max() < 1e-4


def test_decode_steps_read_the_same_rotary_tables_bitwise(arch_model):
    """A decode step's rotary tables come from per-cache tables of every slot position: bitwise
    the tables the rotary modules compute for those positions (every layer type), and positions
    past the cache's slots are computed directly."""
    _, model, _, _ = arch_model
    cache = model.new_cache(4, 40)
    position_ids_BT = torch.tensor([[0], [7], [39], [21]])
    with torch.no_grad():
        read = model._slot_rotary_tables(cache, position_ids_BT, torch.float32)
        again = model._slot_rotary_tables(cache, position_ids_BT.flip(0), torch.float32)
        computed = model._rotary_tables(position_ids_BT, torch.float32)
        beyond = model._slot_rotary_tables(cache, torch.tensor([[40]]), torch.float32)
        forked = model._slot_rotary_tables(cache.fork(2), position_ids_BT.repeat_interleave(2, 0), torch.float32)
    assert read.keys() == computed.keys() and len(cache.derived) == 1
    for layer_type, (cos, sin) in computed.items():
        assert torch.equal(read[layer_type][0], cos) and torch.equal(read[layer_type][1], sin)
        assert torch.equal(again[layer_type][0], cos.flip(0))
        assert torch.equal(forked[layer_type][1], sin.repeat_interleave(2, 0))
    assert torch.equal(beyond[next(iter(beyond))][0], model._rotary_tables(torch.tensor([[40]]), torch.float32)[
        next(iter(beyond))][0])


def test_greedy_equals_transformers_generate_alone_and_batched(arch_model, prompts, decode_backend):
    _, model, _, hf = arch_model
    engine = NativeEngine(model, decode_backend=decode_backend)
    assert isinstance(engine, RolloutEngine) and engine.decode_identity()["backend"] == decode_backend
    alone = [token_ids(engine.generate([p], GREEDY))[0] for p in prompts]
    assert len({tuple(o) for o in alone}) > 1  # not degenerate
    theirs_alone = [hf_greedy(hf, [p])[0] for p in prompts]
    assert alone == theirs_alone
    for rows in (3, len(prompts)):
        batched = NativeEngine(model, max_batch_rows=rows, decode_backend=decode_backend).generate(prompts, GREEDY)
        assert token_ids(batched) == alone
    assert hf_greedy(hf, prompts) == alone  # transformers batched agrees too


def test_transformers_fallback_generates_the_same(arch_model, prompts):
    _, model, hf_dir, _ = arch_model
    ours = token_ids(NativeEngine(model).generate(prompts, GREEDY))
    fallback = NativeEngine.from_pretrained(hf_dir, backend="transformers")
    assert fallback.transformers_backend
    assert token_ids(fallback.generate(prompts, GREEDY)) == ours
    sampling = SamplingConfig(n=3, temperature=0.8, max_new_tokens=MAX_NEW, seed=5)
    theirs = fallback.generate(prompts[:3], sampling)
    mine = NativeEngine(model).generate(prompts[:3], sampling)
    assert [[c.token_ids for c in g] for g in theirs] == [[c.token_ids for c in g] for g in mine]


def test_stop_tokens_end_completions_and_are_kept(prompts):
    model = tiny("qwen3")
    free = token_ids(NativeEngine(model).generate(prompts, SamplingConfig(temperature=0, max_new_tokens=MAX_NEW)))
    stop = free[0][3]
    groups = NativeEngine(model).generate(prompts, SamplingConfig(temperature=0, max_new_tokens=MAX_NEW,
                                                                  stop_token_ids=(stop,)))
    for before, (completion,) in zip(free, groups):
        if stop in before:
            assert completion.token_ids == before[: before.index(stop) + 1]
            assert (completion.finish_reason, completion.stop) == ("stop_token", stop)
            assert completion.content_ids == before[: before.index(stop)]
        else:
            assert completion.token_ids == before and completion.finish_reason == "length"
    zero = NativeEngine(model).generate(prompts[:2], SamplingConfig(temperature=0, max_new_tokens=0))
    assert [(g[0].token_ids, g[0].finish_reason) for g in zero] == [([], "length")] * 2


def test_seeded_samples_are_reproducible_in_any_batch(prompts, decode_backend):
    model = tiny("gemma3_text")
    sampling = SamplingConfig(n=4, temperature=1.0, top_k=40, top_p=0.9, max_new_tokens=MAX_NEW, seed=11,
                              stop_token_ids=(EOS, 7, 9))
    first = NativeEngine(model, decode_backend=decode_backend).generate(prompts, sampling)
    again = NativeEngine(model, max_batch_rows=5, decode_backend=decode_backend).generate(prompts, sampling)
    as_ids = lambda groups: [[c.token_ids for c in g] for g in groups]  # noqa: E731
    assert as_ids(first) == as_ids(again)
    assert all(len(g) == 4 for g in first)
    assert any(len({tuple(c.token_ids) for c in g}) > 1 for g in first)  # samples of one prompt differ
    assert {c.finish_reason for g in first for c in g} >= {"stop_token", "length"}
    other = NativeEngine(model).generate(prompts, SamplingConfig(**{**sampling.__dict__, "seed": 12}))
    assert as_ids(other) != as_ids(first)
    # a request's samples depend on its own seed only: the same prompt alone, with its seed
    seeds = tuple(range(100, 100 + len(prompts)))
    batched = NativeEngine(model).generate(prompts, SamplingConfig(**{**sampling.__dict__, "seeds": seeds}))
    alone = NativeEngine(model).generate([prompts[4]], SamplingConfig(**{**sampling.__dict__, "seeds": (seeds[4],)}))
    assert as_ids(alone)[0] == as_ids(batched)[4]


def test_top_k_one_is_greedy_and_filters_hold(prompts):
    model = tiny("llama")
    greedy = token_ids(NativeEngine(model).generate(prompts, SamplingConfig(temperature=0, max_new_tokens=MAX_NEW)))
    top1 = NativeEngine(model).generate(prompts, SamplingConfig(top_k=1, temperature=1.5, max_new_tokens=MAX_NEW))
    assert token_ids(top1) == greedy
    assert all(abs(lp) < 1e-6 for g in top1 for lp in g[0].logprobs)  # one candidate: probability 1


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "gpt_oss"])
def test_reported_logprobs_equal_the_trainers_recomputation(arch, prompts, decode_backend):
    model = tiny(arch)
    groups = NativeEngine(model, decode_backend=decode_backend).generate(
        prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=3))
    worst = 0.0
    for prompt, group in zip(prompts, groups):
        # the trainer's view: packed documents, one forward, the chunked log-prob op
        recomputed = recompute_logprobs(model, [prompt] * len(group), [c.token_ids for c in group])
        for c, theirs in zip(group, recomputed):
            worst = max(worst, float((theirs - torch.tensor(c.raw_logprobs)).abs().max()))
            # no filters at temperature 1: the sampling distribution is the model's
            assert c.logprobs == pytest.approx(c.raw_logprobs, abs=1e-5)
    assert worst <= 1e-5, worst


def test_sampling_logprobs_follow_the_temperature(prompts):
    model = tiny("qwen3")  # no soft-capping: log_softmax(logits / T) is the sampling distribution
    groups = NativeEngine(model).generate(prompts[:4], SamplingConfig(temperature=0.7, max_new_tokens=MAX_NEW, seed=2))
    for prompt, (c,) in zip(prompts, groups):
        seq = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = model.compute_logits(model(seq, torch.arange(seq.shape[1])[None], torch.zeros_like(seq)))[0]
        steps = logits[len(prompt) - 1: len(prompt) - 1 + len(c.token_ids)]
        expected = torch.log_softmax(steps / 0.7, dim=-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert float((expected - torch.tensor(c.logprobs)).abs().max()) <= 1e-5
        assert c.logprobs != pytest.approx(c.raw_logprobs, abs=1e-3)


def test_prompts_at_the_context_limit_stop_with_length():
    model = build_model(tiny_config("qwen3", max_position_embeddings=16, initializer_range=0.2), seed=0)
    (c,), = NativeEngine(model).generate([list(range(2, 15))], SamplingConfig(temperature=0, max_new_tokens=10))
    assert len(c.token_ids) == 3 and c.finish_reason == "length"
    with pytest.raises(PromptTooLong, match="prompt 1 has 16 tokens; the model's context is 16"):
        NativeEngine(model).generate([[2, 3], list(range(2, 18))], GREEDY)


@pytest.mark.parametrize("bad, message", [
    (dict(n=0), "n must be an int >= 1"),
    (dict(stop_strings=(5,)), "stop_strings must be strings, got 5 .int."),
    (dict(stop_strings="###"), "got the string"),
    (dict(stop_token_ids=("x",)), "stop_token_ids must be non-negative ints"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an int >= 0"),
])
def test_bad_sampling_configs_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**bad)


def test_bad_prompts_are_refused_by_index():
    engine = NativeEngine(tiny("qwen3"))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[3], []], GREEDY)
    with pytest.raises(ValueError, match="prompt 0 holds token id 250, outside the vocabulary"):
        engine.generate([[3, 250]], GREEDY)
    with pytest.raises(ValueError, match="prompt 0 is text"):
        engine.generate(["hello"], GREEDY)
    with pytest.raises(ValueError, match="stop_strings need an engine with a tokenizer"):
        engine.generate([[3]], SamplingConfig(stop_strings=("\n",)))


def test_stop_strings_end_at_the_token_that_completes_them(tmp_path):
    from posttrain.data.demo import build_demo_tokenizer
    from posttrain.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(build_demo_tokenizer(tmp_path / "tok", texts=["12 + 34 = 46\n"] * 50,
                                                        vocab_size=300)))
    model = build_model(tiny_config("qwen3", vocab_size=len(tokenizer), initializer_range=0.2), seed=0)
    engine = NativeEngine(model, tokenizer=tokenizer)
    prompt = tokenizer.encode("12 + 34")
    free = engine.generate([prompt], SamplingConfig(temperature=0, max_new_tokens=12))[0][0]
    text = tokenizer.decode(free.token_ids)
    stop = text[len(text) // 2: len(text) // 2 + 1] if text.strip() else None
    assert stop, "the model generated no text to stop on"
    (c,), = engine.generate([prompt], SamplingConfig(temperature=0, max_new_tokens=12, stop_strings=(stop,)))
    assert (c.finish_reason, c.stop) == ("stop_string", stop)
    assert stop in tokenizer.decode(c.token_ids) and stop not in tokenizer.decode(c.token_ids[:-1])
    assert c.token_ids == free.token_ids[: len(c.token_ids)] and c.text is not None


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_weight_updates_apply_whole_or_not_at_all(backend, prompts, tmp_path):
    start, target = tiny("qwen3", seed=3), tiny("qwen3", seed=4)  # tied embeddings
    engine = NativeEngine.from_pretrained(save_hf_checkpoint(start, tmp_path / "start"), backend=backend)
    before = token_ids(engine.generate(prompts, GREEDY))
    wanted = token_ids(NativeEngine(target).generate(prompts, GREEDY))
    assert before != wanted
    weights = dict(hf_named_tensors(target))
    assert "lm_head.weight" in weights  # tied: the full state dict names the head too

    broken = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(WeightUpdateError, match="missing tensors .'model.norm.weight'"):
        engine.update_weights(broken.items())
    misshaped = {**weights, "model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(WeightUpdateError, match=r"'model.layers.0.self_attn.q_proj.weight'.*shape \(3, 3\)"):
        engine.update_weights(misshaped.items())
    with pytest.raises(WeightUpdateError, match="model.extra.weight"):
        engine.update_weights([*weights.items(), ("model.extra.weight", torch.zeros(2))])
    assert token_ids(engine.generate(prompts, GREEDY)) == before  # nothing changed

    engine.update_weights(weights.items())
    assert token_ids(engine.generate(prompts, GREEDY)) == wanted


def test_update_with_a_merged_lora_model(prompts, tmp_path):
    from posttrain.config.schema import LoraConfig
    from posttrain.models.lora import apply_lora

    start = tiny("qwen3")
    adapted = tiny("qwen3")
    apply_lora(adapted, LoraConfig(rank=4, alpha=8, targets=["q", "v", "up"]), seed=0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.5)
    engine = NativeEngine(start)
    engine.update_weights(hf_named_tensors(adapted))
    merged = load_hf_checkpoint(save_hf_checkpoint(adapted, tmp_path / "merged"))
    assert token_ids(engine.generate(prompts, GREEDY)) == token_ids(NativeEngine(merged).generate(prompts, GREEDY))
    assert token_ids(engine.generate(prompts, GREEDY)) == token_ids(NativeEngine(adapted).generate(prompts, GREEDY))
