"""Next-item evaluation: tie-aware ranking metrics checked by hand and against a brute-force
average over tie orders, the baselines, the three rankings, the scorer's batching (padding
changes nothing) and its out-of-vocabulary count, and the training windows."""

import itertools
import math

import torch

from posttrain.data.interactions import NextItemCase
from posttrain.data.item_vocab import ItemCodec, build_item_vocabulary, save_item_tokenizer
from posttrain.data.records import SequenceRecord
from posttrain.data.tokenizer import load_tokenizer
from posttrain.eval.next_item import evaluate_next_item, sampled_negatives, score_cases
from posttrain.eval.ranking import MarkovBaseline, PopularityBaseline, ranking_metrics, summarise
from posttrain.models.architectures import build_model, tiny_config
from posttrain.steps.sequences import windows


def test_ranking_metrics_by_hand():
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0], [1.0, 9.0, 8.0, 7.0], [1.0, float("-inf"), 2.0, 3.0]])
    out = ranking_metrics(scores, torch.tensor([0, 0, 1]), ks=(1, 2))
    assert out["hit@1"].tolist() == [1.0, 0.0, 0.0] and out["hit@2"].tolist() == [1.0, 0.0, 0.0]
    assert out["ndcg@2"].tolist() == [1.0, 0.0, 0.0]
    assert torch.allclose(out["rr"], torch.tensor([1.0, 0.25, 0.0], dtype=torch.float64))
    second = ranking_metrics(torch.tensor([[3.0, 5.0, 1.0]]), torch.tensor([0]), ks=(2,))
    assert second["hit@2"].item() == 1.0 and abs(second["ndcg@2"].item() - 1 / math.log2(3)) < 1e-12


def test_ties_are_the_expectation_over_random_orders():
    scores = torch.tensor([[2.0, 2.0, 2.0, 5.0, 2.0, 1.0]])  # target 0 tied with 3 others, one above
    k = 3
    out = ranking_metrics(scores, torch.tensor([0]), ks=(k,))
    tied = [0, 1, 2, 4]
    hits, ndcgs, rrs = [], [], []
    for order in itertools.permutations(tied):
        rank = 1 + order.index(0)  # one item above every tie
        hits.append(rank < k)
        ndcgs.append(1 / math.log2(rank + 2) if rank < k else 0.0)
        rrs.append(1 / (rank + 1))
    assert abs(out[f"hit@{k}"].item() - sum(hits) / len(hits)) < 1e-12
    assert abs(out[f"ndcg@{k}"].item() - sum(ndcgs) / len(ndcgs)) < 1e-12
    assert abs(out["rr"].item() - sum(rrs) / len(rrs)) < 1e-12
    summary = summarise(out)
    assert set(summary) == {"recall@3", "recall@3_se", "ndcg@3", "ndcg@3_se", "mrr", "mrr_se"}


def test_baselines():
    histories = [[1, 2, 3], [1, 2, 4], [5, 2, 3], [3, 3]]
    catalogue = [1, 2, 3, 4, 5]
    popularity = PopularityBaseline(histories).scores([9], catalogue)
    assert popularity.tolist() == [2.0, 3.0, 4.0, 1.0, 1.0]
    markov = MarkovBaseline(histories)
    after_2 = markov.scores([7, 2], catalogue)
    assert after_2.argmax().item() == 2 and after_2[3] > after_2[0]  # 2 -> 3 twice, 2 -> 4 once, then popularity
    assert torch.equal(markov.scores([4], catalogue), popularity / (popularity.max() + 1))  # 4 never led anywhere


def test_three_rankings_and_sampled_negatives_are_shared():
    catalogue = [10, 20, 30, 40]
    cases = [NextItemCase([10, 20], 30), NextItemCase([30, 40], 30), NextItemCase([10], 99)]
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    negatives = sampled_negatives(cases, catalogue, 2, seed=0)
    assert negatives == sampled_negatives(cases, catalogue, 2, seed=0)
    assert all(catalogue[c] not in set(case.history) | {case.target} for case, cols in zip(cases, negatives)
               for c in cols)
    metrics, per_case = evaluate_next_item(scores, cases, catalogue, ks=(1,), negatives=negatives)
    assert metrics["cases"] == 3 and metrics["targets_out_of_catalogue"] == 1 and metrics["cases_new"] == 1
    assert per_case["hit@1"].tolist() == [0.0, 0.0, 0.0]
    assert metrics["recall@1_new"] == 1.0  # case 0 with 10 and 20 (seen) removed: 30 is first
    assert "recall@1_sampled2" in metrics


def test_windows_keep_whole_items_and_end_with_the_history():
    tokens = [0, *range(1, 12)]  # <bos> + 11 items
    parts = windows(tokens, row_length=5, per_item=1)
    assert parts == [[0, 1, 2, 3], [0, 4, 5, 6, 7], [0, 8, 9, 10, 11]]
    paired = windows([0, *range(1, 11)], row_length=6, per_item=2)  # 5 items with event tokens
    assert all((len(p) - 1) % 2 == 0 for p in paired) and paired[-1][-1] == 10
    assert windows([0, 1, 2], row_length=8, per_item=1) == [[0, 1, 2]]


def test_scores_do_not_depend_on_the_batch_and_unknown_items_are_counted(tmp_path):
    records = [SequenceRecord([1, 2, 3, 4, 2], "s", 1), SequenceRecord([3, 4, 5], "s", 2)]
    tokenizer = load_tokenizer(str(save_item_tokenizer(build_item_vocabulary(records), tmp_path / "tok")))
    codec = ItemCodec(tokenizer)
    model = build_model(tiny_config("qwen3", vocab_size=len(tokenizer)), seed=0).eval()
    catalogue = [1, 2, 3, 4, 5, 6]  # 6 is not in the vocabulary
    cases = [NextItemCase([1, 2, 3, 4], 2), NextItemCase([3], 4), NextItemCase([7, 3, 1], 5)]
    together, oov = score_cases(model, codec, cases, catalogue, max_tokens=64, batch_size=3)
    assert oov == 1  # item 7 maps to <unk>
    assert torch.isinf(together[:, 5]).all()
    for i, case in enumerate(cases):
        alone, _ = score_cases(model, codec, [case], catalogue, max_tokens=64)
        assert torch.allclose(alone[0], together[i], atol=1e-5)
    cut, _ = score_cases(model, codec, [cases[0]], catalogue, max_tokens=3)  # <bos> + the 2 most recent items
    recent, _ = score_cases(model, codec, [NextItemCase([3, 4], 2)], catalogue, max_tokens=64)
    assert torch.allclose(cut, recent, atol=1e-6)
