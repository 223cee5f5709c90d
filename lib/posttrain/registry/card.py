"""Model cards: the README.md of a registered model directory, which the Hugging Face Hub renders.

    from posttrain.registry.card import render_model_card
    text = render_model_card(load_lineage(entry.path))   # what `register` writes to vN/model/README.md

`render_model_card(lineage)` is a pure function of an entry's lineage (`posttrain.registry.local`:
the record in `lineage.json`, version included): no file, no network. The card opens with YAML
front matter the Hub reads:

    license: apache-2.0                 # lineage["license"]["id"]; "other" when none is known
    base_model: Qwen/Qwen3-0.6B         # only a Hub repository id (lineage["base_model"], else the
                                        # parent's reference when it is one); absent otherwise
    library_name: transformers
    pipeline_tag: text-generation       # text-classification for a reward model
    tags: [posttrain, <recipe kind>]
    datasets: [openai/gsm8k]            # only sources read from the Hub (kind hf), absent otherwise

and then the sections: the model (name, version, recipe, run pathspec, code version), its base
model and parent chain, the training data (sources, counts, fingerprints: size and SHA-256),
training (the run's summary and main settings), the gates (logit verification, train/serve
skew) as pass/fail with their figures, the evaluation table (a row per metric, a column per
model evaluated: base, tuned, promoted, ...; failed suites named), intended use and
limitations (by recipe kind), the license and how to load the model with transformers.

`resolve_license` and `read_front_matter` read a base model's card for the license `register`
records when `register.license` is unset; `hub_repo_id` tells a Hub repository id from a path.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import yaml

CARD_TAG = "posttrain"
UNKNOWN_LICENSE = "other"
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# recipe kinds whose config has a section of its own (the section's name is the kind); SFT has none
_SECTION_KINDS = ("dpo", "kto", "orpo", "rm", "distill", "grpo", "sequence", "semantic_ids")
_MODEL_ORDER = ("base", "tuned", "promoted", "teacher")

_KIND_TITLE = {
    "sft": "supervised fine-tuning (SFT)",
    "dpo": "direct preference optimisation (DPO)",
    "kto": "Kahneman-Tversky optimisation (KTO)",
    "orpo": "odds-ratio preference optimisation (ORPO)",
    "rm": "reward modelling (Bradley-Terry pairs)",
    "distill": "knowledge distillation from a teacher model",
    "grpo": "reinforcement learning (GRPO) on reward functions",
    "sequence": "next-item sequence modelling (recommendation)",
    "semantic_ids": "generative recommendation over semantic item IDs",
}

_INTENDED_USE = {
    "sft": "An assistant for requests like the conversations it was fine-tuned on (see Training data): "
           "answering prompts in the chat format of its tokenizer's template.",
    "dpo": "An assistant whose answers were steered towards the preferred responses of its preference pairs, "
           "for requests like their prompts.",
    "kto": "An assistant whose answers were steered towards the responses labelled desirable in its "
           "training data, for requests like its prompts.",
    "orpo": "An assistant fine-tuned on preference pairs in one stage (supervised loss plus an odds-ratio "
            "preference term), for requests like their prompts.",
    "rm": "A reward model: it scores a response to a prompt with one number (higher: preferred), to rank "
          "candidate answers, filter data or serve as the reward of reinforcement learning. It does not "
          "generate text.",
    "distill": "A student model trained to match a teacher's token distributions (see Base model), for the "
               "same requests as the teacher on the distribution of its training prompts, at a smaller cost.",
    "grpo": "A policy trained by reinforcement learning to raise the rewards of its recipe's reward functions "
            "on prompts like its training prompts.",
    "sequence": "Next-item recommendation: given a user's history of item tokens, the model ranks the items "
                "of its catalogue as the next one. Its vocabulary is the catalogue; it does not read text.",
    "semantic_ids": "Generative recommendation: given a session of items written as semantic-ID codes, the "
                    "model generates the codes of the next item.",
}

_LIMITATIONS = {
    "dpo": "Preference optimisation moves the model towards what its pairs prefer, including their "
           "mistakes and biases, and can lengthen answers or trade accuracy for style.",
    "kto": "It learns what its labels call desirable, including their mistakes and biases.",
    "orpo": "Preference tuning moves the model towards what its pairs prefer, including their mistakes and "
            "biases.",
    "rm": "Its scores are relative (compare responses to the same prompt) and only as good as its pairs: "
          "a policy optimised against it can find responses it over-rates (reward hacking).",
    "distill": "It inherits the teacher's errors and biases, and is usually weaker than the teacher away from "
               "its training prompts.",
    "grpo": "It is optimised for its reward functions, not for what they stand for: a reward that can be "
            "satisfied without solving the task (reward hacking) produces a model that does so.",
    "sequence": "It knows only the items and users' behaviour of its training histories: new items map to "
                "the unknown token, and popularity and exposure biases of the logs are learned as they are.",
    "semantic_ids": "It knows only the items of its catalogue and the behaviour of its training sessions; "
                    "codes of items it never saw are guesses.",
}


def hub_repo_id(reference: object) -> str | None:
    """`reference` when it reads as a Hub repository id (`owner/name`, not a path, not a
    `registry:` or `file://` reference), else None. A relative local path shaped like an id
    (`outputs/start`) cannot be told apart here: callers that can look at the disk rule it out."""
    if not isinstance(reference, str) or not _HUB_ID.fullmatch(reference) or ".." in reference:
        return None
    return reference


def read_front_matter(readme: str | Path) -> dict:
    """The YAML front matter of a model card file (the mapping between the leading `---` lines);
    {} when the file is missing, unreadable, or has no front matter that parses as a mapping."""
    try:
        text = Path(readme).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    return split_front_matter(text)[0]


def split_front_matter(text: str) -> tuple[dict, str]:
    """(front matter as a dict, the rest of the card); ({}, text) when there is none."""
    match = re.match(r"\A---[ \t]*\r?\n(.*?)^---[ \t]*\r?$\n?", text, flags=re.DOTALL | re.MULTILINE)
    if not match:
        return {}, text
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return {}, text
    return (data if isinstance(data, dict) else {}), text[match.end():]


def resolve_license(configured: str | None, base_model_dir: str | Path | None) -> dict:
    """The license a registration records: `{"id", "source"}`. `configured` (`register.license`)
    wins; else the `license` of the base model's card (`base_model_dir/README.md`, e.g. a Hub
    snapshot or a registered parent's card), with that file as the source; else `other` with
    source None (the card then says to set `register.license`)."""
    if configured:
        return {"id": configured, "source": "register.license"}
    if base_model_dir is not None:
        readme = Path(base_model_dir) / "README.md"
        found = read_front_matter(readme).get("license")
        if isinstance(found, str) and found.strip():
            return {"id": found.strip(), "source": str(readme)}
    return {"id": UNKNOWN_LICENSE, "source": None}


# --- reading the lineage -------------------------------------------------------------------


def recipe_kind(lineage: dict) -> str | None:
    """The recipe kind (`sft`, `dpo`, ...): recorded by `register` (`kind`), else inferred from
    the config's sections (a recipe's own section is named after its kind; SFT has none)."""
    if lineage.get("kind"):
        return str(lineage["kind"])
    config = lineage.get("config")
    if not isinstance(config, dict):
        return None
    return next((kind for kind in _SECTION_KINDS if isinstance(config.get(kind), dict)), "sft")


def base_model_id(lineage: dict) -> str | None:
    """The Hub repository the model derives from: `base_model` as `register` recorded it (the
    parent's Hub id, or the nearest ancestor's), else the parent's reference when it is a Hub id
    that was fetched (its directory is not the reference itself, as for a local directory)."""
    if "base_model" in lineage:
        return hub_repo_id(lineage["base_model"])
    parent = lineage.get("parent") or {}
    reference = hub_repo_id(parent.get("reference"))
    if reference and parent.get("model_dir") not in (None, reference) and not parent.get("name"):
        return reference
    return None


def hub_datasets(lineage: dict) -> list[str]:
    """Sources read from the Hub (kind `hf` with a dataset id, not a local copy)."""
    data = lineage.get("data") or {}
    fingerprints = data.get("fingerprints") or {}
    found = []
    for source in data.get("sources") or []:
        if not isinstance(source, dict) or source.get("kind") != "hf":
            continue
        dataset = hub_repo_id(source.get("path"))
        local_copy = (fingerprints.get(source.get("name")) or {}).get("sha256") is not None
        if dataset and not local_copy and dataset not in found:
            found.append(dataset)
    return found


def front_matter(lineage: dict) -> dict:
    """The card's YAML metadata (module docstring), in the order it is written."""
    kind = recipe_kind(lineage)
    meta: dict = {"license": (lineage.get("license") or {}).get("id") or UNKNOWN_LICENSE}
    base = base_model_id(lineage)
    if base:
        meta["base_model"] = base
    meta["library_name"] = "transformers"
    meta["pipeline_tag"] = "text-classification" if kind == "rm" else "text-generation"
    meta["tags"] = [CARD_TAG] + ([kind] if kind else [])
    datasets = hub_datasets(lineage)
    if datasets:
        meta["datasets"] = datasets
    return meta


# --- formatting ------------------------------------------------------------------------------


def _cell(value: object) -> str:
    """A value as a Markdown table cell: numbers to 4 significant digits, `|` escaped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return " ".join(str(value).split()).replace("|", "\\|")


def _code(value: object) -> str:
    return f"`{value}`" if value not in (None, "") else "-"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _count(counts: object, key: str) -> object:
    if isinstance(counts, dict):
        return counts.get(key)
    return counts if key == "kept" else None  # a bare number: the rows kept


# --- sections --------------------------------------------------------------------------------


def _model_section(lineage: dict, kind: str | None) -> list[str]:
    code = lineage.get("code") or {}
    commit = code.get("git_commit")
    code_text = f"posttrain {code.get('package_version') or '?'}"
    if commit:
        code_text += f", commit `{commit[:12]}`" + (" (with uncommitted changes)" if code.get("git_dirty") else "")
    config = lineage.get("config") or {}
    model = config.get("model") or {}
    rows = [["Name", _code(lineage.get("name"))],
            ["Version", f"v{lineage['version']}" if lineage.get("version") is not None else "-"],
            ["Recipe", f"{_code(lineage.get('recipe'))}" + (f" (kind `{kind}`)" if kind else "")],
            ["Run", f"{_code(lineage.get('run'))} (Metaflow pathspec)" if lineage.get("run") else "-"],
            ["Registered", _cell(lineage.get("created_at"))],
            ["Code", code_text]]
    if model.get("arch"):
        rows.append(["Architecture", f"{_code(model['arch'])} ({model.get('backend') or 'native'} backend)"])
    lora = model.get("lora")
    if isinstance(lora, dict):
        rows.append(["LoRA", f"rank {lora.get('rank')}, alpha {lora.get('alpha')}, on {lora.get('targets')}; "
                             "the weights here are merged"
                     + ("; the PEFT adapter is registered beside them (`adapter/`)" if lineage.get("adapter") else "")])
    name, version = lineage.get("name"), lineage.get("version")
    lines = ["## Model", ""]
    if name and version is not None:
        lines += [f"Registered in the posttrain model registry as `{name}:v{version}`.", ""]
    return lines + _table(["", ""], rows) + [""]


def _base_section(lineage: dict) -> list[str]:
    parent = lineage.get("parent")
    lines = ["## Base model", ""]
    if not parent:
        return lines + ["Trained from a random initialisation: there is no base model.", ""]
    base = base_model_id(lineage)
    where = f"`{parent.get('reference') or parent.get('model_dir')}`"
    if parent.get("name"):
        where += f" (registry entry `{parent['name']}:v{parent.get('version')}`"
        where += f", recipe `{parent['recipe']}`" if parent.get("recipe") else ""
        where += f", run `{parent['run']}`" if parent.get("run") else ""
        where += ")"
    lines += [f"Trained from {where}."]
    if base:
        lines += [f"On the Hub: [{base}](https://huggingface.co/{base})"
                  + (" (the nearest ancestor there)." if hub_repo_id(parent.get("reference")) != base else ".")]
    ancestry = lineage.get("ancestry") or []
    if len(ancestry) > 1:
        lines += ["", "Parent chain, from the parent back:", ""]
        for depth, ancestor in enumerate(ancestry):
            label = (f"`{ancestor['name']}:v{ancestor.get('version')}`" if ancestor.get("name")
                     else f"`{ancestor.get('reference')}`")
            extra = ", ".join(f"{key} `{ancestor[key]}`" for key in ("recipe", "run") if ancestor.get(key))
            lines.append(f"{depth + 1}. {label}" + (f" ({extra})" if extra else ""))
    return lines + [""]


def _data_section(lineage: dict) -> list[str]:
    data = lineage.get("data") or {}
    sources = [s for s in data.get("sources") or [] if isinstance(s, dict)]
    counts = data.get("counts") or {}
    fingerprints = data.get("fingerprints") or {}
    lines = ["## Training data", ""]
    if not sources and not counts and not fingerprints:
        return lines + ["Not recorded.", ""]
    rows = []

    def row(name: str, role: str, kind: object, where: object, fmt: object) -> list[str]:
        fingerprint = fingerprints.get(name) or {}
        sha = fingerprint.get("sha256")
        return [f"`{name}`", role, _cell(kind), _code(where), _cell(fmt),
                _cell(_count(counts.get(name), "kept")), _cell(_count(counts.get(name), "read")),
                _cell(_count(counts.get(name), "rejected")), _cell(fingerprint.get("bytes")),
                f"`{sha}`" if sha else "-"]

    for source in sources:
        where = source.get("path")
        if source.get("kind") == "hf" and hub_repo_id(where):
            subset = f" ({source['subset']})" if source.get("subset") else ""
            where = f"{where}{subset}, split {source.get('split')}"
        rows.append(row(source.get("name", "?"), "train", source.get("kind"), where, source.get("format")))
    named = {s.get("name") for s in sources}
    for name in list(fingerprints) + [n for n in counts if n not in fingerprints]:
        if name not in named:
            named.add(name)
            rows.append(row(name, "held-out", None, (fingerprints.get(name) or {}).get("path"), None))
    lines += _table(["Source", "Role", "Kind", "Path or dataset", "Format", "Kept", "Read", "Rejected", "Bytes",
                     "SHA-256"], rows)
    lines += ["", "Read: the records read from the source; kept: those the recipe's filters kept (rejected: "
                  "the others). Bytes and SHA-256 identify the files read (a Hub dataset: by its id)."]
    tokenizer = lineage.get("tokenizer") or {}
    if tokenizer.get("name_or_path"):
        pad = tokenizer.get("pad") or {}
        lines += ["", f"Tokenizer: `{tokenizer['name_or_path']}`"
                  + (f", padding with `{pad.get('token')}` (id {pad.get('id')}, from the {pad.get('source')})"
                     if pad.get("token") is not None else "") + "."]
    return lines + [""]


_TRAIN_LABELS = {
    "steps": "optimizer steps", "optimizer_steps": "optimizer steps", "rounds": "rounds",
    "first_loss": "first loss (step 1)", "final_loss": "final loss (mean of the last steps)",
    "first_reward": "first reward", "final_reward": "final reward",
    "first_pass@1": "first pass@1", "final_pass@1": "final pass@1",
    "tokens": "tokens trained", "num_parameters": "parameters", "trainable_parameters": "trainable parameters",
    "num_workers": "workers", "train_seconds": "training seconds", "tokens_per_s": "tokens per second",
}
_TRAIN_SETTINGS = ("max_steps", "epochs", "micro_batch_size", "grad_accum_steps", "learning_rate", "lr_schedule",
                   "warmup_steps", "weight_decay", "max_grad_norm", "mixed_precision")


def _training_section(lineage: dict, kind: str | None) -> list[str]:
    summary = (lineage.get("metrics") or {}).get("train") or {}
    lines = ["## Training", ""]
    scalars = {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool)) and v is not None}
    if scalars:
        ordered = [k for k in _TRAIN_LABELS if k in scalars] + [k for k in scalars if k not in _TRAIN_LABELS]
        lines += _table(["", ""], [[_TRAIN_LABELS.get(k, k), _cell(scalars[k])] for k in ordered])
    else:
        lines += ["No training summary was recorded."]
    config = lineage.get("config") or {}
    train = config.get("train") or {}
    settings = [f"{key} {_cell(train[key])}" for key in _TRAIN_SETTINGS if train.get(key) is not None]
    section = config.get(kind) if kind in _SECTION_KINDS else None
    if isinstance(section, dict):
        settings += [f"{kind}.{key} {_cell(value)}" for key, value in section.items()
                     if isinstance(value, (int, float, str, bool))]
    if settings:
        lines += ["", "Settings: " + ", ".join(settings) + "."]
    return lines + [""]


def _verify_line(verdict: object) -> str:
    if not isinstance(verdict, dict):
        return "**Logit verification**: not run."
    if verdict.get("passed") is None:
        return f"**Logit verification**: not applicable ({_cell(verdict.get('reason'))})."
    status = "PASS" if verdict["passed"] else "FAIL"
    what = ("the sequence-classifier export's scores against ours" if verdict.get("mode") == "sequence_classification"
            else "the exported model's logits in transformers against ours")
    text = f"**Logit verification**: {status}: {what}"
    if verdict.get("max_abs_diff") is not None:
        text += (f", max |difference| {_cell(verdict['max_abs_diff'])} (mean {_cell(verdict.get('mean_abs_diff'))})"
                 f" against a tolerance of {_cell(verdict.get('tolerance'))}")
    cases = [c.get("name") for c in verdict.get("cases") or [] if isinstance(c, dict)]
    if cases:
        text += f" on {' and '.join(f'{c} inputs' for c in cases)}"
    generation = verdict.get("generation")
    if isinstance(generation, dict) and generation.get("prompts"):
        text += (f"; greedy generation: {generation.get('mismatched', 0)} of {generation['prompts']} prompts "
                 f"differ over {generation.get('new_tokens')} new tokens")
    if verdict.get("error"):
        text += f" (error: {_cell(verdict['error'])})"
    return text + "."


def _skew_line(verdict: object) -> str:
    if not isinstance(verdict, dict):
        return "**Train/serve skew gate**: not run."
    status = "PASS" if verdict.get("passed") else "FAIL"
    checked = verdict.get("checked") or {}
    what = ", ".join(f"{kind} {_cell(n)}" for kind, n in checked.items())
    text = (f"**Train/serve skew gate**: {status}: the exported directory alone renders and stops as training did; "
            f"records checked: {what or 'none'}; {_cell(verdict.get('mismatched', 0))} mismatches")
    stacks = verdict.get("serving_stacks") or []
    if stacks:
        text += f", on {' and '.join(stacks)}"
    if verdict.get("serving_stop_ids") is not None:
        text += f"; stop ids {verdict['serving_stop_ids']}"
    missing = verdict.get("missing_stop_ids") or []
    if missing:
        text += f" (missing end-of-turn ids {missing})"
    return text + "."


def _gates_section(lineage: dict) -> list[str]:
    metrics = lineage.get("metrics") or {}
    return ["## Gates", "", "Checked before registration; a failed gate blocks promotion.", "",
            f"- {_verify_line(metrics.get('verify'))}", f"- {_skew_line(metrics.get('skew'))}", ""]


def _spread_keys(name: str) -> tuple[str, ...]:
    """The keys a metric's standard error may have: ours (`<name>_se`) and lm-evaluation-harness's
    (`<task>/<metric>_stderr`, or `<task>/<metric>_stderr,<filter>` for `<task>/<metric>,<filter>`)."""
    metric, comma, filter_name = name.partition(",")
    return (f"{name}_se", f"{metric}_stderr{comma}{filter_name}")


def _is_spread(key: str) -> bool:
    """A standard error or a harness's document count, shown beside its metric or not at all."""
    metric = key.partition(",")[0]
    return key.endswith("_se") or metric.endswith("_stderr") or metric.endswith("/sample_len")


def _evaluation_section(lineage: dict) -> list[str]:
    metrics = lineage.get("metrics") or {}
    evaluation = metrics.get("eval") or {}
    errors = metrics.get("eval_errors") or {}
    lines = ["## Evaluation", ""]
    by_model = {label: values for label, values in evaluation.items() if isinstance(values, dict)}
    if not by_model:
        lines += ["No evaluation was recorded."]
    else:
        models = [m for m in _MODEL_ORDER if m in by_model] + [m for m in by_model if m not in _MODEL_ORDER]
        names: list[str] = []
        for model in models:
            names += [k for k in by_model[model] if k not in names and not _is_spread(k)]

        def value(model: str, name: str) -> str:
            found = by_model[model].get(name)
            if found is None:
                return "-"
            se = next((by_model[model][k] for k in _spread_keys(name) if k in by_model[model]), None)
            has_se = isinstance(se, (int, float)) and not isinstance(se, bool)
            return _cell(found) + (f" ± {_cell(se)}" if has_se else "")

        lines += _table(["Metric"] + models, [[f"`{name}`"] + [value(m, name) for m in models] for name in names])
        promoted = ", `promoted` the version in production under this name when it was evaluated"
        lines += ["", "Models: `base` is the model training started from, `tuned` this one"
                  + (promoted if "promoted" in by_model else "")
                  + (", `teacher` the distillation teacher" if "teacher" in by_model else "")
                  + "; ± is one standard error. All on the recipe's held-out data, but for "
                  "lm-evaluation-harness tasks (`<task>/<metric>`), on the documents of those tasks."]
    if errors:
        lines += ["", "Failed evaluation suites (no metrics above):", ""]
        lines += [f"- `{suite}`: {_cell(error)}" for suite, error in errors.items()]
    return lines + [""]


def _use_section(lineage: dict, kind: str | None) -> list[str]:
    intended = _INTENDED_USE.get(kind, "As its recipe's evaluation shows (see Evaluation).")
    limits = [_LIMITATIONS[kind]] if kind in _LIMITATIONS else []
    limits += ["It was evaluated only on the suites above, on held-out data drawn like its training data: "
               "its behaviour elsewhere is unmeasured.",
               "It carries the limitations and biases of its training data (and of its base model), and it was not "
               "evaluated for safety, factuality or fairness: do not use it for decisions about people or in "
               "settings where an error causes harm without a review of your own."]
    return (["## Intended use", "", intended, "", "## Limitations", ""] + [f"- {item}" for item in limits] + [""])


def _license_section(lineage: dict) -> list[str]:
    recorded = lineage.get("license") or {}
    license_id = recorded.get("id") or UNKNOWN_LICENSE
    lines = ["## License", ""]
    if recorded.get("source") is None:
        lines.append(f"`{license_id}`: no license was chosen for this model. Set `register.license` in the "
                     "recipe (a Hub license id such as `apache-2.0`) before sharing it, in keeping with the "
                     "licenses of the base model and of the training data.")
    elif recorded["source"] == "register.license":
        lines.append(f"`{license_id}` (set by `register.license`). The licenses of the base model and of the "
                     "training data apply as well.")
    else:
        lines.append(f"`{license_id}`, the base model's license (from its card). The licenses of the training "
                     "data apply as well.")
    return lines + [""]


def _usage_section(lineage: dict, kind: str | None) -> list[str]:
    config = lineage.get("config") or {}
    repo = (config.get("register") or {}).get("push_to_hub")
    name, version = lineage.get("name"), lineage.get("version")
    local = f'resolve_model_dir("registry:{name}:{version}")' if name and version is not None else None
    if repo:
        where = [f'model_id = "{repo}"  # on the Hub']
        if local:
            where += [f"# or, from the local registry (posttrain.registry): model_id = {local}"]
    elif local:
        where = ["from posttrain.registry import resolve_model_dir", "",
                 f"model_id = {local}  # its directory in the local registry"]
    else:
        where = ['model_id = "path/to/this/directory"']
    if kind == "rm":
        body = ["from transformers import AutoModelForSequenceClassification, AutoTokenizer", "", *where, "",
                "tokenizer = AutoTokenizer.from_pretrained(model_id)",
                "# the transformers form of the reward model is the sequence_classifier folder",
                'model = AutoModelForSequenceClassification.from_pretrained(model_id, subfolder="sequence_classifier")',
                'messages = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"}]',
                'inputs = tokenizer.apply_chat_template(messages, return_tensors="pt", return_dict=True)',
                "score = model(**inputs).logits[0, 0].item()  # higher: preferred"]
    elif kind == "sequence":
        body = ["import torch", "from transformers import AutoModelForCausalLM, AutoTokenizer", "", *where, "",
                "tokenizer = AutoTokenizer.from_pretrained(model_id)",
                "model = AutoModelForCausalLM.from_pretrained(model_id)",
                'history = "item_1193 item_661 item_914"  # a user\'s items, oldest first',
                'with torch.no_grad():', '    scores = model(**tokenizer(history, return_tensors="pt")).logits[0, -1]',
                "top = tokenizer.convert_ids_to_tokens(scores.topk(10).indices.tolist())  # next-item candidates"]
    else:
        prompt = ("the items of a session, as in its training data" if kind == "semantic_ids"
                  else "What is 12 + 30?")
        body = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "", *where, "",
                "tokenizer = AutoTokenizer.from_pretrained(model_id)",
                "model = AutoModelForCausalLM.from_pretrained(model_id)",
                f'messages = [{{"role": "user", "content": "{prompt}"}}]',
                'inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",',
                '                                       return_dict=True)',
                "output = model.generate(**inputs, max_new_tokens=64)",
                'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))']
    return ["## How to use", "", "```python", *body, "```", ""]


def render_model_card(lineage: dict) -> str:
    """The model card (README.md text) of a registered model from its lineage (module
    docstring). Pure: missing parts of the lineage are rendered as not recorded."""
    kind = recipe_kind(lineage)
    meta = yaml.safe_dump(front_matter(lineage), sort_keys=False, allow_unicode=True, default_flow_style=False)
    name = lineage.get("name") or lineage.get("recipe") or "model"
    title = f"# {name}" + (f" (v{lineage['version']})" if lineage.get("version") is not None else "")
    summary = (f"A model trained by {_KIND_TITLE.get(kind, kind)} with the posttrain recipe "
               f"`{lineage.get('recipe')}`." if kind else "A model registered by posttrain.")
    parts = [f"---\n{meta}---", "", title, "", summary, ""]
    parts += _model_section(lineage, kind)
    parts += _base_section(lineage)
    parts += _data_section(lineage)
    parts += _training_section(lineage, kind)
    parts += _gates_section(lineage)
    parts += _evaluation_section(lineage)
    parts += _use_section(lineage, kind)
    parts += _license_section(lineage)
    parts += _usage_section(lineage, kind)
    return "\n".join(parts).rstrip("\n") + "\n"
