"""Speculative decoding (dflash, dspark): oracles on tiny random models.

Greedy speculative == greedy ar token for token; a drafter that proposes the target's own
continuation is fully accepted; the acceptance rule (Leviathan et al. 2023; Chen et al. 2023)
reproduces the target distribution; no KV block outlives its request. Drafter checkpoints are
written here in the z-lab DFlash and DeepSpec DSpark layouts.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from leapfrog import LLM, SamplingParams
from leapfrog.models.loader import CheckpointError, load_drafter
from leapfrog.methods.speculative import Proposal, SpeculativeMethod
from leapfrog.sample.rejection import greedy_accept, verify_drafts
from leapfrog.methods.verify import ConfidencePolicy, VerifyRecord

pytestmark = pytest.mark.usefixtures("one_thread")


GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = ["Once upon a time", "The cat liked to play in the sun. One day the cat met a big dog.",
           "春回大地", "They became friends and"]
ENGINE = dict(block_size=4, max_num_batched_tokens=24)   # small budget: prefill chunks mix with verify steps


def _layer_tensors(i: int, d: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> dict:
    r = lambda *shape: torch.randn(*shape) * 0.08
    p = f"layers.{i}."
    return {p + "self_attn.q_proj.weight": r(heads * head_dim, d),
            p + "self_attn.k_proj.weight": r(kv_heads * head_dim, d),
            p + "self_attn.v_proj.weight": r(kv_heads * head_dim, d),
            p + "self_attn.o_proj.weight": r(d, heads * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim),
            p + "self_attn.k_norm.weight": torch.ones(head_dim),
            p + "mlp.gate_proj.weight": r(ffn, d), p + "mlp.up_proj.weight": r(ffn, d),
            p + "mlp.down_proj.weight": r(d, ffn),
            p + "input_layernorm.weight": torch.ones(d), p + "post_attention_layernorm.weight": torch.ones(d)}


def write_drafter(folder: Path, target: Path, kind: str = "dflash", num_layers: int = 1,
                  block_size: int = 5, head: str = "vanilla", rank: int = 8, taps=(0, 1)) -> Path:
    """A random drafter for `target` in the published layout of `kind`."""
    torch.manual_seed(7)
    t = json.loads((target / "config.json").read_text())
    d, v, heads, kvh = t["hidden_size"], t["vocab_size"], t["num_attention_heads"], t["num_key_value_heads"]
    head_dim = t.get("head_dim") or d // heads
    cfg = {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                             "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta") if k in t}
    cfg.update(head_dim=head_dim, num_hidden_layers=num_layers, num_target_layers=t["num_hidden_layers"])
    tensors = {"fc.weight": torch.randn(d, len(taps) * d) * 0.08,
               "hidden_norm.weight": torch.ones(d), "norm.weight": torch.ones(d)}
    for i in range(num_layers):
        tensors.update(_layer_tensors(i, d, heads, kvh, head_dim, t["intermediate_size"]))
    if kind == "dflash":   # z-lab: block_size and dflash_config
        cfg.update(architectures=["DFlashDraftModel"], block_size=block_size,
                   dflash_config={"mask_token_id": 3, "target_layer_ids": list(taps)})
    else:                  # DeepSpec Qwen3DSparkModel: flat keys, frozen embed/lm_head copies inside
        cfg.update(architectures=["Qwen3DSparkModel"], block_size=block_size, mask_token_id=3,
                   target_layer_ids=list(taps), markov_rank=rank, markov_head_type=head,
                   enable_confidence_head=True, confidence_head_with_markov=True, tie_word_embeddings=False)
        tensors.update({"embed_tokens.weight": torch.randn(v, d), "lm_head.weight": torch.randn(v, d),
                        "markov_head.markov_w1.weight": torch.randn(v, rank) * 0.3,
                        "markov_head.markov_w2.weight": torch.randn(v, rank) * 0.3,
                        "confidence_head.proj.weight": torch.randn(1, d + rank) * 0.1,
                        "confidence_head.proj.bias": torch.full((1,), 2.0)})
        if head == "gated":
            tensors.update({"markov_head.gate_proj.weight": torch.randn(rank, d + rank) * 0.1,
                            "markov_head.gate_proj.bias": torch.zeros(rank)})
        if head == "rnn":
            tensors.update({"markov_head.joint_proj.weight": torch.randn(3 * rank, 2 * rank + d) * 0.1,
                            "markov_head.joint_proj.bias": torch.zeros(3 * rank)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: x.contiguous() for k, x in tensors.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def drafters(llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafters")
    return {"dflash": write_drafter(root / "dflash", llama_dir),
            "dspark": write_drafter(root / "dspark", llama_dir, "dspark", num_layers=2, block_size=4),
            "dspark_gated": write_drafter(root / "gated", llama_dir, "dspark", head="gated", taps=(1,)),
            "dspark_rnn": write_drafter(root / "rnn", llama_dir, "dspark", head="rnn")}


@pytest.fixture(scope="module")
def ar_greedy(llama_dir) -> list[list[int]]:
    return [o.token_ids for o in LLM(str(llama_dir), **ENGINE).generate(PROMPTS, GREEDY)]


# --- the pure acceptance rule -----------------------------------------------------------------
def test_greedy_accept_stops_at_first_mismatch():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert greedy_accept([4], []) == [4]


@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_rejection_sampling_reproduces_the_target_distribution(one_hot_drafts):
    """Two tokens generated by draft-and-verify from fixed tables P (target) and Q (draft):
    their joint law must be P[0] x P[1], whatever Q is (Leviathan et al. 2023, Theorem 1)."""
    g = torch.Generator().manual_seed(0)
    vocab, trials = 4, 12000
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25],
                      [0.7, 0.1, 0.1, 0.1]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.4, 0.3, 0.2, 0.1], [0.6, 0.2, 0.1, 0.1],
                      [0.25, 0.25, 0.25, 0.25]])
    counts = torch.zeros(vocab, vocab)
    for _ in range(trials):
        out: list[int] = []
        while len(out) < 2:
            pos = len(out)
            qd = q[pos:pos + 2]
            drafts = qd.argmax(-1) if one_hot_drafts else torch.multinomial(qd, 1, generator=g).squeeze(1)
            out += verify_drafts(p[pos:pos + 3], drafts, None if one_hot_drafts else qd, g)
        counts[out[0], out[1]] += 1
    expected = torch.outer(p[0], p[1]) * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7, chi2      # 15 degrees of freedom, p = 0.001


# --- loaders ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dflash", "dspark", "dspark_gated", "dspark_rnn"])
def test_drafter_checkpoints_load(drafters, name):
    model = load_drafter(drafters[name])
    cfg = model.drafter
    assert cfg.kind == name.split("_")[0] and cfg.mask_token_id == 3
    assert cfg.num_draft_tokens == (cfg.block_size if cfg.kind == "dspark" else cfg.block_size - 1)
    from safetensors.torch import load_file
    saved = load_file(str(drafters[name] / "model.safetensors"))
    q = saved["layers.0.self_attn.q_proj.weight"]
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight[:q.shape[0]], q)
    if cfg.kind == "dspark":
        assert torch.equal(model.markov_head.markov_w2.weight, saved["markov_head.markov_w2.weight"])
        assert model.confidence_head.proj.weight.shape == (1, 64 + 8)


def test_drafter_loader_names_the_problem(drafters, tmp_path):
    folder = tmp_path / "extra"
    folder.mkdir()
    cfg = json.loads((drafters["dflash"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file
    tensors = load_file(str(drafters["dflash"] / "model.safetensors"))
    tensors["layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor layers.0.self_attn.bogus"):
        load_drafter(folder)
    del tensors["layers.0.self_attn.bogus.weight"], tensors["fc.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing.*fc.weight"):
        load_drafter(folder)
    del cfg["dflash_config"]["mask_token_id"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_drafter(folder)


@pytest.mark.parametrize("name, patch, message", [
    ("dspark", {"block_size": [9]}, "block_size must be an integer, not \\[9\\]"),
    ("dspark", {"block_size": 0}, "block_size must be at least 1"),
    ("dflash", {"block_size": 1}, "block_size 1 leaves no draft for a dflash drafter"),
    ("dspark", {"dflash_config": {"mask_token_id": 3, "target_layer_ids": "0,2"}},
     "target_layer_ids must be a non-empty list"),
    ("dspark", {"dflash_config": {"mask_token_id": 10**6}}, "mask_token_id 1000000 is outside the vocabulary"),
    ("dspark", {"draft_from_anchor": "false"}, "draft_from_anchor must be true or false, not 'false'"),
    ("dspark", {"enable_confidence_head": 1}, "enable_confidence_head must be true or false"),
    ("dspark", {"confidence_temperatures": "hot"}, "confidence_temperatures must be a list of positive numbers"),
    ("dspark", {"confidence_temperatures": [1.0, 0.0]}, "confidence_temperatures must be a list of positive"),
    ("dspark", {"markov_rank": 2.5}, "markov_rank must be an integer"),
])
def test_a_drafter_config_with_a_wrong_value_is_refused_naming_the_file_and_key(drafters, tmp_path, name, patch,
                                                                                 message):
    """Each of these once loaded (or failed with a bare TypeError) and then broke a request while
    drafting: the string "false" read as true, a mask id outside the embedding, a temperature of 0."""
    import shutil
    folder = tmp_path / "drafter"
    shutil.copytree(drafters[name], folder)
    (folder / "SHA256SUMS").unlink(missing_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(patch)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"{folder / 'config.json'}: {message}"):
        load_drafter(folder)
    cfg = {k: v for k, v in cfg.items() if k not in patch}       # and the same folder, mended, loads
    cfg.update({k: v for k, v in json.loads((drafters[name] / "config.json").read_text()).items() if k in patch})
    (folder / "config.json").write_text(json.dumps(cfg))
    load_drafter(folder)


def assert_greedy_match(model, outs, want: list[list[int]], tie: float = 1e-3) -> None:
    """Token-for-token equality with ar greedy. Different kernels (a k+1-token verify vs a
    1-token decode) may round differently, so a divergence is accepted only where the target's
    top two logits are within `tie` of each other (then both continuations are greedy)."""
    for out, ref in zip(outs, want):
        got = out.token_ids
        i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if i is None:
            assert len(got) == len(ref)
            continue
        logits = model.forward_dense(torch.tensor([out.prompt_token_ids + ref[:i]]))[0, -1]
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < tie, f"diverged at output token {i}: {got} != {ref}"


# --- the engine -----------------------------------------------------------------------------
def _llm(llama_dir: Path, method: str, draft: Path, **options) -> LLM:
    return LLM(str(llama_dir), method=method, draft_model=str(draft), **ENGINE, **options)


@pytest.mark.parametrize("method,drafter,options", [
    ("dflash", "dflash", {}),
    ("dspark", "dspark", {}),
    ("dspark", "dspark_gated", {"verify": "threshold", "threshold": 0.6}),
    ("dspark", "dspark_rnn", {"num_speculative_tokens": 2}),
])
def test_greedy_speculative_equals_ar(llama_dir, drafters, ar_greedy, method, drafter, options):
    llm = _llm(llama_dir, method, drafters[drafter], **options)
    outs = llm.generate(PROMPTS, GREEDY)
    assert_greedy_match(llm.engine.model, outs, ar_greedy)
    stats = llm.engine.method.stats()
    assert stats["num_verify_steps"] > 0 and stats["num_drafted_tokens"] > 0
    assert all(o.metrics.acceptance_length is not None and o.metrics.acceptance_length >= 1 for o in outs)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_seeded_sampling_runs_and_frees_every_block(llama_dir, drafters):
    # The second run hits the prefix cache: the drafter must get the same context back (from
    # its ContextCache), else its drafts and hence the seeded draws would differ.
    llm = _llm(llama_dir, "dspark", drafters["dspark"], draft_sampling="sample")
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]   # per-request generators
    assert sum(o.metrics.num_cached_prompt_tokens for o in again) > 0
    assert all(len(o.token_ids) == 12 for o in first)
    assert llm.engine.block_manager.num_used_blocks == 0


class OracleMethod(SpeculativeMethod):
    """A drafter identical to the target: greedy requests get its argmax continuation, sampled
    ones a draw from its own (filtered, tempered) distribution, with that distribution as q."""
    name = "oracle"

    def propose(self, anchors):
        return [self._one(a) for a in anchors]

    def _one(self, a):
        ids, probs = a.seq.token_ids + a.new_token_ids, []
        for _ in range(self.num_speculative_tokens):
            logits = self.ctx.model.forward_dense(torch.tensor([ids]))[0, -1:]
            if a.seq.params.greedy:
                ids.append(int(logits.argmax()))
                continue
            probs.append(self.sampler.probs(logits, [a.seq])[0])
            ids.append(int(torch.multinomial(probs[-1], 1, generator=a.seq.generator)))
        drafts = ids[len(ids) - self.num_speculative_tokens:]
        return Proposal(a.pos, drafts, torch.stack(probs) if probs else None)


def test_drafter_identical_to_target_is_fully_accepted(llama_dir, ar_greedy, monkeypatch):
    import leapfrog.engine.llm_engine
    monkeypatch.setattr(leapfrog.engine.llm_engine, "method_class", lambda name: OracleMethod)
    llm = LLM(str(llama_dir), method="oracle", num_speculative_tokens=4, **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY)
    assert_greedy_match(llm.engine.model, outs, ar_greedy)
    # 16 tokens = 1 from the prefill + 3 verify steps of 4 drafts + 1 bonus each.
    assert [(o.metrics.acceptance_length, o.metrics.num_forwards) for o in outs] == [(5.0, 4)] * len(PROMPTS)
    stats = llm.engine.method.stats()
    assert stats["num_accepted_tokens"] == stats["num_drafted_tokens"] == 4 * 3 * len(PROMPTS)
    assert all(stats[f"acceptance_rate_pos{j}"] == 1.0 for j in range(1, 5))
    assert llm.engine.block_manager.num_used_blocks == 0


def test_missing_drafter_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match="no drafter"):
        LLM(str(llama_dir), method="dflash")


@pytest.mark.parametrize("options,name", [
    (dict(num_speculative_tokens="x"), "num_speculative_tokens='x'"),
    (dict(num_speculative_tokens=2.5), "num_speculative_tokens=2.5"),
    (dict(num_speculative_tokens=True), "num_speculative_tokens=True"),
    (dict(verify="threshold", threshold="abc"), "threshold='abc'"),
    (dict(verify="threshold", threshold=2.0), "threshold=2.0"),
    (dict(verify="threshold", threshold=float("nan")), "threshold=nan"),
])
@pytest.mark.parametrize("method", ["dspark", "draft", "ngram"])
def test_bad_speculative_options_are_refused_by_name(llama_dir, drafters, method, options, name):
    """A value the option cannot mean (a fraction of a token, a threshold no confidence reaches)
    is a ValueError naming it, not a silent truncation or a method that never drafts."""
    draft = {"dspark": dict(draft_model=str(drafters["dspark"])), "draft": dict(draft_model=str(llama_dir)),
             "ngram": {}}[method]
    with pytest.raises(ValueError, match=re.escape(name)):
        LLM(str(llama_dir), method=method, **draft, **options, **ENGINE)


@pytest.mark.parametrize("method", ["dspark", "draft", "ngram"])
def test_a_step_budget_under_one_verify_step_is_refused(llama_dir, drafters, method):
    """max_num_batched_tokens below the last token and its drafts: the step could never be
    scheduled, and a request waited for it forever (dflash, dspark, draft)."""
    draft = {"dspark": dict(draft_model=str(drafters["dspark"])), "draft": dict(draft_model=str(llama_dir)),
             "ngram": {}}[method]
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=3: method '\w+' feeds 4 query tokens"):
        LLM(str(llama_dir), method=method, **draft, num_speculative_tokens=3, block_size=4,
            max_num_batched_tokens=3)


# --- confidence-scheduled verification (Algorithm 1) ----------------------------------------
def test_prefix_scheduler_verifies_more_when_idle_and_less_under_load():
    from leapfrog.methods.confidence_schedule import StepCostTable, schedule_prefix, survival
    surv = [survival([0.9, 0.8, 0.5, 0.2]), survival([0.6, 0.5, 0.9, 0.9])]
    flat = StepCostTable([1, 64], [0.01, 0.01])            # forwards cost the same at any size
    assert schedule_prefix(surv, flat.sps) == [4, 4]
    steep = StepCostTable([1, 2, 64], [0.01, 0.01, 0.64])   # each token past 2 costs 1x a step
    lengths = schedule_prefix(surv, steep.sps)
    assert lengths == [0, 0]
    mid = StepCostTable([1, 64], [0.01, 0.01 + 63 * 0.002])
    lengths = schedule_prefix(surv, mid.sps)
    assert 0 < sum(lengths) < 8 and lengths[0] >= lengths[1]
    # SPS(1,2,3) = (1.0, 0.5, 0.45), a1 = 0.8: verifying the first draft lowers Θ -> stop.
    table = StepCostTable([1, 2, 3], [1.0, 2.0, 1 / 0.45])
    assert schedule_prefix([[0.8, 0.4]], table.sps) == [0]
    assert table.cost(5) > table.cost(3) and table.cost(1) == 1.0


def test_measured_cost_prices_steps_and_drafting_from_what_was_measured():
    """Confidence scheduling's cost model: widths the engine ran at are priced from their own
    measured steps, others from the profile scaled by the measured/profiled ratio; idle gaps
    are not samples; drafting is fitted as a + b * requests. A profile that prices verification
    too high no longer stops drafting once the measured steps show it is cheap."""
    from leapfrog.methods.confidence_schedule import LinearFit, MeasuredCost, StepCostTable, schedule_prefix, survival
    steep = StepCostTable([1, 64], [0.001, 0.064])     # each verified token costs a decode step
    fit = MeasuredCost(steep)
    assert fit.cost(9) == steep.cost(9)                 # nothing measured: the profile
    for i in range(30):
        b = (1, 2, 4)[i % 3]
        assert fit.observe(b, 0.003 + 0.0001 * b)       # measured: a step costs ~3 ms at any width
    assert [fit.cost(b) for b in (1, 2, 4)] == pytest.approx([0.0031, 0.0032, 0.0034])
    assert fit.cost(3) == pytest.approx(0.0033)                               # interpolated
    assert 1.0 < fit.scale < 3.1                                              # extrapolated:
    assert fit.cost(30) == pytest.approx(0.0034 + fit.scale * (steep.cost(30) - steep.cost(4)))
    assert not fit.observe(1, 100 * fit.cost(1)) and fit.num_samples == 30     # an idle gap
    surv = [survival([0.9, 0.8, 0.7])]
    assert schedule_prefix(surv, steep.sps) == [0]
    assert schedule_prefix(surv, lambda b: 1 / fit.cost(b)) == [3]
    assert MeasuredCost(steep, scale=2.0).cost(9) == pytest.approx(2 * steep.cost(9))
    draft = LinearFit()
    for _ in range(5):
        draft.add(1.0, 0.002)
    assert draft.slope == 0.0 and draft(8) == pytest.approx(0.002)         # one width: the mean
    for i in range(60):
        r = (1, 8, 32)[i % 3]
        draft.add(float(r), 0.002 + 0.0007 * r)
    assert draft.slope == pytest.approx(0.0007, rel=1e-2) and draft(16) == pytest.approx(0.0132, rel=1e-2)
    # Per drafted token (an AR draft model): one width is proportional, not a constant; once the
    # widths spread, the ordinary fit.
    per_token = LinearFit(through_origin=True)
    for _ in range(3):
        per_token.add(8.0, 0.016)
    assert per_token.intercept == 0.0 and per_token(1) == pytest.approx(0.002) and per_token(8) == pytest.approx(0.016)
    for i in range(60):
        n = (1, 4, 8)[i % 3]
        per_token.add(float(n), 0.001 + 0.0015 * n)
    assert per_token.slope == pytest.approx(0.0015, rel=5e-2) and 0.0005 < per_token.intercept < 0.0015


def test_confidence_scheduling_fits_its_cost_model_while_decoding(llama_dir, drafters, ar_greedy):
    # Priced near what this tiny model's steps really take (~0.3-3 ms): a step measured outside
    # 1/10..10x its prediction is not a sample, and at 10 ms a fast run had none.
    costs = {1: 0.001, 8: 0.0012, 64: 0.005}
    llm = _llm(llama_dir, "dspark", drafters["dspark"], verify="confidence", step_costs=costs)
    assert_greedy_match(llm.engine.model, llm.generate(PROMPTS, GREEDY), ar_greedy)
    policy = llm.engine.method.policy
    fit = policy.measured
    assert fit is not None and fit.table is policy.step_costs and policy.step_costs.num_tokens == [1, 8, 64]
    steps = sum(len(r) for r in ar_greedy)
    assert 0 < fit.num_samples <= steps and policy.stats()["num_step_samples"] == fit.num_samples


def test_confidence_scheduled_dspark_equals_ar(llama_dir, drafters, ar_greedy):
    costs = {1: 0.01, 8: 0.012, 64: 0.05}
    llm = _llm(llama_dir, "dspark", drafters["dspark"], verify="confidence", step_costs=costs)
    assert_greedy_match(llm.engine.model, llm.generate(PROMPTS, GREEDY), ar_greedy)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("costs,drafts", [
    ({1: 0.001, 64: 64.0}, False),           # a verified draft costs about a whole decode step: never worth it
    ({1: 0.01, 64: 0.0100001}, True),          # verification is free: always worth drafting
])
def test_confidence_scheduling_decides_before_drafting(llama_dir, drafters, ar_greedy, costs, drafts,
                                                      fake_clock):
    """Drafting costs time whether or not its tokens are verified: when the predicted schedule
    (drafting time included) cannot beat a plain decode step, the step does not draft at all,
    apart from a re-probe every reprobe_steps steps. The output stays ar's either way.

    The policy's clock is a fake one that moves 1 µs per reading, so the decision rests on the
    given costs alone: every measured step is far from the table's prediction (not a sample)
    and drafting measures as ~free. With the real clock, the costs this machine measures replace
    the table's (as they should in use) and the outcome would depend on the machine's load."""
    llm = _llm(llama_dir, "dspark", drafters["dspark"], verify="confidence", step_costs=costs)
    method = llm.engine.method
    assert_greedy_match(llm.engine.model, llm.generate(PROMPTS, GREEDY), ar_greedy)
    stats = method.stats()
    if drafts:
        assert stats["num_skipped_drafts"] == 0 and stats["num_verify_steps"] > 0
    else:
        steps = sum(len(r) for r in ar_greedy)       # about one decode step per token
        assert stats["num_skipped_drafts"] > 0.7 * steps
        assert method.policy.stats()["num_drafts"] <= 2 + steps / method.policy.reprobe_steps
    assert llm.engine.block_manager.num_used_blocks == 0


def test_requests_finishing_one_by_one_do_not_restart_the_reprobe_wait(llama_dir, drafters, fake_clock):
    """Under load (drafting never worth it) each finish changes the batch size: the step
    re-plans, but the doubling re-probe wait goes on, so finishes 20 steps apart cost no extra
    probe (with a reset on every change: 7 drafts)."""
    llm = LLM(str(llama_dir), method="dspark", draft_model=str(drafters["dspark"]), block_size=4,
              verify="confidence", step_costs={1: 0.001, 64: 64.0})
    params = [SamplingParams(max_tokens=20 * (i + 1), temperature=0, ignore_eos=True) for i in range(6)]
    outs = llm.generate(["Once upon a time"] * 6, params)
    assert [len(o.token_ids) for o in outs] == [20, 40, 60, 80, 100, 120]
    method = llm.engine.method
    # Two steps before drafting is measured (the first draft pays one-off costs and is not
    # counted), then probes after 16, 32 and 64 skipped steps.
    assert method.policy.stats()["num_drafts"] <= 5
    assert llm.engine.block_manager.num_used_blocks == 0


def test_dormant_decisions_follow_the_batch_as_requests_finish(llama_dir, drafters, fake_clock):
    """Where drafting could not pay at all, the decode loop captures nothing for the drafter,
    and each request that finishes shrinks the batch. The decision for the smaller batch is
    made without a plain Python step first: once warmed up, the scheduled engine runs exactly
    the layer-by-layer forwards `ar` does (the prompt's), everything else in the decode loop
    (a Python step per finish had cost `stories` 4-9% against `ar`)."""
    counts = []
    params = [SamplingParams(max_tokens=12 + 7 * i, temperature=0, ignore_eos=True) for i in range(4)]
    outs = []
    for llm in (LLM(str(llama_dir), block_size=4),
                LLM(str(llama_dir), method="dspark", draft_model=str(drafters["dspark"]), block_size=4,
                    verify="confidence", step_costs={1: 0.001, 64: 64.0})):
        llm.generate(["Once upon a time"] * 4, params)      # warm-up: the first drafts measure drafting
        calls, drafts = [], llm.engine.method.stats().get("num_drafted_tokens")
        run = llm.engine.runner.run
        llm.engine.runner.run = lambda batch, _run=run: calls.append(len(batch.seqs)) or _run(batch)
        outs.append([o.token_ids for o in llm.generate(PROMPTS, params)])
        counts.append(calls)
    assert outs[0] == outs[1]
    assert counts[1] == counts[0] and len(counts[0]) <= 2      # the prompts' steps only
    assert llm.engine.method.stats()["num_drafted_tokens"] == drafts   # and no probe

def test_first_reprobe_wait_scales_with_the_batch_below_eight_requests(llama_dir, drafters):
    """After drafting paid, the wait before the first re-probe is reprobe_steps from 8 requests
    on and proportionally shorter below (2 steps at one request), never under 1."""
    policy = _llm(llama_dir, "dspark", drafters["dspark"], verify="confidence").engine.method.policy
    assert isinstance(policy, ConfidencePolicy)
    assert [policy.first_wait(b) for b in (1, 2, 4, 7, 8, 32)] == [2, 4, 8, 14, 16, 16]
    policy.reprobe_steps = 4
    assert [policy.first_wait(b) for b in (1, 2, 8)] == [1, 1, 4]


def _priced(step_ms: tuple[float, float], draft_ms: float) -> ConfidencePolicy:
    """Confidence scheduling with fixed costs: a step at B tokens costs a + b * B ms, drafting
    draft_ms, every draft survives with 0.9 per position (no measurement moves them)."""
    from leapfrog.methods.confidence_schedule import LinearFit, StepCostTable
    a, b = step_ms
    policy = ConfidencePolicy(StepCostTable([1, 64], [(a + b) * 1e-3, (a + 64 * b) * 1e-3]))
    policy.cost_model().draft = LinearFit(intercept=draft_ms * 1e-3)
    policy.cost_model().draft.num_samples = 1
    policy.prior = [0.9 ** j for j in range(1, 9)]
    return policy


def _records(n: int) -> list[VerifyRecord]:
    return [VerifyRecord() for _ in range(n)]


def test_plain_steps_are_priced_apart_from_verify_steps(monkeypatch):
    """A step that drafts nothing runs in the decode loop, several times cheaper than a verify
    step of the same width on the layer-by-layer path; priced from the same samples, drafting
    looked worth it on `stories` and ran at 0.33x ar. Plain samples move only the plain price,
    verify samples only the verify price, and steps no decision chose are no samples."""
    import types

    import leapfrog.methods.verify as verify_mod
    clock = [0.0]                               # the policy's clock, moved by hand
    monkeypatch.setattr(verify_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    policy = _priced((1.0, 0.5), 2.0)          # verify at B tokens: 1 + 0.5 B ms; drafting 2 ms
    one = _records(1)
    m = policy.cost_model()
    assert policy.should_draft(one)            # plain priced by the profile: 1.5 ms, drafting pays
    for _ in range(5):                          # layer-by-layer steps at width 1: verify samples
        m.observe(1, 1.5e-3)
    assert m.plain_cost(1) == pytest.approx(1.5e-3) and policy.should_draft(one)
    for _ in range(3):                          # the decode loop's steps
        assert m.observe_plain(1, 0.4e-3)
    assert m.plain_cost(1) == pytest.approx(0.4e-3) and m.cost(1) == pytest.approx(1.5e-3)
    assert not policy.should_draft(one)        # 1 token per 0.4 ms beats 6 per 7.5 ms
    # A step is sampled as what the last decision made it; prompt chunks and undecided steps not.
    verify, plain = m.num_samples, m.num_plain_samples
    policy.next_step()                          # the step's clock starts
    clock[0] += 0.0004
    policy.observe_step(1)                      # the step after a decision not to draft
    clock[0] += 0.0004
    policy.observe_step(1)                      # no decision before it: a request's last step
    policy._next_kind = "plain"
    clock[0] += 0.0004
    policy.observe_step(13, decode_only=False)  # a prompt chunk
    assert (m.num_samples, m.num_plain_samples) == (verify, plain + 1)


def test_reprobes_keep_to_the_probe_budget():
    """Drafting does not pay on the predictions here (drafts survive with 0.05 per position),
    though drafts that all survived would; a probe that cost 100 ms may come only once 100 ms /
    3% of wall time has passed since the last one. Before that the policy skips on, and says
    how many steps may run in the decode loop meanwhile."""
    import time as _time
    policy = _priced((1.0, 0.5), 2.0)
    policy.prior = [0.05 ** j for j in range(1, 9)]
    big = _records(8)
    m = policy.cost_model()
    for _ in range(3):
        m.observe_plain(8, 7e-3)                  # dearer than a verify step: perfect drafts would pay 1.6x
    assert policy._could_pay(8) and not policy._drafting_pays(big)
    probes = [policy.should_draft(big) for _ in range(17)]
    assert probes == [False] * 16 + [True]        # the first probe: nothing measured about probes yet
    policy._probe_cost, policy._last_probe_end = 0.1, _time.perf_counter()
    policy._probing = False
    for _ in range(40):
        assert not policy.should_draft(big)     # well past the 32-step wait: deferred
    assert policy.steps_without_drafting(8) > 100       # (re-checked at most every 256 steps)
    policy._last_probe_end -= 10.0               # 10 s ago: affordable now
    policy._reprobe_every = policy._skipped_steps
    assert policy.should_draft(big) and policy.probing


def test_no_probes_where_perfect_drafts_would_gain_too_little():
    """A plain step of 5 ms at 8 requests against a verify step of 1 + 0.5 B ms and 2 ms of
    drafting: drafts that were all accepted would give 72 tokens in 39 ms, 1.15x plain steps,
    under probe_gain (1.5x). A probe could find a marginal gain at most, so there is none;
    with a prediction that pays, the policy drafts all the same."""
    policy = _priced((1.0, 0.5), 2.0)
    policy.prior = [0.05 ** j for j in range(1, 9)]
    big = _records(8)
    for _ in range(3):
        policy.cost_model().observe_plain(8, 5e-3)
    assert not any(policy.should_draft(big) for _ in range(600))
    assert policy.dormant(8)
    for r in big:
        r.prediction = [1.0] * 8       # (then the wait is over)
    policy._reprobe_every = policy._skipped_steps
    assert policy.should_draft(big) and not policy.dormant(8)


def test_no_probes_where_not_even_perfect_drafts_would_pay():
    """A plain step of 1 ms at 8 requests (a model in the CPU's caches, in the decode loop)
    against drafting at 2 ms plus a verify step of 1 + 0.5 B ms: 8 tokens a millisecond
    without drafting, at most 64 / 35 with every draft accepted. The policy stops probing
    (a probe could only confirm it), waits the longest, and the decode loop captures nothing
    for the drafter meanwhile; when a plain step costs more, it looks again."""
    policy = _priced((1.0, 0.5), 2.0)
    big = _records(8)
    m = policy.cost_model()
    for _ in range(3):
        m.observe_plain(8, 1e-3)
    assert not policy._could_pay(8)
    assert not any(policy.should_draft(big) for _ in range(600))
    assert policy.dormant(8) and not policy.dormant(1)
    assert policy.reprobe_wait == policy.max_reprobe_steps
    assert policy.steps_without_drafting(8) > 0
    for _ in range(40):
        m.observe_plain(8, 9e-3)                  # the machine got busy: over 1 ms a token
    policy._reprobe_every = policy._skipped_steps  # the wait is over
    assert policy.should_draft(big) and not policy.dormant(8)


def test_drafting_after_a_dormant_spell_waits_for_a_current_context(llama_dir, drafters, fake_clock):
    """While drafting cannot pay at all, the decode loop captures no features for the drafter.
    When it can again (here: the costs change mid-request), a request is drafted for only once
    its context reaches the anchor again (a fresh context from the next captured step), never
    on the stale one; the output stays ar's."""
    llm = _llm(llama_dir, "dspark", drafters["dspark"], verify="confidence", step_costs={1: 0.001, 64: 64.0})
    method = llm.engine.method
    seen = []
    propose = method.propose

    def spy(anchors):
        seen.extend(method.state(a.seq).context.start + method.state(a.seq).context.num_positions == a.pos
                    for a in anchors)
        return propose(anchors)
    method.propose = spy
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    want = LLM(str(llama_dir), **ENGINE).generate([PROMPTS[0]], params)[0].token_ids
    engine = llm.engine
    policy, out = method.policy, []
    skipped_in_loop = policy.skipped_in_loop

    def wake(steps, batch):
        # right after a dormant call of the decode loop, before the next decision: from now on
        # drafting pays, and that decision re-plans
        skipped_in_loop(steps, batch)
        if policy.dormant(1) and engine.decode_loop.num_loop_steps >= 16:
            m = policy.measured
            m.table = type(m.table)([1, 64], [0.01, 0.0100001])
            m.seen, m.plain = {}, {1: (1.0, 99)}
            policy._reprobe_every = policy._skipped_steps = 1
    policy.skipped_in_loop = wake
    engine.add_request(PROMPTS[0], params, request_id="r")
    while engine.has_unfinished():
        out += [o for o in engine.step() if o.finished]
    assert out[0].token_ids == want
    assert engine.decode_loop.num_loop_steps >= 16        # dormant steps ran in the decode loop
    assert seen and all(seen)
    assert method.stats()["num_verify_steps"] > 2                 # it drafted again after waking


def test_a_batch_size_seen_before_gets_its_own_reprobe_wait_back(llama_dir, drafters):
    """At 8 requests drafting never pays (probes back off to long waits); at 1 it pays (the wait
    restarts short). Back at 8, the step takes the long wait it had there, instead of probing
    whole batches again after 2, 4, 8, ... steps (what a burst after a quiet tail cost: 4-5
    probes per burst of 128 steps, each ~3 decode steps of drafting at 8 requests)."""
    policy = _priced((1.0, 0.5), 2.0)
    policy.probe_gain = policy.min_gain      # probes wherever perfect drafts would pay at all (1.15x here)
    big, one = _records(8), _records(1)
    probes = [policy.should_draft(big) for _ in range(16 + 1 + 32 + 1)]
    assert sum(probes) == 2 and policy.reprobe_wait == 64            # after 16, then 32 skips
    assert all(policy.should_draft(one) for _ in range(3))          # drafting pays at one request
    assert policy.reprobe_wait == policy.first_wait(1) == 2
    assert not any(policy.should_draft(big) for _ in range(60))     # 64 again, not 2
    assert policy.reprobe_wait == 64


def test_context_cache_projects_queued_rows_only_when_an_entry_is_reused(llama_dir, drafters):
    """A request that finishes while not drafting is cached with its feature rows queued; a
    later prefix hit projects them then, and gets exactly the K/V projecting at once gives."""
    from leapfrog.models.dflash import ContextCache, DraftContext
    drafter = load_drafter(str(drafters["dspark"]), torch.device("cpu"), torch.float32)
    width = drafter.fc.weight.shape[1]
    feats = torch.randn(10, width, generator=torch.Generator().manual_seed(0))
    eager, lazy = DraftContext(0), DraftContext(0)
    drafter.extend_context(eager, feats)
    drafter.queue_context(lazy, feats[:6])
    drafter.queue_context(lazy, feats[6:])
    cache = ContextCache()
    cache.put(list(range(10)), lazy)
    assert lazy.num_keys == 0 and lazy.num_pending == 10        # finishing projected nothing
    assert cache.get(list(range(10)), 7) is None                 # no keys, and nothing to flush with
    got = cache.get(list(range(10)) + [99], 7, drafter.flush_contexts)
    assert got is not None and got.num_keys == 7 and lazy.num_pending == 0
    for k, v, ek, ev in zip(got.keys, got.values, eager.keys, eager.values):
        torch.testing.assert_close(k, ek[:7])
        torch.testing.assert_close(v, ev[:7])
    assert cache.get([5] * 10, 7, drafter.flush_contexts) is None    # another prefix: no hit


def test_cost_profile_times_the_paged_step_and_restores_the_cache(llama_dir, ar_greedy, monkeypatch):
    """Inside an engine the start-up profile runs the engine's own step (timed_step: the runner's,
    or the decode loop's for one row) on scratch caches; the real caches (and what is in them)
    come back untouched."""
    from leapfrog.methods.confidence_schedule import StepCostTable
    llm = LLM(str(llama_dir), **ENGINE)
    model = llm.engine.model
    assert llm.generate(PROMPTS, GREEDY)[0].token_ids == ar_greedy[0]
    before = [(a.k_cache, a.v_cache, a.k_cache.clone()) for a in model.attention_layers]
    timed, caches = [], []

    def step(rows, context):
        timed.append(rows)
        caches.append(model.attention_layers[0].k_cache)
        return llm.engine.timed_step(rows, context)
    table = StepCostTable.profile(model, torch.device("cpu"), max_tokens=16, repeats=1, step=step)
    assert timed == table.num_tokens and table.num_tokens[0] == 1 and min(table.seconds) > 0
    assert all(c is not before[0][0] for c in caches)      # scratch caches while it timed
    assert table.seconds == sorted(table.seconds)          # more tokens never cost less
    for a, (k, v, snapshot) in zip(model.attention_layers, before):
        assert a.k_cache is k and a.v_cache is v and torch.equal(a.k_cache, snapshot)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_greedy
    # Asked for more rows than fit after the context in the model's 256 positions, the profile
    # keeps rows and context inside them (it indexed past the RoPE table before).
    limit = model.config["max_position_embeddings"]
    table = StepCostTable.profile(model, torch.device("cpu"), max_tokens=limit, repeats=1,
                                  step=llm.engine.timed_step)
    assert table.num_tokens[-1] <= limit // 2 and min(table.seconds) > 0


def test_queued_drafter_context_equals_immediate_extension(drafters):
    """Requests that skip drafting only queue their target features; projecting the queue of
    several contexts in one pass gives the K/V that extending each context step by step does."""
    from leapfrog.models.dflash import DraftContext
    model = load_drafter(drafters["dspark"])
    width = len(model.drafter.target_layer_ids) * model.config["hidden_size"]
    g = torch.Generator().manual_seed(0)
    chunks = [[torch.randn(n, width, generator=g) for n in sizes] for sizes in ([3, 1, 1, 2], [5], [1, 1])]
    starts = [0, 4, 9]
    with torch.inference_mode():
        eager, queued = [DraftContext(s) for s in starts], [DraftContext(s) for s in starts]
        for ctx, parts in zip(eager, chunks):
            for f in parts:
                model.extend_context(ctx, f)
        for ctx, parts in zip(queued, chunks):
            for f in parts:
                model.queue_context(ctx, f)
        assert [c.num_positions for c in queued] == [c.num_positions for c in eager] == [7, 5, 2]
        model.flush_contexts(queued)
    for a, b in zip(eager, queued):
        assert b.num_pending == 0 and b.num_keys == a.num_keys
        for ka, kb in zip(a.keys + a.values, b.keys + b.values):
            torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-5)


def test_fused_context_projection_equals_the_layer_by_layer_path(drafters, monkeypatch):
    """flush_contexts' one C++ call (fc, hidden norm, then per draft layer the k/v rows of the
    packed projection, k norm and RoPE) against the torch modules, at positions past 0."""
    from leapfrog.layers.cpu_kernels import cpu_kernels
    from leapfrog.models.dflash import DFlashDraftModel, DraftContext
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler: the kernels are optional")
    model = load_drafter(drafters["dspark"])
    width = len(model.drafter.target_layer_ids) * model.config["hidden_size"]
    feats = [torch.randn(n, width, generator=torch.Generator().manual_seed(n)) for n in (3, 1, 5)]
    calls = []
    real = DFlashDraftModel._fused_context_kv

    def spy(self, *a):
        out = real(self, *a)
        calls.append(out is not None)
        return out

    def project() -> list[DraftContext]:
        """Three chunks into a context from 0, one into a context from 7, flushed as they come."""
        ctxs = [DraftContext(s) for s in (0, 7)]
        with torch.inference_mode():
            for f in feats:
                model.queue_context(ctxs[0], f)
                model.flush_contexts(ctxs[:1])
            model.queue_context(ctxs[1], feats[2])
            model.flush_contexts(ctxs[1:])
        return ctxs
    monkeypatch.setattr(DFlashDraftModel, "_fused_context_kv", spy)
    fused = project()
    assert calls == [True] * 4
    monkeypatch.setattr(DFlashDraftModel, "_fused_context_kv", lambda self, *a: None)
    plain = project()
    for a, b in zip(plain, fused):
        assert a.num_keys == b.num_keys
        for ka, kb in zip(a.keys + a.values, b.keys + b.values):
            torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-5)


def test_preemption_restarts_the_drafter_context(llama_dir, drafters, ar_greedy):
    llm = _llm(llama_dir, "dflash", drafters["dflash"], kv_cache_tokens=44)
    assert_greedy_match(llm.engine.model, llm.generate(PROMPTS, GREEDY), ar_greedy)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_used_blocks == 0


# --- the drafter backbone against a from-the-formulas reference -------------------------------
def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = torch.outer(pos.float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1) * sin


def reference_block(w: dict, cfg: dict, feats, embeds, anchor_pos: int):
    """DSpark Eq. 2-3 / z-lab DFlash written out: fused context keys in every layer, full
    (non-causal) attention over [context; block]."""
    heads, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    hc = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    cpos, bpos = torch.arange(feats.shape[0]), anchor_pos + torch.arange(embeds.shape[0])
    x = embeds
    for i in range(cfg["num_hidden_layers"]):
        g = lambda n: w[f"layers.{i}.{n}.weight"]
        h = _rms(x, g("input_layernorm"))
        q = _rope(_rms((h @ g("self_attn.q_proj").T).view(-1, heads, hd), g("self_attn.q_norm")), bpos)
        kv = lambda src, pos: (_rope(_rms((src @ g("self_attn.k_proj").T).view(-1, kvh, hd),
                                          g("self_attn.k_norm")), pos),
                               (src @ g("self_attn.v_proj").T).view(-1, kvh, hd))
        (kc, vc), (kb, vb) = kv(hc, cpos), kv(h, bpos)
        k = torch.cat([kc, kb]).repeat_interleave(heads // kvh, 1)
        v = torch.cat([vc, vb]).repeat_interleave(heads // kvh, 1)
        att = torch.einsum("qhd,khd->hqk", q, k).div(hd ** 0.5).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(x.shape[0], -1) @ g("self_attn.o_proj").T
        h = _rms(x, g("post_attention_layernorm"))
        x = x + (torch.nn.functional.silu(h @ g("mlp.gate_proj").T) * (h @ g("mlp.up_proj").T)) @ g("mlp.down_proj").T
    return _rms(x, w["norm.weight"])


def test_drafter_forward_matches_the_formulas(drafters):
    from safetensors.torch import load_file
    from leapfrog.models.dflash import DraftContext
    folder = drafters["dspark"]                              # 2 layers, 2 taps
    w, cfg = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    model = load_drafter(folder)
    torch.manual_seed(0)
    feats = [torch.randn(n, 2 * 64) for n in (7, 3)]
    embeds = torch.randn(2, 4, 64)
    contexts = [DraftContext(0), DraftContext(0)]
    with torch.no_grad():
        model.extend_context(contexts[0], feats[0][:4])      # incremental == one shot
        model.extend_context(contexts[0], feats[0][4:])
        model.extend_context(contexts[1], feats[1])
        got = model.forward(embeds, torch.tensor([7, 3]), contexts)   # padded batch of two
        # One sequence alone takes the unpadded path (on a CPU: each layer one C++ call).
        alone = [model.forward(embeds[i:i + 1], torch.tensor([(7, 3)[i]]), contexts[i:i + 1])[0] for i in range(2)]
    for i in range(2):
        want = reference_block(w, cfg, feats[i], embeds[i], anchor_pos=feats[i].shape[0])
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(alone[i], want, atol=1e-4, rtol=1e-4)


def test_fallback_to_ar_when_the_drafter_is_missing_or_useless(llama_dir, drafters, ar_greedy):
    with pytest.warns(UserWarning, match="no drafter"):
        llm = LLM(str(llama_dir), method="dflash", fallback="ar", **ENGINE)
    assert_greedy_match(llm.engine.model, llm.generate(PROMPTS, GREEDY), ar_greedy)
    llm = _llm(llama_dir, "dflash", drafters["dflash"], fallback="ar")   # random: τ ~ 1
    outs = llm.generate(PROMPTS, GREEDY)
    assert_greedy_match(llm.engine.model, outs, ar_greedy)
    assert llm.engine.method.stats()["num_fallbacks"] >= 1


def test_a_model_folder_with_a_drafter_defaults_to_its_method(llama_dir, drafters, tmp_path, ar_greedy):
    import shutil
    from leapfrog.methods import default_method
    folder = tmp_path / "with_drafter"
    shutil.copytree(llama_dir, folder)
    assert default_method(str(folder)) == "ar"
    shutil.copytree(drafters["dspark"], folder / "drafter")
    assert default_method(str(folder)) == "dspark"
    llm = LLM(str(folder), method="dspark", **ENGINE)      # finds drafter/ with no draft_model
    assert_greedy_match(llm.engine.model, llm.generate(PROMPTS, GREEDY), ar_greedy)


def test_sampled_drafts_from_the_target_itself_are_all_accepted(llama_dir, monkeypatch):
    """q == p: min(1, p/q) = 1, so every draft survives; checks that q is paired with the right
    draft and target rows in the engine (the rule itself is tested above)."""
    import leapfrog.engine.llm_engine
    monkeypatch.setattr(leapfrog.engine.llm_engine, "method_class", lambda name: OracleMethod)
    llm = LLM(str(llama_dir), method="oracle", num_speculative_tokens=3, **ENGINE)
    params = SamplingParams(max_tokens=13, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert [(o.metrics.acceptance_length, len(o.token_ids)) for o in outs] == [(4.0, 13)] * len(PROMPTS)


def test_drafter_context_tracks_the_target_kv_after_every_rollback(llama_dir, drafters):
    """The drafter caches K/V only for kept positions: after each step its context ends exactly
    where the target's KV does (nothing of a rejected draft survives in either cache)."""
    llm = _llm(llama_dir, "dspark", drafters["dspark_rnn"])
    engine = llm.engine
    for p in PROMPTS:
        engine.add_request(p, GREEDY)
    num_checked = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            ctx = seq.method_state.context if seq.method_state is not None else None
            if ctx is not None:
                assert ctx.start + ctx.num_positions == seq.num_computed
                num_checked += 1
    assert num_checked > 10 and engine.method.stats()["num_verify_steps"] > 0
    assert engine.block_manager.num_used_blocks == 0


def test_greedy_and_sampled_requests_share_a_batch(llama_dir, drafters, ar_greedy):
    llm = _llm(llama_dir, "dspark", drafters["dspark"], draft_sampling="sample")
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True, logprobs=1)
    params = [GREEDY, sampled, GREEDY, sampled]
    outs = llm.generate(PROMPTS, params)
    assert_greedy_match(llm.engine.model, outs[0::2], ar_greedy[0::2])
    assert all(len(o.logprobs) == 16 and o.logprobs[0]["token_id"] == o.token_ids[0] for o in outs[1::2])
    assert llm.engine.block_manager.num_used_blocks == 0


def test_leapfrog_json_names_a_drafter_per_method_and_parallel_fallback(llama_dir, drafters, tmp_path, ar_greedy):
    import shutil
    folder = tmp_path / "with_drafters"
    shutil.copytree(llama_dir, folder)
    shutil.copytree(drafters["dflash"], folder / "drafters" / "flash")
    shutil.copytree(drafters["dspark"], folder / "drafters" / "spark")
    (folder / "leapfrog.json").write_text(json.dumps(
        {"default_method": "dspark", "drafters": {"dspark": "drafters/spark", "dflash": "drafters/flash"}}))
    from leapfrog.methods import default_method
    assert default_method(str(folder)) == "dspark"
    for method, layers in (("dspark", 2), ("dflash", 1)):
        llm = LLM(str(folder), method=method, **ENGINE)
        assert llm.engine.method.drafter.config["num_hidden_layers"] == layers
    # A variant name under drafters/ works as draft_model.
    assert LLM(str(folder), method="dflash", draft_model="flash", **ENGINE).engine.method.drafter is not None
    # The DSpark drafter goes missing: "parallel" drafts with the DFlash one, "none" refuses.
    shutil.rmtree(folder / "drafters" / "spark")
    with pytest.raises(ValueError, match="leapfrog.json: drafter 'drafters/spark'"):
        LLM(str(folder), method="dspark", **ENGINE)
    with pytest.warns(UserWarning, match="parallel"):
        llm = LLM(str(folder), method="dspark", fallback="parallel", **ENGINE)
    assert llm.engine.method.drafter.drafter.kind == "dflash"
    assert_greedy_match(llm.engine.model, llm.generate(PROMPTS, GREEDY), ar_greedy)


def test_acceptance_feedback_corrects_survival_rows_by_what_verification_showed():
    """A request whose drafts are all accepted, against a survival row that predicted few,
    gets its row raised (and so more drafts verified); one whose drafts are all rejected gets
    it lowered. Rows stay non-increasing and <= 1; positions never verified take the deepest
    verified position's ratio; with nothing observed the row is unchanged."""
    from leapfrog.methods.confidence_schedule import AcceptanceFeedback, schedule_prefix

    raw = [0.6, 0.3, 0.15, 0.07, 0.03]
    assert AcceptanceFeedback().correct(raw) == raw
    good, bad = AcceptanceFeedback(), AcceptanceFeedback()
    for _ in range(20):
        good.observe(raw, 2, 2)          # two drafts verified, both accepted
        bad.observe(raw, 2, 0)           # two verified, none accepted
    up, down = good.correct(raw), bad.correct(raw)
    assert all(u >= r for u, r in zip(up, raw)) and up[0] > 0.85 and up[1] > 0.6
    assert all(d <= r for d, r in zip(down, raw)) and down[0] < 0.25
    for row in (up, down):
        assert all(0 <= b <= a <= 1 for a, b in zip([1.0] + row, row))
    assert up[3] == pytest.approx(min(up[2], raw[3] * good.ratio(1)))   # position 4 never verified
    cost = lambda b: 1.0 / (0.01 + 0.004 * b)                           # a verify token costs 0.4 steps
    assert schedule_prefix([up], cost)[0] > schedule_prefix([raw], cost)[0] >= schedule_prefix([down], cost)[0]


def test_confidence_scheduling_feeds_verification_back(llama_dir, drafters, ar_greedy, monkeypatch):
    """Inside the engine every verify step of a confidence-scheduled request reports what it
    verified and accepted to that request's feedback; the output stays ar's."""
    from leapfrog.methods.confidence_schedule import AcceptanceFeedback

    seen = []
    observe = AcceptanceFeedback.observe
    monkeypatch.setattr(AcceptanceFeedback, "observe",
                        lambda self, row, n, a: (seen.append((n, a)), observe(self, row, n, a)))
    llm = _llm(llama_dir, "dspark", drafters["dspark"], verify="confidence", step_costs={1: 0.01, 64: 0.0100001})
    assert_greedy_match(llm.engine.model, llm.generate(PROMPTS, GREEDY), ar_greedy)
    stats = llm.engine.method.stats()
    assert len(seen) == stats["num_verify_steps"] > 0
    assert sum(a for _, a in seen) == stats["num_accepted_tokens"]
    assert all(0 <= a <= n for n, a in seen)


@pytest.mark.parametrize("name", ["dspark", "dspark_gated", "dspark_rnn"])
@pytest.mark.parametrize("fused", [False, True])
def test_sequential_head_block_equals_the_position_by_position_formulas(drafters, name, fused):
    """sample_block (logits written in place, confidences computed for the whole block after
    the loop, W2 from its transposed copy; with argmax drafts and the vanilla head, the C++
    stage) against Eq. 4 and Eq. 7 position by position:
    logits_k = U_k + B(x_{k-1}, ...), x_k = argmax, c_k = sigmoid(w [h_k; W1[x_{k-1}]] + b) / t_k."""
    from leapfrog.layers.cpu_kernels import cpu_kernels
    from leapfrog.models.dflash_heads import sample_block
    if fused and cpu_kernels() is None:
        pytest.skip("no C++ compiler: the kernels are optional")

    d = load_drafter(str(drafters[name]))
    d.confidence_head.temperatures = [0.5, 2.0]          # per-position STS temperatures, the rest 1
    markov, conf = d.markov_head, d.confidence_head
    gen = torch.Generator().manual_seed(0)
    vocab, hid = markov.markov_w1.weight.shape[0], conf.proj.in_features - markov.rank
    base, hidden = torch.randn(3, 4, vocab, generator=gen), torch.randn(3, 4, hid, generator=gen)
    anchors = torch.tensor([1, 5, 9])
    with torch.inference_mode():
        if fused:       # argmax drafts: the vanilla head runs as one C++ call, the others stay in torch
            assert (markov.fused_argmax(base.clone(), anchors) is not None) == (markov.kind == "vanilla")
        ids, logits, confs = sample_block(base, hidden, anchors, markov, conf,
                                          None if fused else lambda r: r.argmax(-1))
        prev, state = anchors, None
        for k in range(4):
            e = markov.markov_w1.weight[prev]
            if markov.kind == "vanilla":
                bias = e @ markov.markov_w2.weight.T
            elif markov.kind == "gated":
                g = torch.sigmoid(torch.cat([hidden[:, k], e], -1) @ markov.gate_proj.weight.T + markov.gate_proj.bias)
                bias = (g * e) @ markov.markov_w2.weight.T
            else:
                s = state if state is not None else torch.zeros(3, markov.rank)
                z = torch.cat([s, e, hidden[:, k]], -1) @ markov.joint_proj.weight.T + markov.joint_proj.bias
                gate, cand, out = z.chunk(3, -1)
                state = torch.sigmoid(gate) * s + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
                bias = torch.tanh(out) @ markov.markov_w2.weight.T
            row = base[:, k] + bias
            t = [0.5, 2.0, 1.0, 1.0][k]
            c = torch.sigmoid((torch.cat([hidden[:, k], e], -1) @ conf.proj.weight.T + conf.proj.bias).squeeze(-1) / t)
            torch.testing.assert_close(logits[:, k], row, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(confs[:, k], c, atol=1e-6, rtol=1e-5)
            prev = row.argmax(-1)
            assert torch.equal(ids[:, k], prev)


def test_verify_policies_choose_how_many_drafts_to_verify():
    """fixed: every draft; threshold: the prefix whose survival Π c_i stays >= the threshold
    (all drafts for a drafter without confidences); the option names the policy and a bad
    option or step-cost table is refused."""
    from leapfrog.methods.verify import FixedPolicy, ThresholdPolicy, make_policy
    confs = [[0.9, 0.9, 0.5], None, [0.5]]
    assert FixedPolicy().num_to_verify(_records(3), confs, [3, 3, 1]) == [None] * 3
    assert not FixedPolicy().needs_confidence and ThresholdPolicy(0.7).needs_confidence
    assert ThresholdPolicy(0.7).num_to_verify(_records(3), confs, [3, 3, 1]) == [2, None, 0]
    assert isinstance(make_policy("threshold", "0.5"), ThresholdPolicy)
    assert make_policy("confidence", step_costs={1: 0.01, 8: 0.02}).step_costs.num_tokens == [1, 8]
    with pytest.raises(ValueError, match="verify='bogus'"):
        make_policy("bogus")
    with pytest.raises(ValueError, match="step_costs"):
        make_policy("fixed", step_costs={1: 0.0})


def test_confidence_policy_verifies_by_corrected_survival_and_probes_at_least_one():
    """num_to_verify runs Algorithm 1 on each request's survival row as its feedback corrects
    it, and keeps the smoothed row as the request's prediction; a re-probe verifies at least
    one draft per request even where the schedule would verify none."""
    policy = _priced((1.0, 2.0), 0.1)            # a verified token costs 2x a bare step: verify few
    good, bad = VerifyRecord(), VerifyRecord()
    row = [0.6, 0.5, 0.5]                         # survival 0.6, 0.3, 0.15
    for _ in range(20):
        policy.observe(good, row, 2, 2)           # everything verified was accepted
        policy.observe(bad, row, 2, 0)            # nothing was
    assert policy.num_to_verify([good, bad], [row, row], [3, 3]) == [1, 0]
    assert policy.num_to_verify(_records(2), [row, row], [3, 3]) == [0, 0]     # no feedback yet
    assert good.prediction[0] > 0.85 > 0.2 > bad.prediction[0]
    policy = _priced((1.0, 0.5), 2.0)            # at 8 requests drafting never pays
    policy.probe_gain = policy.min_gain          # (perfect drafts would: 1.15x) and it probes
    big = _records(8)
    decisions = [policy.should_draft(big) for _ in range(17)]
    assert decisions == [False] * 16 + [True] and policy.probing     # the re-probe
    assert policy.num_to_verify(big, [[0.1, 0.1]] * 8, [2] * 8) == [1] * 8
    policy.next_step()
    assert not policy.probing
