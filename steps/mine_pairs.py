"""Mine preference pairs from a model's own answers: the correct answer is chosen, one of the
model's wrong answers rejected.

For each question (a chat prompt with a known answer): the model's greedy answer first; if it
is wrong, that is the rejected response (the mistake the model actually makes); if it is
right, up to `samples` sampled answers (temperature `temperature`, seeded) and the first
wrong one. Questions the model answers right every time give no pair (there is nothing to
prefer). Pairs are written as JSONL in the `preference` format
(`{"prompt": [...], "chosen": [...], "rejected": [...]}`) and read back through the normal
ingest path, like every other source.

`run(model_dir, tokenizer, questions, out_path, ...)` -> `MineResult` with counts (greedy
wrong, sampled wrong, no pair) and the model's greedy exact match on the questions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.data.chat import end_of_turn_token_ids, render_prompt
from posttrain.eval.metrics import exact_match
from posttrain.parallel.mesh import pick_device
from posttrain.rl.engine import SamplingConfig
from posttrain.rl.native import NativeEngine


@dataclass
class MineResult:
    path: str
    pairs: int
    from_greedy: int  # rejected = the greedy answer (it was wrong)
    from_samples: int  # greedy was right; rejected = a wrong sample
    no_pair: int  # right every time
    greedy_exact_match: float


def run(model, tokenizer, questions: list[tuple[list[dict], str]], out_path: str | Path, max_new_tokens: int = 8,
        samples: int = 4, temperature: float = 1.0, seed: int = 0, batch_size: int = 256,
        template_kwargs: dict | None = None) -> MineResult:
    """`questions`: `(prompt messages, reference answer)`. Writes the pairs to `out_path`."""
    kw = template_kwargs or {}
    prompt_ids = [render_prompt(tokenizer, messages, **kw) for messages, _ in questions]
    stop_ids = set(end_of_turn_token_ids(tokenizer, **kw)) | {tokenizer.eos_token_id}
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
    engine = NativeEngine(model, max_batch_rows=batch_size)

    def answers(prompts: list[list[int]], temperature: float, seed: int) -> list[str]:
        sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens,
                                  stop_token_ids=tuple(stop_ids), seed=seed)
        return [decode(group[0].content_ids) for group in engine.generate(prompts, sampling)]

    with torch.no_grad():
        greedy = answers(prompt_ids, 0.0, seed)
        rejected: list[str | None] = [g if not exact_match(g, ref) else None for g, (_, ref) in zip(greedy, questions)]
        from_greedy = sum(r is not None for r in rejected)
        for k in range(samples):
            todo = [i for i, r in enumerate(rejected) if r is None]
            if not todo:
                break
            drawn = answers([prompt_ids[i] for i in todo], temperature, seed + k)
            for i, answer in zip(todo, drawn):
                if answer and not exact_match(answer, questions[i][1]):
                    rejected[i] = answer
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    pairs = 0
    with open(out_path, "w", encoding="utf-8") as f:
        for (messages, reference), wrong in zip(questions, rejected):
            if wrong is None:
                continue
            f.write(json.dumps({"prompt": messages, "chosen": [{"role": "assistant", "content": reference}],
                                "rejected": [{"role": "assistant", "content": wrong}]}) + "\n")
            pairs += 1
    em = sum(exact_match(g, ref) for g, (_, ref) in zip(greedy, questions)) / max(1, len(questions))
    result = MineResult(str(out_path), pairs, from_greedy, pairs - from_greedy, len(questions) - pairs, em)
    print(f"[mine] {len(questions)} questions: {pairs} pairs ({from_greedy} with the greedy mistake, "
          f"{pairs - from_greedy} with a sampled one, {result.no_pair} answered right every time); "
          f"greedy exact match {em:.3f}")
    return result


def generate_preference_demo(config, run_dir: Path) -> Path:
    """`data.generate.task: arithmetic_pairs`: the arithmetic problems of `data.generate` (the
    same split an SFT demo with these settings trains and holds out), answered by the recipe's
    starting model, mined into `pairs.jsonl` and `heldout_pairs.jsonl` under `${generated}`."""
    from posttrain.data.demo import write_arithmetic_dataset
    from posttrain.data.sources import SourceSpec, read_chat_records
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models.architectures import load_causal_lm
    from posttrain.steps.paths import generated_directory
    from posttrain.recipes.start import trained_start_dir

    generate = config.data.generate
    out_dir = generated_directory(run_dir)
    paths = write_arithmetic_dataset(out_dir, num_train=generate.num_train, num_heldout=generate.num_heldout,
                                     seed=generate.seed, min_digits=generate.min_digits, max_digits=generate.max_digits)
    start_dir = trained_start_dir(config)
    if start_dir is None:
        raise ValueError("data.generate.task 'arithmetic_pairs' answers the problems with the recipe's starting "
                         "model: set model.init_from")
    tokenizer = load_tokenizer(str(start_dir))
    model = load_causal_lm(start_dir, config.model.backend, device=pick_device(config.train.device))
    for split, name in (("train", "pairs.jsonl"), ("heldout", "heldout_pairs.jsonl")):
        records, _ = read_chat_records(SourceSpec(name=split, kind="jsonl", path=str(paths[split])))
        questions = [(r.messages[:-1], r.messages[-1]["content"]) for r in records]
        run(model, tokenizer, questions, out_dir / name, max_new_tokens=config.eval.max_new_tokens,
            seed=generate.seed + (split == "heldout"), template_kwargs=config.tokenizer.chat_template_kwargs)
    return out_dir
