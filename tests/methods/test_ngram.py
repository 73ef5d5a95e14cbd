"""`ngram`: prompt-lookup speculation. Oracles: a brute-force search for the lookup, the target
decoding alone (`ar`) for greedy output, and the target's own distribution (its logits) for
sampled output."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.methods.ngram import NgramIndex, NgramMethod

ENGINE = dict(max_batch_size=8, num_threads=1)
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
# Repetitive prompts: the tiny random model's text repeats itself, and these repeat their words.
PROMPTS = ["the cat and the dog and the cat and the dog and the", "a b c d a b c d a b c", "The cat liked to",
           "One day the cat met a big dog. One day the cat met", "春回大地春回大地春回"]


def brute_lookup(tokens: list[int], lo: int, hi: int, k: int) -> tuple[list[int], int]:
    """The longest n in [lo, hi] whose last n tokens occur earlier; the latest such place."""
    last = len(tokens) - 1
    for n in range(min(hi, last), lo - 1, -1):
        suffix = tokens[last - n + 1:]
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k], n
    return [], 0


@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 5), (3, 3)])
def test_the_incremental_index_finds_what_a_brute_force_search_finds(lo, hi):
    rng = random.Random(lo * 10 + hi)
    method = NgramMethod.__new__(NgramMethod)
    method.lookup_min, method.lookup_max = lo, hi
    for _ in range(20):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        idx = NgramIndex()
        for _ in range(25):            # the sequence grows by a few tokens between lookups
            assert method.lookup(idx, tokens, 4) == brute_lookup(tokens, lo, hi, 4), tokens
            tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


@pytest.fixture(scope="module")
def ar_greedy(llama_dir) -> list[list[int]]:
    return [o.token_ids for o in LLM(str(llama_dir), **ENGINE).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("options", [dict(verify="fixed"), dict(), dict(num_speculative_tokens=8, prompt_lookup_min=1)],
                         ids=["fixed", "confidence", "gamma8-min1"])
def test_greedy_ngram_equals_ar(llama_dir, ar_greedy, options):
    llm = LLM(str(llama_dir), method="ngram", **options, **ENGINE)
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == ar_greedy
    stats = llm.engine.method.stats()
    assert llm.engine.block_manager.num_used_blocks == 0
    if options.get("verify") == "fixed":
        # some drafts accepted, some rejected and rolled back (confidence scheduling may find that
        # verifying never beats a plain step on a model this small, and verify nothing)
        assert 0 < stats["num_accepted_tokens"] < stats["num_drafted_tokens"]
    again = llm.generate(PROMPTS[::-1], GREEDY)             # the same engine, another order
    assert [o.token_ids for o in again] == ar_greedy[::-1]


def test_bad_options_are_clear_errors(llama_dir):
    for options, message in ((dict(prompt_lookup_min=0), "prompt_lookup_min"),
                             (dict(prompt_lookup_min=4, prompt_lookup_max=3), "prompt_lookup_max"),
                             (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
                             (dict(lookahead=3), "unknown option")):
        with pytest.raises(ValueError, match=message):
            LLM(str(llama_dir), method="ngram", **options, **ENGINE)


def chi_square_bound(dof: int, z: float = 3.09) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sampled_ngram_keeps_the_targets_distribution():
    """Drafting starts after the first token. On the built-in `stories` model (trained: it
    follows the text it is given) a prompt that repeats itself gets the second token drafted,
    and the drafts are accepted or rejected by the lossless rule. Over many seeds the pairs
    (first, second token) must follow the target's own probabilities at temperature 0.8,
    p(t1) p(t2 | t1) from its logits, by a chi-square test."""
    temp, n = 0.8, 800
    llm = LLM("stories", method="ngram", verify="fixed", num_speculative_tokens=3, prompt_lookup_min=1, **ENGINE)
    prompt = "Tom had a big red ball. He liked to play. Tom had a big red ball. He"
    ids = llm.engine.tokenizer.encode(prompt)

    def probs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return (llm.engine.model.forward_dense(torch.tensor([tokens]))[0, -1].double() / temp).softmax(-1)

    params = [SamplingParams(max_tokens=3, temperature=temp, seed=s, ignore_eos=True) for s in range(n)]
    outs = llm.generate([ids] * n, params)
    stats = llm.engine.method.stats()
    assert stats["num_drafted_tokens"] >= n / 5 and 0 < stats["num_accepted_tokens"] < stats["num_drafted_tokens"]
    first = probs(ids)
    pairs = torch.tensor([o.token_ids[:2] for o in outs])
    common = (first * n >= 40).nonzero().flatten()
    obs, exp = [], []
    for t1 in common.tolist():         # the first tokens drawn often: each one's second tokens
        second = probs(ids + [t1]) * first[t1] * n
        got = torch.bincount(pairs[pairs[:, 0] == t1, 1], minlength=second.numel()).double()
        big = second >= 5
        obs += got[big].tolist() + [float(got[~big].sum())]
        exp += second[big].tolist() + [float(second[~big].sum())]
    obs.append(float((~torch.isin(pairs[:, 0], common)).sum()))
    exp.append(float(n - sum(exp)))
    obs_t, exp_t = torch.tensor(obs), torch.tensor(exp).clamp(min=1e-9)
    stat = float(((obs_t - exp_t) ** 2 / exp_t).sum())
    assert len(obs) >= 4
    assert stat < chi_square_bound(len(obs) - 1), (stat, obs, exp)


def test_a_seeded_sampled_request_writes_ars_tokens_whatever_was_drafted():
    """Picked drafts (n-gram lookups, predictions) are verified with `ar`'s own draws
    (Sampler.verify_picked): a seeded sampled request writes exactly `ar`'s tokens, alone, beside
    other requests, and with `ar`'s output given as its prediction."""
    from leapfrog.layers.cpu_kernels import cpu_kernels
    if cpu_kernels() is None:
        pytest.skip("no C++ sampler")
    prompts = ["Tom had a big red ball. He liked to play. Tom had a big red ball. He",
               "Lily saw a cat. The cat was big. Lily saw a cat. The cat", "Once upon a time"]
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=1),
              SamplingParams(max_tokens=24, temperature=1.0, seed=2, top_p=0.9, presence_penalty=0.3),
              SamplingParams(max_tokens=24, temperature=0.7, seed=3, top_k=20, repetition_penalty=1.1)]
    want = [o.token_ids for o in LLM("stories", **ENGINE).generate(prompts, params)]
    llm = LLM("stories", method="ngram", verify="fixed", num_speculative_tokens=4, prompt_lookup_min=1, **ENGINE)
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    predicted = llm.generate(prompts, [dataclasses.replace(sp, prediction=w) for sp, w in zip(params, want)])
    assert alone == want and together == want and [o.token_ids for o in predicted] == want
    assert all(o.metrics.num_accepted_tokens >= 15 for o in predicted)      # 4 of every 5 tokens
    assert llm.engine.method.stats()["num_accepted_tokens"] > 0


def _no_repeat_bigrams(history: list[int], row: torch.Tensor) -> torch.Tensor:
    """A logits processor that bans repeating the last token (reads the history it is given)."""
    if history:
        row = row.clone()
        row[history[-1]] = float("-inf")
    return row


CONTROLS = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.5),
            dict(logit_bias={5: 4.0, 7: -100.0}), dict(min_tokens=20), dict(logits_processors=[_no_repeat_bigrams]),
            dict(repetition_penalty=1.1, temperature=0.7, seed=3),
            dict(allowed_token_ids=list(range(3, 40)) + [2], min_tokens=4),
            dict(bad_words=["the", "cat and", "a b"])]


@pytest.mark.parametrize("method,extra", [("ngram", dict(verify="fixed", prompt_lookup_min=1)), ("draft", dict(num_speculative_tokens=4))],
                         ids=["ngram", "draft-self"])
@pytest.mark.parametrize("control", CONTROLS, ids=["repetition", "presence-frequency", "logit_bias", "min_tokens",
                                                   "processor", "sampled-repetition", "allowed", "bad_words"])
def test_sampling_controls_keep_drafting_and_ars_output(llama_dir, method, extra, control):
    """Penalties, logit_bias, min_tokens and logits processors apply at every verified row as
    if the drafts before it were committed: greedy output is `ar`'s token for token, drafts are
    still verified (and some accepted)."""
    if method == "draft":
        extra = dict(extra, draft_model=str(llama_dir))        # the target drafts for itself
    params = SamplingParams(max_tokens=32, ignore_eos=True, **{"temperature": 0, **control})
    want = [o.token_ids for o in LLM(str(llama_dir), **ENGINE).generate(PROMPTS, params)]
    llm = LLM(str(llama_dir), method=method, **extra, **ENGINE)
    got = llm.generate(PROMPTS, params)
    stats = llm.engine.method.stats()
    assert stats["num_verify_steps"] > 0
    if method == "draft" and params.greedy and ("min_tokens" in control or "repetition_penalty" in control):
        assert stats["num_accepted_tokens"] > 0       # (a bias of +4 on a nearly flat model, or a
                                                      # penalty on every copy, rejects the rest)
    if params.greedy:
        assert [o.token_ids for o in got] == want
    else:
        assert all(len(o.token_ids) == 32 for o in got)
    if "allowed_token_ids" in control:
        assert all(set(o.token_ids) <= set(control["allowed_token_ids"]) for o in got)


def test_a_request_caps_or_turns_off_drafting_and_its_counts_come_back(llama_dir, ar_greedy):
    llm = LLM(str(llama_dir), method="ngram", verify="fixed", num_speculative_tokens=6, prompt_lookup_min=1, **ENGINE)
    off = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, num_speculative_tokens=0)
    capped = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, num_speculative_tokens=1)
    outs = llm.generate(PROMPTS + PROMPTS, [off] * len(PROMPTS) + [capped] * len(PROMPTS))
    assert [o.token_ids for o in outs] == ar_greedy + ar_greedy
    for o in outs[:len(PROMPTS)]:
        m = o.metrics
        assert (m.num_drafted_tokens, m.num_accepted_tokens, m.drafting_off) == (0, 0, "request")
    capped_runs = [o.metrics for o in outs[len(PROMPTS):]]
    assert sum(m.num_drafted_tokens for m in capped_runs) > 0
    for m in capped_runs:
        assert m.drafting_off is None and m.num_accepted_tokens <= m.num_drafted_tokens
        verify_steps = round(m.num_accepted_tokens / (m.acceptance_length - 1)) if m.acceptance_length and \
            m.acceptance_length > 1 else None
        assert verify_steps is None or m.num_drafted_tokens <= verify_steps    # at most 1 draft a step
    stats = llm.engine.method.stats()
    assert stats["num_requests_drafting_off"] == len(PROMPTS)
    assert stats["num_drafted_tokens"] == sum(m.num_drafted_tokens for m in capped_runs)
    assert max(int(k.removeprefix("acceptance_rate_pos")) for k in stats if k.startswith("acceptance_rate_pos")) == 1
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
    plain = LLM(str(llama_dir), **ENGINE).generate(PROMPTS[:1], capped)[0]      # ar: no drafting to count
    assert plain.metrics.num_drafted_tokens is None


# --- OpenAI's Predicted Outputs: drafts from the request's prediction ----------------------------
def test_prediction_lookup_follows_the_prediction_forward():
    method = NgramMethod.__new__(NgramMethod)
    method.lookup_min, method.lookup_max = 2, 3
    pred = [10, 11, 12, 13, 10, 11, 14, 15]
    idx = NgramIndex(prediction=pred)
    for end in range(len(pred)):
        for n in range(2, min(3, end + 1) + 1):
            idx.pred_ends.setdefault(tuple(pred[end - n + 1:end + 1]), []).append(end)
    prompt = [1, 2, 3]
    # while the output is the prediction's start, its continuation (whatever the n-grams say)
    assert method.lookup_prediction(idx, prompt + [10], 3, 4) == ([11, 12, 13, 10], ("prediction", 0))
    assert method.lookup_prediction(idx, prompt + [10, 11, 12], 3, 2) == ([13, 10], ("prediction", 0))
    # the output leaves it (a 99 written), then meets it again at "10 11": the occurrence ahead
    # of where it was, not the first one
    assert method.lookup_prediction(idx, prompt + [10, 11, 12, 13, 99], 3, 4) == ([], 0)
    assert idx.pred_prefix == -1
    assert method.lookup_prediction(idx, prompt + [10, 11, 12, 13, 99, 10, 11], 3, 4) == ([14, 15], ("prediction", 2))


@pytest.mark.parametrize("method", ["ngram", "ar"])
def test_a_prediction_drafts_and_the_output_stays_ars(llama_dir, ar_greedy, method):
    llm = LLM(str(llama_dir), method=method, verify="fixed", **ENGINE) if method == "ngram" else \
        LLM(str(llama_dir), **ENGINE)
    # a prediction that is the output itself, one that is right for half of it, and a wrong one
    preds = [ar_greedy[0], ar_greedy[1][:16] + [7] * 16, [5, 6] * 16]
    params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, prediction=p) for p in preds]
    outs = llm.generate(PROMPTS[:2] + PROMPTS[:1], [params[0], params[1], params[2]])
    assert [o.token_ids for o in outs] == [ar_greedy[0], ar_greedy[1], ar_greedy[0]]
    if method == "ngram":
        exact = outs[0].metrics
        # every draft taken: 5 a step and the step's own token, 32 tokens in 7 forwards
        assert exact.num_accepted_tokens == exact.num_drafted_tokens >= 20 and exact.num_forwards <= 7
        without = llm.generate(PROMPTS[:1], GREEDY)[0].metrics
        assert exact.num_accepted_tokens > without.num_accepted_tokens
    text = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                                    prediction="the cat and the dog"))[0]
    assert text.token_ids == ar_greedy[0]
    with pytest.raises(ValueError, match="prediction"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, prediction=[10 ** 9]))
    with pytest.raises(ValueError, match="prediction"):
        SamplingParams(prediction=[-1])
