"""`draft`: speculative decoding with a small AR draft model. Oracle: the target decoding alone
(`ar`); the draft model only decides how many tokens a verify step commits."""
from __future__ import annotations

import shutil

import pytest
import torch

from conftest import build_model
from leapfrog import LLM, SamplingParams

ENGINE = dict(max_batch_size=8, num_threads=1)
PROMPTS = ["Once upon a time there was", "The cat liked to", "One day the cat met a big dog.",
           "They became friends", "春回大地"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_greedy_output_is_the_targets_and_rejected_drafts_roll_back(llama_dir, draft_dir):
    ar = LLM(str(llama_dir), **ENGINE).generate(PROMPTS, GREEDY)
    llm = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), num_speculative_tokens=3, **ENGINE)
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    stats = llm.engine.method.stats()
    # Some drafts accepted, some rejected: the draft model's cache was cut back and fed again.
    assert 0 < stats["num_accepted_tokens"] < stats["num_drafted_tokens"]
    assert 1.0 < stats["acceptance_length"] < 4.0
    method = llm.engine.method
    assert method.blocks.num_used_blocks == 0 and not method.entries
    again = llm.generate(PROMPTS[::-1], GREEDY)              # the same engine, another order
    assert [o.token_ids for o in again] == [o.token_ids for o in ar[::-1]]


def test_the_target_as_its_own_draft_model_accepts_every_draft(llama_dir):
    llm = LLM(str(llama_dir), method="draft", draft_model=str(llama_dir), num_speculative_tokens=4, **ENGINE)
    out = llm.generate(PROMPTS, GREEDY)
    ar = LLM(str(llama_dir), **ENGINE).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    stats = llm.engine.method.stats()
    assert stats["num_accepted_tokens"] == stats["num_drafted_tokens"] > 0


def test_a_cache_too_small_for_drafts_decodes_as_ar(llama_dir, draft_dir):
    """One block of 16 slots: a request drafts only while its text and drafts fit and it holds
    the block; the others verify nothing, and the output does not change."""
    small = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), draft_kv_tokens=16, **ENGINE)
    full = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), **ENGINE)
    ar = LLM(str(llama_dir), **ENGINE).generate(PROMPTS, GREEDY)
    for llm in (small, full):
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ar]
    drafted = [llm.engine.method.stats()["num_drafted_tokens"] for llm in (small, full)]
    assert drafted[0] < drafted[1] / 4
    assert small.engine.method.blocks.num_used_blocks == 0


def test_sampled_requests_decode_to_their_length(llama_dir, draft_dir):
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    llm = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), **ENGINE)
    out = llm.generate(PROMPTS, params)
    assert all(len(o.token_ids) == 16 for o in out)
    assert llm.engine.method.stats()["num_drafted_tokens"] > 0


def test_bad_draft_models_are_clear_errors(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="needs draft_model"):
        LLM(str(llama_dir), method="draft", **ENGINE)
    other = build_model(tmp_path, "llama", vocab_size=320)     # another vocabulary
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(llama_dir), method="draft", draft_model=str(other), **ENGINE)
    with pytest.raises(ValueError, match="unknown option"):
        LLM(str(llama_dir), method="draft", draft_model=str(llama_dir), drafts=3, **ENGINE)


@torch.no_grad()
@pytest.mark.parametrize("decode_loop", [True, False])
def test_accepted_drafts_match_a_full_recompute_of_the_draft_model(llama_dir, draft_dir, decode_loop):
    """Every verify step's drafts are the draft model's greedy continuation of the committed text
    (its cache cut back to what was accepted): counted against transformers recomputing it."""
    import transformers
    hf = transformers.LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    gamma, params = 3, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    llm = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), num_speculative_tokens=gamma, **ENGINE)
    if not decode_loop:                                 # every draft forward layer by layer
        llm.engine.method.draft.decode_loop = lambda block_size: None
    want_drafted = want_accepted = 0
    for prompt in PROMPTS[:3]:
        out = llm.generate([prompt], params)[0]
        ids, text = llm.tokenizer.encode(prompt), out.token_ids
        o = 1                                                 # the prefill's token
        while o < params.max_tokens:
            k = min(gamma, params.max_tokens - o - 1)
            if k < 1:
                o += 1
                continue
            ctx = list(ids) + text[:o]
            drafts = []
            for _ in range(k):
                drafts.append(int(hf(torch.tensor([ctx + drafts])).logits[0, -1].argmax()))
            n = 0
            while n < k and drafts[n] == text[o + n]:
                n += 1
            want_drafted, want_accepted, o = want_drafted + k, want_accepted + n, o + n + 1
    stats = llm.engine.method.stats()
    assert (stats["num_drafted_tokens"], stats["num_accepted_tokens"]) == (want_drafted, want_accepted)
    assert 0 < want_accepted < want_drafted
    assert (llm.engine.method.num_loop_calls > 0) == decode_loop     # drafts 2..γ from the C++ loop


@torch.no_grad()
@pytest.mark.parametrize("decode_loop", [True, False])
def test_confidences_are_the_draft_models_probabilities(llama_dir, draft_dir, decode_loop):
    """A draft's probability is the draft model's softmax probability of it after the text and
    the drafts before it (from the C++ loop or the layer-by-layer forward): against transformers.
    Its confidence is that probability calibrated by what verification showed."""
    import transformers
    hf = transformers.LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    llm = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), num_speculative_tokens=3,
              verify="threshold", threshold=0.0, **ENGINE)         # threshold 0: verify every draft
    method = llm.engine.method
    if not decode_loop:
        method.draft.decode_loop = lambda block_size: None
    seen = []
    propose = method.propose
    method.propose = lambda anchors: [
        seen.append((a.seq.token_ids + a.new_token_ids, p, list(method.entries[a.seq.seq_id].probs),
                     method.calibration(method.entries[a.seq.seq_id].probs))) or p
        for a, p in zip(anchors, propose(anchors))]
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 10 for o in out) and len(seen) > 4
    for text, prop, drawn, calibrated in seen:
        assert prop.num_verify == len(prop.confidence) == len(prop.token_ids) == 3
        assert prop.confidence == calibrated
        probs = hf(torch.tensor([text + prop.token_ids[:-1]])).logits[0, len(text) - 1:].softmax(-1)
        want = probs[torch.arange(3), torch.tensor(prop.token_ids)]
        assert prop.token_ids == probs.argmax(-1).tolist()
        assert torch.allclose(torch.tensor(drawn), want, atol=1e-4)
    assert (method.num_loop_calls > 0) == decode_loop


@pytest.mark.parametrize("costs,drafts", [
    ({1: 0.001, 64: 64.0}, False),           # a verified draft costs about a whole decode step: never worth it
    ({1: 0.01, 64: 0.0100001}, True),        # verification is free: always worth drafting
])
def test_confidence_scheduling_drafts_only_where_verifying_pays(llama_dir, draft_dir, costs, drafts, fake_clock):
    """verify="confidence" prices drafts by the draft model's probabilities and the target's
    step costs (given here, with a clock that makes drafting free): it stops drafting where a
    verified draft costs a decode step, and verifies where verifying is free; the output is
    `ar`'s either way and the draft cache is released."""
    ar = LLM(str(llama_dir), **ENGINE).generate(PROMPTS, GREEDY)
    llm = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), verify="confidence",
              step_costs=costs, **ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ar]
    method = llm.engine.method
    stats = method.stats()
    steps = sum(len(o.token_ids) for o in ar)
    if drafts:
        assert stats["num_skipped_drafts"] == 0 and stats["num_accepted_tokens"] > 0
    else:
        assert stats["num_skipped_drafts"] > 0.5 * steps
        assert method.policy.stats()["num_drafts"] <= 2 + steps / method.policy.reprobe_steps
    assert method.blocks.num_used_blocks == 0 and not method.entries


def test_calibration_maps_probabilities_to_the_acceptance_seen():
    from leapfrog.methods.draft_model import Calibration
    cal = Calibration(bins=4, prior=2.0)
    assert cal([0.1, 0.9]) == [0.5, 0.5]                  # nothing seen: one half everywhere
    cal.observe([0.9, 0.9, 0.1, 0.9], 2)                  # accepted, accepted, rejected; the 4th unseen
    assert (cal.hits, cal.counts) == ([0.0, 0.0, 0.0, 2.0], [1.0, 0.0, 0.0, 2.0])
    rate = 3 / 5                                          # (2 accepted + 1) / (3 seen + 2)
    assert cal([0.05, 0.3, 0.95]) == pytest.approx([(0 + 2 * rate) / 3, rate, (2 + 2 * rate) / 4])
    cal.observe([0.2], 1)                                 # all accepted: nothing after them counts
    assert cal.counts == [2.0, 0.0, 0.0, 2.0]


def test_confidence_scheduling_drafts_as_far_as_verifying_pays(llama_dir, fake_clock):
    """The draft length follows the cost curve: where a forward of 4 rows costs 4x one of 3,
    a request verifies 2 drafts and drafts 3 (one past what it verifies), not γ = 6, once
    drafting is measured (the first drafts are probes of all γ). The target drafts for itself
    here, so every draft is accepted; the output stays `ar`'s."""
    llm = LLM(str(llama_dir), method="draft", draft_model=str(llama_dir), verify="confidence",
              num_speculative_tokens=6, step_costs={1: 0.01, 3: 0.0101, 4: 0.04, 64: 0.64}, **ENGINE)
    method = llm.engine.method
    lengths, verified = [], []
    propose = method.propose
    method.propose = lambda anchors: [lengths.append(len(p.token_ids)) or verified.append(p.num_verify) or p
                                      for p in propose(anchors)]
    ar = LLM(str(llama_dir), **ENGINE)
    for prompt in PROMPTS[:3]:
        assert llm.generate([prompt], GREEDY)[0].token_ids == ar.generate([prompt], GREEDY)[0].token_ids
    assert lengths[0] == 6 and lengths[-1] == 3 and lengths.count(3) > len(lengths) / 2
    assert verified[-1] == 2
    stats = method.stats()
    assert stats["num_accepted_tokens"] == stats["num_drafted_tokens"] > 0
    assert method.blocks.num_used_blocks == 0 and not method.entries


def test_policy_draft_lengths_follow_the_predicted_rows():
    from leapfrog.methods.confidence_schedule import MeasuredCost, StepCostTable
    from leapfrog.methods.verify import ConfidencePolicy, FixedPolicy, VerifyRecord, blend_rows, extend_row
    assert FixedPolicy().draft_lengths([VerifyRecord()] * 2, 5) == [5, 5]
    policy = ConfidencePolicy(StepCostTable.from_mapping({1: 1.0, 64: 7.3}))   # +10% a row
    assert policy.draft_lengths([VerifyRecord()], 5) == [5]                     # nothing measured yet
    policy.measured = MeasuredCost(policy.step_costs)
    policy.measured.draft.add(1, 1e-6)
    policy.measured.draft.add(1, 1e-6)
    sure, doubtful = VerifyRecord(prediction=[0.99, 0.98]), VerifyRecord(prediction=[0.5, 0.05])
    policy.prior = [0.5]
    # [0.99, 0.98] extends at rate 0.99: every position pays; [0.5, 0.05]: only the first.
    assert policy.draft_lengths([sure, doubtful], 5) == [5, 2]
    # Drafting priced per drafted token at 0.3 of a step each: the doubtful draft's 0.5 tokens
    # no longer pay for its verify row and its own drafting (a request drafts one past it).
    policy.draft_cost_per_token = True
    policy.measured.draft.slope, policy.measured.draft.intercept = 0.3, 0.0
    assert policy.draft_lengths([sure, doubtful], 5) == [5, 1]
    assert extend_row([0.8, 0.4], 4) == pytest.approx([0.8, 0.4, 0.2, 0.1])
    assert extend_row([0.5], 2) == [0.5, 0.25]
    assert blend_rows([0.8, 0.6], [0.4, 0.2, 0.1], 0.5) == pytest.approx([0.6, 0.4, 0.1])
    assert blend_rows([0.9, 0.8, 0.7], [0.2], 0.5) == pytest.approx([0.55, 0.55, 0.55])


def test_a_model_folder_names_its_draft_model_and_default_options(llama_dir, draft_dir, tmp_path):
    """leapfrog.json: {"drafters": {"draft": <model>}} is the draft model when none is given,
    and {"method_options": {"draft": {...}}} the method's defaults, under the caller's own."""
    import json
    folder = tmp_path / "target"
    shutil.copytree(llama_dir, folder)
    meta = folder / "leapfrog.json"
    meta.write_text(json.dumps({"drafters": {"draft": str(draft_dir)},
                                "method_options": {"draft": {"num_speculative_tokens": 2, "verify": "threshold"}}}))
    llm = LLM(str(folder), method="draft", **ENGINE)
    method = llm.engine.method
    assert method.draft_path == draft_dir and method.num_speculative_tokens == 2 and method.policy.name == "threshold"
    ar = LLM(str(llama_dir), **ENGINE).generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == [o.token_ids for o in ar]
    mine = LLM(str(folder), method="draft", num_speculative_tokens=3, **ENGINE).engine.method
    assert mine.num_speculative_tokens == 3 and mine.policy.name == "threshold"
    meta.write_text(json.dumps({"drafters": {"draft": "no-such-model"}}))
    with pytest.raises(ValueError, match="leapfrog.json.*no-such-model"):
        LLM(str(folder), method="draft", **ENGINE)
    meta.write_text(json.dumps({"method_options": {"draft": [2]}}))
    with pytest.raises(ValueError, match="leapfrog.json: method_options.draft must be an object"):
        LLM(str(folder), method="draft", draft_model=str(draft_dir), **ENGINE)
