"""exact_match cases, the comparison frame, and the evidently base-vs-tuned report."""

from __future__ import annotations

import pytest
import torch

from posttrain.eval.heldout import evaluate_loss
from posttrain.eval.metrics import exact_match
from posttrain.eval.report import COLUMNS, build_comparison_frame, evidently_report_html
from posttrain.models.architectures import build_model, tiny_config
from posttrain.ops.losses import causal_lm_loss


@pytest.mark.parametrize(
    "prediction, reference, expected",
    [
        ("42", "42", True),
        ("  42\n", " 42 ", True),
        ("The answer is 42.", "42", True),
        ("= 42", "42", True),
        ("41", "42", False),
        ("420", "42", False),
        ("12 + 30 = 42", "42", False),  # the first number counts
        ("no number here", "42", False),
        ("", "0", False),
        ("-7", "-7", True),
        ("7", "-7", False),
        ("3.50", "3.5", True),
        ("3", "3.0", True),
        ("Paris", " Paris\n", True),
        ("paris", "Paris", False),
        ("Paris, France", "Paris", False),
    ],
)
def test_exact_match(prediction, reference, expected):
    assert exact_match(prediction, reference) is expected


def _examples(base_lengths, tuned_lengths, base_pred="7", tuned_pred="12"):
    examples = []
    for model, pred, lengths in (("base", base_pred, base_lengths), ("tuned", tuned_pred, tuned_lengths)):
        for i, n in enumerate(lengths):
            examples.append({"model": model, "prompt": f"5 + {i} = ?", "reference": "12",
                             "prediction": pred if i % 2 == 0 else "3", "output_length": n})
    return examples


def test_comparison_frame():
    frame = build_comparison_frame(_examples([3, 4, 5], [2, 2, 2]))
    assert list(frame.columns) == COLUMNS
    assert len(frame) == 6 and set(frame.model) == {"base", "tuned"}
    assert frame[frame.model == "base"].correct.tolist() == [False, False, False]
    assert frame[frame.model == "tuned"].correct.tolist() == [True, False, True]
    assert frame.output_length.tolist() == [3, 4, 5, 2, 2, 2]
    given = build_comparison_frame([{**_examples([1], [])[0], "correct": True}])
    assert given.correct.tolist() == [True]  # a given `correct` is kept
    with pytest.raises(ValueError, match="model"):
        build_comparison_frame([{**_examples([1], [])[0], "model": "other"}])
    with pytest.raises(ValueError, match="output_length"):
        build_comparison_frame([{k: v for k, v in _examples([1], [])[0].items() if k != "output_length"}])


def _report(examples) -> str:
    frame = build_comparison_frame(examples)
    return evidently_report_html(frame[frame.model == "base"], frame[frame.model == "tuned"])


def test_report_html_mentions_the_compared_columns():
    html = _report(_examples([3, 4, 5, 6, 4, 3], [2, 2, 3, 2, 2, 3]))
    assert html.lstrip().lower().startswith(("<!doctype html", "<html"))
    assert '"column_name": "output_length"' in html
    assert '"column_name": "correct"' in html
    assert "Drift" in html


@pytest.mark.parametrize("base_lengths, tuned_lengths", [([4, 4, 4], [4, 4, 4]), ([4, 4, 4], [2, 2, 2]), ([5], [1])])
def test_report_survives_constant_columns(base_lengths, tuned_lengths):
    # every prediction wrong in both models and constant lengths
    html = _report(_examples(base_lengths, tuned_lengths, base_pred="3", tuned_pred="3"))
    assert '"column_name": "output_length"' in html and '"column_name": "correct"' in html


def test_report_rejects_empty_frame():
    frame = build_comparison_frame(_examples([3, 4], []))
    with pytest.raises(ValueError, match="tuned"):
        evidently_report_html(frame[frame.model == "base"], frame[frame.model == "tuned"])


def test_evaluate_loss_is_per_token_mean_and_restores_mode():
    model = build_model(tiny_config(), seed=0)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for n_loss in (15, 2):  # uneven: a mean of batch means would differ
        ids = torch.randint(2, 250, (1, 16), generator=gen)
        labels = torch.full((1, 16), -100)
        labels[0, 15 - n_loss:15] = ids[0, 16 - n_loss:]
        batches.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(16)[None],
                        "doc_ids": torch.zeros(1, 16, dtype=torch.long)})
    with torch.no_grad():
        sums = [causal_lm_loss(model, b) for b in batches]
    expected = sum(float(s) for s, _ in sums) / sum(int(n) for _, n in sums)
    model.train()
    assert evaluate_loss(model, iter(batches)) == pytest.approx(expected, rel=1e-6)
    assert model.training
    assert expected != pytest.approx(sum(float(s) / int(n) for s, n in sums) / 2, rel=1e-3)


def test_exact_match_judges_worked_solutions_by_their_final_answer():
    from posttrain.eval.metrics import exact_match

    reference = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert exact_match("She sold 48 in April and 24 in May, 72 in all.\n#### 72", reference)
    assert not exact_match("She sold 24 clips in May.\n#### 24", reference)
    assert exact_match("#### 1,234", "#### 1234")


def test_uri_to_path_decodes_escapes(tmp_path):
    from posttrain.registry.local import uri_to_path

    directory = tmp_path / "with space é"
    assert uri_to_path(directory.as_uri()) == directory
    with pytest.raises(ValueError, match="not a local model URI"):
        uri_to_path("s3://bucket/model")
