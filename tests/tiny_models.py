"""Tiny models the tests build offline: a random Qwen3 (or another native architecture's tiny
config) with the demo's own BPE tokenizer, saved as an HF directory (a starting model for the
preference flows, a teacher for distillation), and a random Phi-3, which we do not implement
(the transformers fallback's start)."""

from __future__ import annotations

from pathlib import Path


# A Llama-3.1-shaped tiny config: llama3 RoPE scaling whose original context (16) is shorter than
# the flows' rows, so the scaled frequencies matter in training and verification
LLAMA31 = ("llama", dict(max_position_embeddings=128, rope_scaling=dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)))


def save_tiny_demo_model(tmp: Path, num_hidden_layers: int = 2, corpus_problems: int = 200,
                         arch: tuple[str, dict] = ("qwen3", {})) -> Path:
    """A random Qwen3 (hidden 32; `arch`: another architecture's tiny config and extra fields,
    e.g. `LLAMA31`) with a 256-token demo tokenizer trained on `corpus_problems` arithmetic
    problems, written to `tmp / "start"` with the tokenizer; returns the directory."""
    from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config

    paths = write_arithmetic_dataset(tmp / "corpus", num_train=corpus_problems, num_heldout=0, seed=0, max_digits=2)
    tokenizer = load_tokenizer(str(build_demo_tokenizer(tmp / "tokenizer", corpus_paths=[paths["train"]],
                                                        vocab_size=256)))
    model_type, extra = arch
    model = build_model(tiny_config(model_type, **extra, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=16, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id), seed=0)
    return save_hf_checkpoint(model, tmp / "start", tokenizer=tokenizer)


def two_worker_recipe_from(start: Path, tmp: Path, name: str) -> Path:
    """`configs/sft/tiny-2workers.yaml` starting from the checkpoint `start` (its tokenizer and
    weights) instead of a random model and the demo tokenizer, written to `tmp / name`."""
    two_workers = Path(__file__).resolve().parents[1] / "configs" / "sft" / "tiny-2workers.yaml"
    text = two_workers.read_text()
    model_section = text[text.index("tokenizer:"):text.index("pack:")]
    recipe = tmp / name
    recipe.write_text(text.replace(model_section, f"tokenizer:\n  name_or_path: {start}\n\nmodel:\n  init_from: {start}\n\n"))
    return recipe


def assert_logits_equal_transformers(model_dir: Path, ids_BT, atol: float = 1e-4) -> None:
    """Our model and transformers' `AutoModelForCausalLM`, both loaded from `model_dir`, give the
    same logits for `ids_BT` (one document per row, positions from 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models.architectures import load_hf_checkpoint

    ours = load_hf_checkpoint(model_dir)
    positions_BT = torch.arange(ids_BT.shape[1]).expand_as(ids_BT)
    with torch.no_grad():
        ours_BTV = ours.compute_logits(ours(ids_BT, positions_BT, torch.zeros_like(ids_BT)))
        theirs_BTV = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(ids_BT).logits
    diff = (ours_BTV - theirs_BTV).abs().max().item()
    assert diff <= atol, f"{model_dir}: max |logit diff| {diff:.3g} > {atol}"


def save_tiny_phi3(path: Path, tokenizer) -> Path:
    """A random tiny Phi-3 (an architecture we do not implement: fused qkv and gate/up
    projections) with `tokenizer`'s vocabulary and the tokenizer beside it: a start for the
    transformers fallback backend."""
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        original_max_position_embeddings=256, sliding_window=None, tie_word_embeddings=False,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    Phi3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(str(path))
    return path
