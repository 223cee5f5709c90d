"""The train/serve skew gate (`posttrain.verify.skew`): the exported directory, loaded alone,
renders training's records to the same token ids and stops where training ended each answer;
planted skews (an edited chat template, a special token renamed, a stop id missing from the
generation config) fail it with the first difference decoded side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.data.chat import end_of_turn_token_ids, generation_stop_ids
from posttrain.data.demo import build_demo_tokenizer
from posttrain.data.records import ChatRecord
from posttrain.models.architectures import add_generation_stop_ids
from posttrain.verify.skew import check_skew, first_difference, sample_records, serving_stop_ids
from skew_records import CHATS, records


def export(tokenizer, path: Path) -> Path:
    """What our exporter leaves for a server: the tokenizer files and a generation config
    that stops at the chat's end-of-turn ids (`export_trained`)."""
    tokenizer.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id}))
    add_generation_stop_ids(path, generation_stop_ids(tokenizer))
    return path


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("demo-tokenizer")
    texts = [m["content"] for chat in CHATS for m in chat] + ["Say hi", "Hi!", "No.", "3 + 4 = ?"]
    build_demo_tokenizer(out, texts=texts * 20, vocab_size=384)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(params=["demo", "qwen3"])
def tokenizer(request, demo_tokenizer, qwen3_tokenizer):
    return demo_tokenizer if request.param == "demo" else qwen3_tokenizer


def test_an_export_of_the_training_tokenizer_passes_every_record_kind(tokenizer, tmp_path):
    report = check_skew(tokenizer, export(tokenizer, tmp_path / "export"), records())
    assert report.passed, report.describe()
    assert report.checked == {"conversation": 2, "generation prompt": 2, "prompt inside the trained conversation": 2,
                              "pair prompt": 1, "chosen conversation": 1, "rejected conversation": 1,
                              "rollout prompt": 1}
    assert report.end_of_turn_ids and set(report.end_of_turn_ids) <= set(report.serving_stop_ids)
    assert report.as_dict()["passed"] is True


def test_an_edited_chat_template_fails_with_the_first_difference_decoded(qwen3_tokenizer, tmp_path):
    path = export(qwen3_tokenizer, tmp_path / "export")
    template = path / "chat_template.jinja"
    source = template.read_text()
    edited = source.replace("'<|im_start|>' + message.role + '\\n'", "'<|im_start|>' + message.role + ':\\n'")
    assert edited != source, "the planted edit no longer applies to the Qwen3 template"
    template.write_text(edited)
    report = check_skew(qwen3_tokenizer, path, records())
    assert not report.passed and report.mismatched >= 4
    first = report.mismatches[0]
    assert (first.source, first.line, first.what) == ("chats", 1, "conversation")
    assert ">>" in first.training and ">>" in first.serving and first.training != first.serving
    text = report.describe()
    assert "FAILED" in text and "chats:1 conversation: first difference at token" in text
    assert "':\\n'" in first.serving and "':\\n'" not in first.training


def test_a_renamed_special_token_fails(demo_tokenizer, tmp_path):
    path = export(demo_tokenizer, tmp_path / "export")
    end = demo_tokenizer.convert_ids_to_tokens(end_of_turn_token_ids(demo_tokenizer)[0])
    spec = json.loads((path / "tokenizer.json").read_text())
    renamed = [t for t in spec["added_tokens"] if t["content"] == end]
    assert renamed, f"{end} is not an added token of the demo tokenizer"
    renamed[0]["content"] = "<|end_of_answer|>"  # same id, another text: the template's marker is plain text now
    (path / "tokenizer.json").write_text(json.dumps(spec))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    for token in settings.get("added_tokens_decoder", {}).values():
        if token["content"] == end:
            token["content"] = "<|end_of_answer|>"
    settings.update({k: "<|end_of_answer|>" for k, v in settings.items() if v == end})
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    report = check_skew(demo_tokenizer, path, records())
    assert not report.passed and report.mismatched > 0
    assert any(m.what == "conversation" for m in report.mismatches)


def test_a_generation_config_that_does_not_stop_at_the_end_of_turn_fails(qwen3_tokenizer, tmp_path):
    path = export(qwen3_tokenizer, tmp_path / "export")
    end_of_turn = end_of_turn_token_ids(qwen3_tokenizer)
    other = qwen3_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert other not in end_of_turn
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": other}))  # a base model's eos only
    report = check_skew(qwen3_tokenizer, path, records())
    assert report.mismatched == 0 and not report.passed
    assert report.missing_stop_ids == end_of_turn and report.serving_stop_ids == [other]
    assert "<|im_end|>" in report.stop_message and "past the end of the answer" in report.describe()


def test_add_generation_stop_ids_merges_into_the_generation_config(tmp_path):
    assert add_generation_stop_ids(tmp_path, [5]) == [5]
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0}))
    assert add_generation_stop_ids(tmp_path, [7, 2]) == [2, 7]
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": [2, 7], "pad_token_id": 0}
    assert serving_stop_ids(tmp_path) == [2, 7]


def test_sample_records_takes_up_to_n_per_source_deterministically():
    many = [ChatRecord(messages=CHATS[0], source=s, line=i) for s in ("a", "b") for i in range(10)]
    picked = sample_records(many, per_source=3, seed=1)
    assert [r.source for r in picked] == ["a"] * 3 + ["b"] * 3
    assert picked == sample_records(many, per_source=3, seed=1) != sample_records(many, per_source=3, seed=2)
    assert len(sample_records(many, per_source=50)) == 20


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_vllm_is_checked_where_installed_and_a_failed_start_is_noted_or_fatal_as_configured(demo_tokenizer, tmp_path):
    """`verify.skew_vllm`: "on" without vllm installed is an error naming the setting, "auto" and
    "off" without it check transformers alone; an engine that cannot start is a note in the
    report (auto) or the error itself (on). vLLM's own rendering is tested by make test-vllm."""
    import importlib.util

    from posttrain.data.chat import template_ids
    from posttrain.steps.verify import vllm_opener
    from posttrain.verify.skew import SkewError

    path = export(demo_tokenizer, tmp_path / "export")
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        with pytest.raises(SkewError, match="verify.skew_vllm is 'on' but vllm is not installed"):
            vllm_opener(str(path), "on")
        assert vllm_opener(str(path), "auto") is None
    assert vllm_opener(str(path), "off") is None

    sizes = []

    def no_engine(max_model_len):
        sizes.append(max_model_len)
        raise RuntimeError("no device for vLLM")

    report = check_skew(demo_tokenizer, path, records(), open_vllm=no_engine)
    assert report.passed and report.serving_stacks == ["transformers"]
    assert report.notes == ["vllm: not checked, its engine did not start (RuntimeError: no device for vLLM)"]
    assert "vllm: not checked" in report.describe()
    longest = max(len(template_ids(demo_tokenizer.apply_chat_template(m, tokenize=True))) for m in CHATS)
    assert sizes[0] >= longest  # the engine is sized to the longest sampled record
    with pytest.raises(RuntimeError, match="no device for vLLM"):
        check_skew(demo_tokenizer, path, records(), open_vllm=no_engine, vllm_required=True)


def test_rollout_prompts_are_compared_with_the_tools_their_record_names(qwen3_tokenizer, tmp_path):
    """An RL record that names its own tools (`meta.tools`) was rendered with those alone: the
    gate renders both sides the same way (and a record naming a tool the recipe lacks, which
    tokenize rejects, is an error here too)."""
    import sys

    from posttrain.data.records import PromptRecord
    from posttrain.rl.environments import tool_schemas

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    kwargs = {"tools": tool_schemas(["user_environments:multiply", "user_environments:add"])}
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    path = export(qwen3_tokenizer, tmp_path / "export")
    report = check_skew(qwen3_tokenizer, path, [PromptRecord(prompt, "5", {"tools": ["add"]}, "q.jsonl", 1),
                                                PromptRecord(prompt, "5", {}, "q.jsonl", 2)], template_kwargs=kwargs)
    assert report.passed, report.describe()
    assert report.checked == {"rollout prompt": 2}
    with pytest.raises(ValueError, match=r"q.jsonl:3 names tools \['divide'\]"):
        check_skew(qwen3_tokenizer, path, [PromptRecord(prompt, "5", {"tools": ["divide"]}, "q.jsonl", 3)],
                   template_kwargs=kwargs)
