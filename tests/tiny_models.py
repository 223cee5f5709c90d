"""Tiny models the tests build offline: a random Qwen3 with the demo's own BPE tokenizer, saved
as an HF directory (a starting model for the preference flows, a teacher for distillation)."""

from __future__ import annotations

from pathlib import Path


def save_tiny_demo_qwen3(tmp: Path, num_hidden_layers: int = 2, corpus_problems: int = 200) -> Path:
    """A random Qwen3 (hidden 32) with a 256-token demo tokenizer trained on `corpus_problems`
    arithmetic problems, written to `tmp / "start"` with the tokenizer; returns the directory."""
    from posttrain.data.demo import build_demo_tokenizer, write_arithmetic_dataset
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.architectures import build_model, save_hf_checkpoint, tiny_config

    paths = write_arithmetic_dataset(tmp / "corpus", num_train=corpus_problems, num_heldout=0, seed=0, max_digits=2)
    tokenizer = load_tokenizer(str(build_demo_tokenizer(tmp / "tokenizer", corpus_paths=[paths["train"]],
                                                        vocab_size=256)))
    model = build_model(tiny_config("qwen3", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=16, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id), seed=0)
    return save_hf_checkpoint(model, tmp / "start", tokenizer=tokenizer)
