"""HF checkpoint I/O: our export loads in transformers, transformers' export loads in ours,
shards round-trip, and a wrong checkpoint fails loudly, naming the tensor."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from posttrain.models.architectures import (
    HFCheckpointError,
    build_model,
    load_hf_checkpoint,
    save_hf_checkpoint,
    tiny_config,
)
from posttrain.verify.logits import randomize_weights_

B, T = 2, 16


def random_model(tied: bool, seed: int = 0):
    return randomize_weights_(build_model(tiny_config(tie_word_embeddings=tied), seed=seed), seed=seed + 1).eval()


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (B, T), generator=gen)
    return ids, torch.arange(T).expand(B, T), torch.zeros(B, T, dtype=torch.long)


@torch.no_grad()
def our_logits(model, seed=0):
    ids, pos, doc = inputs(seed)
    return model.compute_logits(model(ids, pos, doc))


@torch.no_grad()
def hf_logits(hf, seed=0):
    return hf(input_ids=inputs(seed)[0]).logits


def hf_load(path):
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return hf.eval()


def as_single_file(path):
    """Merge a saved checkpoint's shards into one `model.safetensors` dict (and drop the index)."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(path / file))
        (path / file).unlink()
    (path / "model.safetensors.index.json").unlink()
    return tensors


@pytest.mark.parametrize("tied", [False, True])
def test_save_then_transformers_loads_same_logits(tmp_path, tied):
    model = random_model(tied)
    out = save_hf_checkpoint(model, tmp_path / "ckpt")
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "generation_config.json", "model-00001-of-00001.safetensors",
                     "model.safetensors.index.json"]
    stored = load_file(out / "model-00001-of-00001.safetensors")
    assert stored["model.embed_tokens.weight"].shape == (250, 64)  # vocab padding removed
    assert ("lm_head.weight" in stored) == (not tied)  # as transformers' save_pretrained does
    assert len(stored) == 2 + 11 * 2 + (not tied)

    hf = hf_load(out)
    assert type(hf) is transformers.Qwen3ForCausalLM
    ours = our_logits(model)
    assert ours.abs().mean() > 0.1
    assert (ours - hf_logits(hf)).abs().max() <= 1e-4
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 1


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_checkpoint_loads_in_ours(tmp_path, tied):
    cfg = transformers.Qwen3Config(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.2, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms are initialised to 1; make them matter
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")

    model = load_hf_checkpoint(tmp_path / "hf")
    assert model.config.rope_theta == 50000.0 and model.config.tie_word_embeddings is tied
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    assert torch.count_nonzero(model.output_weight[250:]) == 0
    assert (our_logits(model) - hf_logits(hf)).abs().max() <= 1e-4


def test_sharded_roundtrip(tmp_path):
    model = random_model(tied=False)
    out = save_hf_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in dict(model.named_parameters()).values()) \
        - (256 - 250) * 64 * 4 * 2  # padding is not stored
    loaded = load_hf_checkpoint(out)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (our_logits(model) - hf_logits(hf_load(out))).abs().max() <= 1e-4  # transformers reads shards too


def test_single_file_checkpoint_and_dtype(tmp_path):
    model = random_model(tied=True)
    out = save_hf_checkpoint(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    save_file(as_single_file(out), out / "model.safetensors", metadata={"format": "pt"})
    kept = load_hf_checkpoint(out, dtype=None)
    assert kept.output_weight.dtype == torch.bfloat16
    assert torch.equal(kept.output_weight.float(), model.output_weight.bfloat16().float())
    assert load_hf_checkpoint(out).output_weight.dtype == torch.float32


@pytest.fixture
def broken(tmp_path):
    """A single-file copy of a tiny untied checkpoint: (dir, tensors) to edit and rewrite."""
    out = save_hf_checkpoint(random_model(tied=False), tmp_path / "ckpt")
    return out, as_single_file(out)


def rewrite(out, tensors):
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def test_wrong_shape_names_tensor(broken):
    out, tensors = broken
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    rewrite(out, tensors)
    with pytest.raises(HFCheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        load_hf_checkpoint(out)


def test_missing_tensor_names_tensor(broken):
    out, tensors = broken
    del tensors["model.layers.0.mlp.up_proj.weight"]
    rewrite(out, tensors)
    with pytest.raises(HFCheckpointError, match=r"missing.*model\.layers\.0\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(out)


def test_unknown_tensor_names_tensor(broken):
    out, tensors = broken
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    rewrite(out, tensors)
    with pytest.raises(HFCheckpointError, match=r"unexpected.*model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_hf_checkpoint(out)


def test_index_disagreeing_with_shard_is_an_error(tmp_path):
    out = save_hf_checkpoint(random_model(tied=False), tmp_path / "ckpt", max_shard_bytes=40_000)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-{:05d}.safetensors".format(
        len(set(index["weight_map"].values())))
    index_path.write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match="model.norm.weight"):
        load_hf_checkpoint(out)


def test_tied_checkpoint_with_redundant_lm_head(tmp_path):
    model = random_model(tied=True)
    out = save_hf_checkpoint(model, tmp_path / "ckpt")
    tensors = as_single_file(out)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    rewrite(out, tensors)
    assert torch.equal(load_hf_checkpoint(out).output_weight, model.output_weight)
    tensors["lm_head.weight"][0, 0] += 1.0
    rewrite(out, tensors)
    with pytest.raises(HFCheckpointError, match="lm_head.weight"):
        load_hf_checkpoint(out)


def test_refuses_pickle_checkpoints(tmp_path):
    out = save_hf_checkpoint(random_model(tied=True), tmp_path / "ckpt")
    as_single_file(out)
    (out / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(HFCheckpointError, match="safetensors only"):
        load_hf_checkpoint(out)


class FailingTokenizer:
    eos_token_id = 1

    def save_pretrained(self, path):
        raise OSError("disk full")


def test_save_is_atomic(tmp_path):
    first, second = random_model(tied=False, seed=0), random_model(tied=False, seed=5)
    target = tmp_path / "ckpt"
    save_hf_checkpoint(first, target)
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(second, target, tokenizer=FailingTokenizer())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dir left behind
    assert torch.equal(load_hf_checkpoint(target).output_weight, first.output_weight)  # old one intact
    save_hf_checkpoint(second, target)  # overwriting a finished checkpoint works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert torch.equal(load_hf_checkpoint(target).output_weight, second.output_weight)


def test_tokenizer_files_and_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(20)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>")
    model = build_model(tiny_config(vocab_size=22, eos_token_id=None), seed=0)
    out = save_hf_checkpoint(model, tmp_path / "ckpt", tokenizer=tok)
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    assert transformers.AutoTokenizer.from_pretrained(out)("w3 w4")["input_ids"] == [5, 6]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 1
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 1
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 1


def test_loading_and_evaluating_a_checkpoint_imports_no_compiler_or_checkpoint_machinery(tmp_path):
    """A fresh interpreter loads every architecture's checkpoint (built on meta) and takes a
    held-out loss without importing `torch._dynamo` (torch's meta `normal_` would, from an
    `nn.Embedding` drawing weights on meta) or `torch.distributed.checkpoint`: 3-7 CPU-s more for
    each evaluation or rollout process otherwise. The equal-init half: on the CPU, our
    `Embedding` draws what `nn.Embedding` draws."""
    import subprocess
    import sys

    from posttrain.models.layers import Embedding

    torch.manual_seed(3)
    expected = torch.nn.Embedding(11, 4, padding_idx=0).weight
    torch.manual_seed(3)
    assert torch.equal(Embedding(11, 4, padding_idx=0).weight, expected)

    script = f"""
import sys
import torch
from posttrain.eval.heldout import evaluate_loss
from posttrain.models.architectures import ARCHITECTURES, build_model, load_hf_checkpoint, save_hf_checkpoint, tiny_config

for i, model_type in enumerate(ARCHITECTURES):
    save_hf_checkpoint(build_model(tiny_config(model_type), seed=0), {str(tmp_path)!r} + f"/{{i}}")
    model = load_hf_checkpoint({str(tmp_path)!r} + f"/{{i}}").eval()
ids = torch.randint(0, 250, (2, 8))
batch = {{"input_ids": ids, "labels": ids, "position_ids": torch.arange(8).expand(2, 8),
          "doc_ids": torch.zeros(2, 8, dtype=torch.long)}}
print(evaluate_loss(build_model(tiny_config("qwen3"), seed=0), [batch]) > 0)
print(sorted(m for m in ("torch._dynamo", "torch.distributed.checkpoint") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-2:] == ["True", "[]"]
