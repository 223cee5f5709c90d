"""The embedded demo task: arithmetic chats and a small tokenizer, generated deterministically.

`write_arithmetic_dataset(out_dir, num_train, num_heldout, seed)` writes `train.jsonl` and
`heldout.jsonl`: one `{"messages": [...], "answer": "..."}` record per line, read back
through the normal JSONL ingest path. Problems are additions and subtractions of 1-3 digit
numbers by default (operand lengths drawn uniformly, subtraction never negative), e.g. user
"What is 347 + 589?" / assistant "936"; a quarter of the chats start with a short system
prompt. The tool-use demo's variant (`tool_fraction`) has a share of the chats call a
calculator tool before answering. Train and held-out problems are disjoint (`a + b` and `b + a` count as one).

`write_guessing_dataset(out_dir, num_train, num_heldout, seed)` writes the guessing game of
the multi-turn feedback demo: the user thinks of a number in a range ("Guess my number from 23
to 36."), the assistant guesses, the user answers which way it is off and the range left
("No, it is higher: from 30 to 36.", `guess_reply`) until a guess is right.
`train.jsonl` and `heldout.jsonl` hold whole games (chats) played by a player who guesses at
random among the numbers its feedback left; `prompts.jsonl` and `heldout_prompts.jsonl` the
same games' openings (format `prompt`, the number the reference). Held-out games are
disjoint from the training games (range and number).

`build_demo_tokenizer(out_dir, corpus_paths=None, texts=None, vocab_size=384)` trains a
byte-level BPE (digits always split into single tokens) on the message texts and saves it
in Hugging Face format with our ChatML-style chat template (no generation markers: the demo
uses the derived-mask path). Same inputs give byte-identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable

SYSTEM_PROMPT = "You are a calculator. Reply with the number only."
QUESTIONS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} =")
SYSTEM_FRACTION = 0.25

PAD, BOS_TURN, EOS_TURN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Our own ChatML-style template: every turn is `<|im_start|>{role}\n{content}<|im_end|>\n`,
# the generation prompt is `<|im_start|>assistant\n`. Tools (`tools=[schema, ...]`) are
# advertised in a first system turn, one line: `Tools: name(param, ...), ...`.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' }}"
    "{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- f.name + '(' + (f.parameters.properties | list | join(', ')) + ')' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---------------------------------------------------------------- dataset


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _problem(rng: random.Random, min_digits: int, max_digits: int) -> tuple[int, str, int]:
    a, b, op = _operand(rng, min_digits, max_digits), _operand(rng, min_digits, max_digits), rng.choice("+-")
    if op == "-" and a < b:
        a, b = b, a
    return a, op, b


def _key(a: int, op: str, b: int) -> tuple:
    return (op, min(a, b), max(a, b)) if op == "+" else (op, a, b)


def calculator_call(a: int, op: str, b: int) -> str:
    """The assistant's call of the demo's calculator tool (`posttrain.rl.demo_environments.calculator`),
    in the Hermes / Qwen tool-call format `ToolEnvironment` parses."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"a": a, "op": op, "b": b}}) + "</tool_call>"


def _record(a: int, op: str, b: int, rng: random.Random, tool_fraction: float = 0.0) -> dict:
    answer = str(a + b if op == "+" else a - b)
    messages = []
    if rng.random() < SYSTEM_FRACTION and not tool_fraction:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(a=a, op=op, b=b)})
    if tool_fraction and rng.random() < tool_fraction:
        messages.append({"role": "assistant", "content": calculator_call(a, op, b)})
        messages.append({"role": "tool", "content": answer})
    messages.append({"role": "assistant", "content": answer})
    return {"messages": messages, "answer": answer}


# ---------------------------------------------------------------- the guessing game

GUESS_PROMPT = "Guess my number from {lo} to {hi}."
GUESS_WIDTHS = (12, 15)  # a game's range holds this many numbers (at most 15: four guesses find any)
GUESS_MAX = 99


def guess_reply(guess: int | None, number: int, lo: int, hi: int) -> tuple[str, int, int]:
    """The user's answer to a wrong `guess` (None: no number) of `number` while `lo`..`hi` was
    left, and the range left after it: `("No, it is higher: from 24 to 36.", 24, 36)`. The answer
    says the range left, so a player reads its state in the last message, not in the game."""
    if guess is not None and guess < number:
        lo = max(lo, guess + 1)
    elif guess is not None:
        hi = min(hi, guess - 1)
    how = "No answer" if guess is None else f"No, it is {'higher' if guess < number else 'lower'}"
    return f"{how}: from {lo} to {hi}.", lo, hi


def _game(lo: int, hi: int, number: int, rng: random.Random) -> dict:
    """A whole game: guesses drawn uniformly among the numbers the feedback so far leaves."""
    messages = [{"role": "user", "content": GUESS_PROMPT.format(lo=lo, hi=hi)}]
    while True:
        guess = rng.randint(lo, hi)
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == number:
            return {"messages": messages, "answer": str(number)}
        reply, lo, hi = guess_reply(guess, number, lo, hi)
        messages.append({"role": "user", "content": reply})


def write_guessing_dataset(out_dir, num_train: int, num_heldout: int, seed: int) -> dict[str, Path]:
    """Write the guessing game's files under `out_dir` (module docstring); return their paths by
    name (`train`, `heldout`, `prompts`, `heldout_prompts`). Ranges hold `GUESS_WIDTHS` numbers
    within 1..`GUESS_MAX`; the `num_heldout` held-out games are distinct (range, number) triples
    no training game has; training games may repeat a triple, each with its own random play."""
    if num_train < 1 or num_heldout < 0:
        raise ValueError("num_train must be >= 1 and num_heldout >= 0")
    triples = [(lo, lo + width - 1, number) for width in range(GUESS_WIDTHS[0], GUESS_WIDTHS[1] + 1)
               for lo in range(1, GUESS_MAX - width + 2) for number in range(lo, lo + width)]
    if num_heldout >= len(triples):
        raise ValueError(f"num_heldout must be below the game's {len(triples)} distinct games")
    rng = random.Random(seed)
    rng.shuffle(triples)
    heldout_triples, train_triples = triples[:num_heldout], triples[num_heldout:]
    heldout = [_game(*t, rng) for t in heldout_triples]
    train = [_game(*rng.choice(train_triples), rng) for _ in range(num_train)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / f"{name}.jsonl" for name in ("train", "heldout", "prompts", "heldout_prompts")}
    _write_jsonl(paths["train"], train)
    _write_jsonl(paths["heldout"], heldout)
    for name, games in (("prompts", train), ("heldout_prompts", heldout)):
        _write_jsonl(paths[name], [{"prompt": g["messages"][0]["content"], "reference": g["answer"]} for g in games])
    return paths


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_arithmetic_dataset(out_dir, num_train: int, num_heldout: int, seed: int,
                             min_digits: int = 1, max_digits: int = 3, tool_fraction: float = 0.0) -> dict[str, Path]:
    """Write `train.jsonl` and `heldout.jsonl` under `out_dir`; return `{"train": ..., "heldout": ...}`.

    Operands have `min_digits` to `max_digits` digits (lengths drawn uniformly). With
    `tool_fraction` > 0 (the tool-use demo), that share of the chats has the assistant call the
    calculator tool first (`calculator_call`, the tool's answer as a `tool` turn) and then answer;
    the rest answer directly, and no chat has a system prompt (the template's tools line is one).
    """
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if num_train < 0 or num_heldout < 0:
        raise ValueError("num_train and num_heldout must be >= 0")
    rng = random.Random(seed)
    wanted = num_train + num_heldout
    problems: dict[tuple, tuple[int, str, int]] = {}
    attempts = 0
    while len(problems) < wanted:
        attempts += 1
        if attempts > 20 * wanted + 1000:
            raise ValueError(f"cannot draw {wanted} distinct arithmetic problems")
        problem = _problem(rng, min_digits, max_digits)
        problems.setdefault(_key(*problem), problem)
    ordered = list(problems.values())  # insertion order: deterministic
    heldout = [_record(*p, rng, tool_fraction) for p in ordered[:num_heldout]]
    train = [_record(*p, rng, tool_fraction) for p in ordered[num_heldout:]]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.jsonl", "heldout": out / "heldout.jsonl"}
    _write_jsonl(paths["train"], train)
    _write_jsonl(paths["heldout"], heldout)
    return paths


# ---------------------------------------------------------------- tokenizer


def _corpus_texts(corpus_paths: Iterable, texts: Iterable[str] | None) -> list[str]:
    """Message roles and contents of chat JSONL files (via the normal reader), plus `texts`."""
    from posttrain.catalog import JSONL_SUFFIXES
    from posttrain.data.sources import SourceSpec, read_chat_records

    out: list[str] = []
    for path in corpus_paths or ():
        path = str(path)
        if path.endswith(JSONL_SUFFIXES):
            records, _ = read_chat_records(SourceSpec(name="tokenizer-corpus", kind="jsonl", path=path))
            for record in records:
                for message in record.messages:
                    out.extend((message["role"] + "\n", message["content"]))
        else:
            out.extend(Path(path).read_text(encoding="utf-8").splitlines(keepends=True))
    out.extend(texts or ())
    return out


def build_demo_tokenizer(out_dir, corpus_paths: Iterable | None = None, texts: Iterable[str] | None = None,
                         vocab_size: int = 384) -> Path:
    """Train the demo byte-level BPE and save it (tokenizer.json + tokenizer_config.json) in `out_dir`.

    `corpus_paths`: chat JSONL files (their roles and message contents are the training
    text) or plain text files; `texts`: extra strings. Special tokens: `<|endoftext|>`
    (id 0, pad), `<|im_start|>` (1), `<|im_end|>` (2, eos). Loads with
    `AutoTokenizer.from_pretrained(out_dir)`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = _corpus_texts(corpus_paths, texts)
    if not corpus:
        raise ValueError("build_demo_tokenizer needs corpus_paths or texts")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, BOS_TURN, EOS_TURN],
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token=EOS_TURN,
        pad_token=PAD,
        unk_token=None,
        additional_special_tokens=[BOS_TURN],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out))
    return out
