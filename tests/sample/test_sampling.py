"""Sampler and filter functions against naive reference implementations written here."""
from __future__ import annotations

import math

import pytest
import torch

from leapfrog.sample.sampler import Sampler, apply_penalties, filter_logits, token_logprobs
from leapfrog.sampling_params import SamplingParams
from leapfrog.sequence import Sequence

V = 50
CPU = torch.device("cpu")


def make_seq(prompt, output=(), rid="r", **params) -> Sequence:
    return Sequence(rid, list(prompt) + list(output), SamplingParams(**params), num_prompt_tokens=len(prompt))


def rand_logits(n, v=V, seed=0, scale=3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


# --- naive references (float64, plain Python) ---------------------------------------------------

def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [x / s for x in e]


def ref_top_k(xs, k):
    if k <= 0 or k >= len(xs):
        return list(xs)
    kth = sorted(xs, reverse=True)[k - 1]
    return [x if x >= kth else -math.inf for x in xs]


def ref_top_p(xs, p):
    """Keep the smallest set of most likely tokens whose mass reaches p."""
    if p >= 1:
        return list(xs)
    probs = softmax(xs)
    order = sorted(range(len(xs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for i in order:
        if mass >= p:
            break
        keep.add(i)
        mass += probs[i]
    return [x if i in keep else -math.inf for i, x in enumerate(xs)]


def ref_min_p(xs, mp):
    if mp <= 0:
        return list(xs)
    probs = softmax(xs)
    floor = mp * max(probs)
    return [x if probs[i] >= floor else -math.inf for i, x in enumerate(xs)]


def ref_penalties(xs, prompt, output, rep=1.0, pres=0.0, freq=0.0):
    xs = list(xs)
    if rep != 1.0:
        for t in set(prompt) | set(output):
            xs[t] = xs[t] / rep if xs[t] > 0 else xs[t] * rep
    for t in set(output):
        xs[t] -= freq * output.count(t) + pres
    return xs


def ref_probs(xs, prompt, output, p: SamplingParams):
    xs = ref_penalties(xs, prompt, output, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
    if p.greedy:
        best = max(range(len(xs)), key=lambda i: xs[i])
        return [1.0 if i == best else 0.0 for i in range(len(xs))]
    xs = [x / p.temperature for x in xs]
    xs = ref_min_p(ref_top_p(ref_top_k(xs, max(p.top_k, 0)), p.top_p), p.min_p)
    return softmax(xs)


def kept(row: torch.Tensor) -> list[bool]:
    return (row > torch.finfo(row.dtype).min).tolist()


def filt(logits, top_k=0, top_p=1.0, min_p=0.0):
    n = logits.shape[0]
    as_t = lambda v, dt: torch.tensor(v if isinstance(v, list) else [v] * n, dtype=dt)
    return filter_logits(logits.clone(), as_t(top_k, torch.long), as_t(top_p, torch.float32),
                         as_t(min_p, torch.float32))


# --- filters --------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 5, 17, V - 1, V, V + 10])
def test_top_k_matches_reference(k):
    logits = rand_logits(4, seed=k)
    out = filt(logits, top_k=k)
    for i in range(4):
        ref = ref_top_k(logits[i].tolist(), k)
        assert kept(out[i]) == [x != -math.inf for x in ref]
        assert sum(kept(out[i])) == min(k, V)
        assert torch.equal(out[i][out[i] > -1e30], logits[i][out[i] > -1e30])   # survivors untouched


@pytest.mark.parametrize("p", [0.01, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_matches_reference(p):
    logits = rand_logits(6, seed=int(p * 1000), scale=2.0)
    out = filt(logits, top_p=p)
    for i in range(6):
        ref = ref_top_p(logits[i].double().tolist(), p)
        assert kept(out[i]) == [x != -math.inf for x in ref]
        assert out[i].argmax() == logits[i].argmax()     # the top token always survives


@pytest.mark.parametrize("mp", [0.0, 0.05, 0.2, 0.5, 0.9, 1.0])
def test_min_p_matches_reference(mp):
    logits = rand_logits(6, seed=int(mp * 100) + 7, scale=2.0)
    out = filt(logits, min_p=mp)
    for i in range(6):
        ref = ref_min_p(logits[i].double().tolist(), mp)
        assert kept(out[i]) == [x != -math.inf for x in ref]


def test_filters_combined_per_row():
    logits = rand_logits(5, seed=3, scale=2.5)
    top_k, top_p, min_p = [0, 3, 10, 0, 20], [1.0, 1.0, 0.7, 0.6, 0.9], [0.0, 0.0, 0.0, 0.1, 0.05]
    out = filt(logits, top_k, top_p, min_p)
    for i in range(5):
        ref = ref_min_p(ref_top_p(ref_top_k(logits[i].double().tolist(), top_k[i]), top_p[i]), min_p[i])
        assert kept(out[i]) == [x != -math.inf for x in ref], i


def test_filters_off_are_identity():
    logits = rand_logits(3, seed=11)
    assert torch.equal(filt(logits), logits)


# --- penalties ------------------------------------------------------------------------------------

@pytest.mark.parametrize("rep,pres,freq", [(1.3, 0, 0), (0.8, 0, 0), (1, 0.7, 0), (1, 0, 0.4),
                                           (1, -0.5, -0.3), (1.5, 0.5, 0.25)])
def test_penalties_match_reference(rep, pres, freq):
    logits = rand_logits(3, seed=5)
    prompts = [[1, 2, 3, 3], [4, 4, 4], [10, 11]]
    outputs = [[3, 5, 5, 5, 9], [], [11, 11, 12, 2, 12]]
    seqs = [make_seq(pr, o, f"r{i}", repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
            for i, (pr, o) in enumerate(zip(prompts, outputs))]
    out = apply_penalties(logits.clone(), seqs)
    for i in range(3):
        ref = ref_penalties(logits[i].double().tolist(), prompts[i], outputs[i], rep, pres, freq)
        assert torch.allclose(out[i].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5)


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, V)
    seq = make_seq([1, 1, 2], [3], presence_penalty=1.0, frequency_penalty=1.0)
    out = apply_penalties(logits.clone(), [seq])[0]
    assert out[1] == 0 and out[2] == 0 and out[3] == -2.0


def test_penalties_skip_rows_without_them_and_out_of_vocab_ids():
    logits = rand_logits(2, seed=9)
    plain = make_seq([1, 2], [3])
    pen = make_seq([1, V + 5], [V + 7, 3], "p", repetition_penalty=2.0, frequency_penalty=1.0)
    out = apply_penalties(logits.clone(), [plain, pen])
    assert torch.equal(out[0], logits[0])
    ref = ref_penalties(logits[1].double().tolist(), [1], [3], 2.0, 0.0, 1.0)
    assert torch.allclose(out[1].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5)


# --- Sampler.probs / greedy ------------------------------------------------------------------------

CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=0.5, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
         presence_penalty=0.3, frequency_penalty=0.2),
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=3.0),
    dict(temperature=1.0, top_k=-1),
]


def test_probs_match_reference():
    sampler = Sampler(CPU)
    logits = rand_logits(len(CASES), seed=21)
    prompt, output = [1, 2, 3], [3, 4, 4, int(logits[6].argmax())]
    seqs = [make_seq(prompt, output, f"r{i}", **c) for i, c in enumerate(CASES)]
    before = logits.clone()
    probs = sampler.probs(logits, seqs)
    assert torch.equal(logits, before)                   # the caller's logits are not modified
    for i, seq in enumerate(seqs):
        ref = ref_probs(logits[i].double().tolist(), prompt, output, seq.params)
        assert torch.allclose(probs[i].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5), CASES[i]
        assert abs(probs[i].sum().item() - 1) < 1e-5


def test_greedy_is_argmax():
    sampler = Sampler(CPU)
    logits = rand_logits(8, seed=4)
    seqs = [make_seq([1], rid=f"g{i}", temperature=0.0) for i in range(8)]
    tokens, lps = sampler.sample(logits, seqs)
    assert tokens == logits.argmax(-1).tolist() and lps is None


def test_greedy_rows_in_mixed_batch_and_with_penalties():
    sampler = Sampler(CPU, seed=1)
    logits = rand_logits(4, seed=8)
    top = int(logits[2].argmax())
    seqs = [make_seq([1], rid="a", temperature=0.0),
            make_seq([1], rid="b", temperature=1.0),
            make_seq([1], [top], rid="c", temperature=0.0, repetition_penalty=1e6),
            make_seq([1], rid="d", temperature=0.0, top_k=3)]
    for _ in range(5):
        tokens, _ = sampler.sample(logits.clone(), seqs)
        assert tokens[0] == int(logits[0].argmax())
        penalized = ref_penalties(logits[2].double().tolist(), [1], [top], 1e6)
        assert tokens[2] == max(range(V), key=lambda i: penalized[i]) and tokens[2] != top
        assert tokens[3] == int(logits[3].argmax())


def test_top_k_1_is_greedy_at_any_temperature():
    sampler = Sampler(CPU, seed=3)
    logits = rand_logits(6, seed=12)
    seqs = [make_seq([1], rid=f"k{i}", temperature=2.0, top_k=1) for i in range(6)]
    for _ in range(5):
        assert sampler.sample(logits, seqs)[0] == logits.argmax(-1).tolist()


def test_samples_stay_inside_the_filtered_support():
    sampler = Sampler(CPU, seed=5)
    logits = rand_logits(1, seed=13).repeat(400, 1)
    seq = make_seq([1], temperature=1.5, top_k=4)
    tokens, _ = sampler.sample(logits, [seq] * 400)
    allowed = set(logits[0].topk(4).indices.tolist())
    assert set(tokens) <= allowed and len(set(tokens)) > 1


# --- seeds -----------------------------------------------------------------------------------

def seeded(sampler, seed, rid="s", **params) -> Sequence:
    seq = make_seq([1, 2], rid=rid, seed=seed, **params)
    seq.generator = sampler.make_generator(seed)
    return seq


def run_steps(sampler, logits, seqs, steps=12):
    return [sampler.sample(logits, seqs)[0] for _ in range(steps)]


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=20)])
def test_seed_independent_of_batch(params):
    logits = rand_logits(8, seed=30, scale=1.0)       # flat enough to make draws vary
    row = logits[3:4]

    s = Sampler(CPU, seed=0)
    alone = [t[0] for t in run_steps(s, row, [seeded(s, 42, **params)])]
    assert len(set(alone)) > 1

    s = Sampler(CPU, seed=1)
    seqs = [make_seq([5], rid="u0"), seeded(s, 7, "o1"), make_seq([6], rid="u2", top_k=3),
            seeded(s, 42, "me", **params), seeded(s, 9, "o4", temperature=0.5),
            make_seq([7], rid="u5", temperature=0.0)]
    batch = torch.cat([logits[:3], row, logits[4:6]])
    in_batch = [t[3] for t in run_steps(s, batch, seqs)]
    assert in_batch == alone

    s = Sampler(CPU, seed=2)                          # different size, first position
    seqs = [seeded(s, 42, "me", **params), make_seq([5], rid="u1"), seeded(s, 8, "o2")]
    in_batch = [t[0] for t in run_steps(s, torch.cat([row, logits[6:8]]), seqs)]
    assert in_batch == alone

    s = Sampler(CPU, seed=0)
    other = [t[0] for t in run_steps(s, row, [seeded(s, 43, **params)])]
    assert other != alone


def test_unseeded_requests_use_the_sampler_seed():
    logits = rand_logits(2, seed=31, scale=1.0)
    runs = []
    for _ in range(2):
        s = Sampler(CPU, seed=123)
        runs.append(run_steps(s, logits, [make_seq([1], rid="a"), make_seq([1], rid="b")]))
    assert runs[0] == runs[1]


# --- draw distribution ---------------------------------------------------------------------

def test_draw_follows_probabilities_chi_square():
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 20000
    sampler = Sampler(CPU)
    seq = make_seq([1], seed=2024)
    seq.generator = sampler.make_generator(2024)
    tokens = sampler.draw(p.repeat(n, 1), [seq] * n)
    counts = torch.bincount(tokens, minlength=5).double()
    expected = p.double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 18.47                                # df = 4, p = 0.001
    tv = 0.5 * (counts / n - p.double()).abs().sum().item()
    assert tv < 0.015


def test_draw_never_picks_zero_probability_and_handles_one_hot():
    sampler = Sampler(CPU, seed=77)
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    seq = make_seq([1])
    for _ in range(200):
        a, b = sampler.draw(p, [seq, seq]).tolist()
        assert a in (1, 3) and b == 2


# --- logprobs --------------------------------------------------------------------------------

def test_logprobs_entries():
    sampler = Sampler(CPU, seed=4)
    logits = rand_logits(3, seed=40)
    seqs = [make_seq([1], rid="a", logprobs=5), make_seq([1], rid="b", logprobs=0, temperature=0.0),
            make_seq([1], rid="c")]
    tokens, entries = sampler.sample(logits, seqs)
    ref = logits.double().log_softmax(-1)
    a, b, c = entries
    assert a["token_id"] == tokens[0]
    assert abs(a["logprob"] - ref[0, tokens[0]].item()) < 1e-5
    assert len(a["top"]) == 5
    top_vals = [v for _, v in a["top"]]
    assert top_vals == sorted(top_vals, reverse=True)
    assert [i for i, _ in a["top"]] == ref[0].topk(5).indices.tolist()
    for i, v in a["top"]:
        assert abs(v - ref[0, i].item()) < 1e-5
    assert b["token_id"] == tokens[1] == int(logits[1].argmax()) and b["top"] == []
    assert abs(b["logprob"] - ref[1].max().item()) < 1e-5
    assert c == {}


def test_logprobs_are_of_the_raw_distribution():
    logits = rand_logits(1, seed=41)
    seq = make_seq([1], temperature=0.3, top_k=2, logprobs=1)
    entry = token_logprobs(logits, [7], [seq])[0]
    assert abs(entry["logprob"] - logits[0].log_softmax(-1)[7].item()) < 1e-6
    assert entry["top"][0][0] == int(logits[0].argmax())


def test_min_tokens_bans_end_tokens_until_reached():
    """min_tokens: end-of-text ids and stop_token_ids get -inf while fewer output tokens exist,
    nothing else changes, and the ban lifts once min_tokens are out."""
    logits = rand_logits(2, seed=4)
    early = make_seq([1, 2], [5], "a", min_tokens=3, stop_token_ids=[7], max_tokens=8)
    early.eos_token_ids = (2, 9)
    done = make_seq([1, 2], [5, 6, 8], "b", min_tokens=3, stop_token_ids=[7], max_tokens=8)
    done.eos_token_ids = (2, 9)
    out = apply_penalties(logits.clone(), [early, done])
    banned = [2, 7, 9]
    assert all(out[0, t] == float("-inf") for t in banned)
    keep = [t for t in range(V) if t not in banned]
    assert torch.equal(out[0, keep], logits[0, keep]) and torch.equal(out[1], logits[1])
    assert SamplingParams(min_tokens=2).needs_penalties and not SamplingParams().needs_penalties
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
