"""Block-diffusion decoding (`diffusion`): oracles on tiny random checkpoints.

The oracle is `reference`: a slow sampler that recomputes the whole sequence (committed text +
canvas up to the window end) with `transformers` and a dense block-causal mask at every step,
no KV cache. The engine (paged KV, stored blocks, carried logits, batching, chunked prefill,
prefix cache, preemption) must produce the same tokens in the same number of forwards.
Tiny models get a sharpened LM head, so that confidences cross the threshold and steps really
commit several tokens at once.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import build_model
from leapfrog import LLM, SamplingParams
from leapfrog.models.loader import load_model
from leapfrog.models.diffusion_families import diffusion_spec
from leapfrog.sample.sampler import Sampler
from leapfrog.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")

MASK = 3                      # <mask> in conftest's tokenizer
B1_MASK = 383
PROMPTS = [[1, 5, 9], [1] + list(range(20, 57)), [1, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [1, 300],
           [1] + list(range(100, 119)), [1, 42, 43, 44, 45], [1] + list(range(200, 227)), [1, 4]]
GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
ENGINE = dict(block_size=8, max_num_batched_tokens=512)
SAMPLER = Sampler(torch.device("cpu"))


def diffusion_folder(src: Path, dst: Path, scale: float = 12.0, **config) -> Path:
    """Copy a tiny checkpoint, add diffusion keys to config.json, sharpen the LM head."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(dst / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * scale
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("diffusion")
    llama = build_model(root / "src", "llama")
    qwen3 = build_model(root / "src", "qwen3")
    qwen2 = build_model(root / "src", "qwen2", tie_word_embeddings=False)
    return {
        "plain": diffusion_folder(llama, root / "plain", block_size=4, mask_token_id=MASK),
        "shift": diffusion_folder(llama, root / "shift", block_size=4, mask_token_id=MASK,
                                  diffusion_logit_shift=True),
        # Its mask id is a token ar never picks here: the canvas never proposes the mask itself.
        "b1": diffusion_folder(llama, root / "b1", block_size=1, mask_token_id=B1_MASK, diffusion_logit_shift=True),
        "sdar": diffusion_folder(qwen3, root / "sdar", architectures=["SDARForCausalLM"], model_type="sdar",
                                 block_size=4, mask_token_id=MASK, attn_implementation="flex_attention"),
        "fdv2": diffusion_folder(qwen2, root / "fdv2", architectures=["Fast_dLLM_QwenForCausalLM"],
                                 model_type="Fast_dLLM_Qwen", bd_size=4),
    }


_HF: dict[Path, torch.nn.Module] = {}


def hf(folder: Path) -> torch.nn.Module:
    """The transformers model behind a folder (SDAR / Fast-dLLM v2 are Qwen3 / Qwen2 weights)."""
    if folder not in _HF:
        arch = json.loads((folder / "config.json").read_text())["architectures"][0]
        cls = {"SDARForCausalLM": transformers.Qwen3ForCausalLM,
               "Fast_dLLM_QwenForCausalLM": transformers.Qwen2ForCausalLM}.get(arch, transformers.LlamaForCausalLM)
        _HF[folder] = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    return _HF[folder]


@torch.no_grad()
def reference(model, prompt: list[int], params: SamplingParams, *, block: int, shift: bool,
              threshold: float = 0.9, num_blocks: int = 1, add: float = 0.1, semi: float = 0.9,
              floor: str = "leftmost", eos: tuple[int, ...] = (), later: float | None = None) -> tuple[list[int], int]:
    """Slow sampler, no KV cache: (output ids, forwards). Same commit rule as the method doc."""
    B, P, shift = block, len(prompt), int(shift)
    text, canvas, active, steps = list(prompt), {}, 1, 0
    seq = Sequence("ref", list(prompt), params)
    seq.generator = SAMPLER.make_generator(params.seed) if params.seed is not None else None
    ends = lambda t: t in params.stop_token_ids or (not params.ignore_eos and t in eos)  # noqa: E731
    limit = lambda: min([P + params.max_tokens] + [p + 1 for p, t in canvas.items() if ends(t)])  # noqa: E731
    progress = lambda k, n: sum(p < n or p in canvas for p in range(k * B, (k + 1) * B)) / B  # noqa: E731
    while len(text) < limit() and not (len(text) > P and ends(text[-1])):
        n, front = len(text), len(text) // B
        end = (front + num_blocks) * B
        pos = torch.arange(end)
        ids = torch.tensor([text + [canvas.get(p, MASK) for p in range(n, end)]])
        logits = model(ids, attention_mask=(pos[None] // B <= pos[:, None] // B)[None, None]).logits[0]
        steps += 1
        lim = limit()
        need = [p for p in range(n, min(lim, (front + active) * B)) if p not in canvas]
        x = logits[[p - shift for p in need]]
        x[:, MASK] = float("-inf")
        if params.greedy:
            conf, tok = x.softmax(-1).max(-1)
        else:
            probs = SAMPLER.probs(x, [seq] * len(need))
            tok = SAMPLER.draw(probs, [seq] * len(need))
            conf = probs.gather(-1, tok[:, None])[:, 0]
        cand = dict(zip(need, zip(tok.tolist(), conf.tolist())))
        before = [progress(front + j, n) for j in range(active)]
        for j in range(active):
            masked = [p for p in need if (front + j) * B <= p < (front + j + 1) * B and p < lim]
            bar = threshold if j == 0 or later is None else later
            pick = [p for p in masked if cand[p][1] > bar]
            if masked and not pick and (j == 0 or before[j - 1] >= semi):
                pick = [masked[0] if floor == "leftmost" else max(masked, key=lambda p: cand[p][1])]
            for p in pick:
                canvas[p] = cand[p][0]
                lim = min(lim, p + 1) if ends(canvas[p]) else lim
        while len(text) < lim and len(text) in canvas:
            text.append(canvas.pop(len(text)))
        n2 = len(text)
        active = max(1, front + active - n2 // B)
        while active < num_blocks and (n2 // B + active) * B < lim and progress(n2 // B + active - 1, n2) > add:
            active += 1
    return text[P:], steps


def check_against_reference(llm: LLM, folder: Path, prompts, params, **rule) -> list:
    spec = llm.engine.method
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ids, steps = reference(hf(folder), prompt, params, block=spec.block_size, shift=bool(spec.logit_shift),
                               eos=tuple(spec.eos_token_ids), **rule)
        assert (out.token_ids, out.metrics.num_forwards) == (ids, steps), f"prompt {prompt}"
    assert llm.engine.block_manager.num_used_blocks == 0
    return outs


# --- the oracle ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "shift"])
@pytest.mark.parametrize("threshold", [0.9, 1.0])
@pytest.mark.parametrize("floor", ["leftmost", "confident"])
def test_cached_single_block_equals_full_recompute(models, variant, threshold, floor):
    llm = LLM(str(models[variant]), method="diffusion", threshold=threshold, floor=floor, **ENGINE)
    outs = check_against_reference(llm, models[variant], PROMPTS, GREEDY, threshold=threshold, floor=floor)
    stats = llm.engine.method.stats()
    assert stats["num_stored_blocks"] > 0
    if threshold == 1.0:      # one token per step: as many forwards as tokens
        assert all(o.metrics.num_forwards == len(o.token_ids) == 14 for o in outs)
    else:                     # the threshold really commits several tokens in some steps
        assert stats["decided_tokens_per_step"] > 1.05
        assert sum(o.metrics.num_forwards for o in outs) < 14 * len(outs)


def test_the_floor_decides_which_position_goes_first(models):
    """At threshold 1.0 every step commits one forced position: `leftmost` fills each block left to
    right, `confident` in the model's order, so the texts differ (the reference checks each rule)."""
    folder = str(models["plain"])
    left = LLM(folder, method="diffusion", threshold=1.0, **ENGINE).generate(PROMPTS, GREEDY)
    conf = LLM(folder, method="diffusion", threshold=1.0, floor="confident", **ENGINE).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in left] != [o.token_ids for o in conf]


@pytest.mark.parametrize("variant", ["plain", "shift"])
@pytest.mark.parametrize("floor", ["leftmost", "confident"])
def test_multi_block_equals_its_reference(models, variant, floor):
    rule = dict(num_blocks=3, threshold=0.8, add=0.2, semi=0.5, floor=floor)
    llm = LLM(str(models[variant]), method="diffusion", num_blocks=3, threshold=0.8, add_threshold=0.2,
              semi_threshold=0.5, floor=floor, **ENGINE)
    check_against_reference(llm, models[variant], PROMPTS, GREEDY, **rule)
    assert llm.engine.method.stats()["active_blocks_per_step"] > 1.2


def test_later_blocks_have_their_own_threshold(models):
    """later_threshold is the bar of the blocks behind the first unfinished one; a lower one
    decides more of them early, so the text and the forwards change (checked against the
    reference at both bars)."""
    folder = models["shift"]
    outs = {}
    for later in (0.95, 0.3):
        rule = dict(num_blocks=3, threshold=0.8, add=0.2, later=later)
        llm = LLM(str(folder), method="diffusion", num_blocks=3, threshold=0.8, add_threshold=0.2,
                  later_threshold=later, **ENGINE)
        outs[later] = check_against_reference(llm, folder, PROMPTS, GREEDY, **rule)
    key = lambda o: [(x.token_ids, x.metrics.num_forwards) for x in o]  # noqa: E731
    assert key(outs[0.95]) != key(outs[0.3])


def test_one_block_is_single_block_decoding(models):
    folder = str(models["shift"])
    single = LLM(folder, method="diffusion", **ENGINE).generate(PROMPTS, GREEDY)
    one = LLM(folder, method="diffusion", num_blocks=1, **ENGINE).generate(PROMPTS, GREEDY)
    # A buffer of 2 whose second slot never opens (progress > 1 is impossible): dummy mask slots
    # behind the active block must not change anything (block-causal attention).
    padded = LLM(folder, method="diffusion", num_blocks=2, add_threshold=1.0, **ENGINE).generate(PROMPTS, GREEDY)
    key = lambda outs: [(o.token_ids, o.metrics.num_forwards) for o in outs]  # noqa: E731
    assert key(single) == key(one) == key(padded)


@pytest.mark.parametrize("num_blocks", [1, 3])
def test_block_size_one_with_shift_is_autoregressive(models, num_blocks):
    folder = str(models["b1"])
    ar = LLM(folder, **ENGINE).generate(PROMPTS[:4], GREEDY)
    dif = LLM(folder, method="diffusion", num_blocks=num_blocks, threshold=1.0, **ENGINE).generate(PROMPTS[:4], GREEDY)
    assert all(B1_MASK not in o.token_ids for o in ar)
    assert [o.token_ids for o in dif] == [o.token_ids for o in ar]
    assert all(o.metrics.num_forwards == 14 for o in dif)


def test_seeded_sampling_equals_reference_and_ignores_the_batch(models):
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    folder = models["shift"]
    rule = dict(num_blocks=2, threshold=0.7)
    llm = LLM(str(folder), method="diffusion", num_blocks=2, threshold=0.7, **ENGINE)
    batched = llm.generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, batched):
        ids, steps = reference(hf(folder), prompt, p, block=4, shift=True, **rule)
        assert (out.token_ids, out.metrics.num_forwards) == (ids, steps)
    alone = [llm.generate([q], [p])[0] for q, p in zip(PROMPTS, params)]
    assert [o.token_ids for o in alone] == [o.token_ids for o in batched]


@pytest.mark.parametrize("num_blocks", [1, 2])
def test_batching_chunking_and_prefix_cache_do_not_change_results(models, num_blocks):
    folder = str(models["plain"])
    opts = dict(method="diffusion", num_blocks=num_blocks, threshold=0.8)
    alone = [LLM(folder, max_batch_size=1, enable_prefix_caching=False, **opts, **ENGINE).generate([p], GREEDY)[0]
             for p in PROMPTS]
    # Small token budget: prompts are prefilled in chunks that end on the block grid.
    llm = LLM(folder, max_num_batched_tokens=24, block_size=4, **opts)
    first = llm.generate(PROMPTS, GREEDY)
    second = llm.generate(PROMPTS, GREEDY)                     # prefix-cache hits
    want = [o.token_ids for o in alone]
    assert [o.token_ids for o in first] == want and [o.token_ids for o in second] == want
    assert sum(o.metrics.num_cached_prompt_tokens for o in second) > 0
    assert llm.engine.block_manager.num_used_blocks == 0


def test_kv_blocks_hold_whole_diffusion_blocks(models):
    llm = LLM(str(models["plain"]), method="diffusion", block_size=6)
    assert llm.engine.config.block_size == 12 and llm.engine.block_manager.block_size == 12


# --- end of text, streaming, observability -----------------------------------------------------
def test_end_token_stops_at_its_block(models):
    folder = models["shift"]
    llm = LLM(str(folder), method="diffusion", num_blocks=2, threshold=0.8, **ENGINE)
    free = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, free):
        stop = out.token_ids[len(out.token_ids) // 2]      # a token the model does produce
        params = SamplingParams(max_tokens=14, temperature=0, stop_token_ids=[stop])
        got = llm.generate([prompt], params)[0]
        ids, steps = reference(hf(folder), prompt, params, block=4, shift=True, num_blocks=2, threshold=0.8)
        assert (got.token_ids, got.metrics.num_forwards) == (ids, steps)
        assert got.token_ids[-1] == stop and stop not in got.token_ids[:-1]
        assert got.finish_reason == "stop"


def test_model_eos_ends_the_text_unless_ignored(models, tmp_path):
    src = models["plain"]
    out = LLM(str(src), method="diffusion", **ENGINE).generate(PROMPTS[:1], GREEDY)[0]
    eos = out.token_ids[5]
    folder = tmp_path / "eos"
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    llm = LLM(str(folder), method="diffusion", **ENGINE)
    params = SamplingParams(max_tokens=14, temperature=0)
    got = llm.generate(PROMPTS[:1], params)[0]
    ids, steps = reference(hf(src), PROMPTS[0], params, block=4, shift=False, eos=(eos,))
    assert (got.token_ids, got.metrics.num_forwards) == (ids, steps) and got.token_ids[-1] == eos
    assert len(llm.generate(PROMPTS[:1], GREEDY)[0].token_ids) == 14     # ignore_eos


def test_committed_prefixes_stream_in_order_with_logprobs(models):
    llm = LLM(str(models["shift"]), method="diffusion", num_blocks=2, threshold=0.8, **ENGINE)
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2)
    rid = llm.engine.add_request(PROMPTS[1], params)
    deltas, final = [], None
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            deltas.append(out.delta_token_ids)
            final = out
    assert sum(deltas, []) == final.token_ids and final.request_id == rid
    assert len([d for d in deltas if d]) > 2                  # streamed as it was decided, not at the end
    assert [e["token_id"] for e in final.logprobs] == final.token_ids
    assert all(len(e["top"]) == 2 and e["logprob"] <= 0 for e in final.logprobs)
    m = final.metrics
    assert m.tokens_per_forward == pytest.approx(14 / m.num_forwards) and m.tokens_per_forward > 1
    stats = llm.engine.method.stats()
    assert stats["committed_tokens_per_step"] == pytest.approx(14 / stats["num_denoise_steps"])


# --- resources ----------------------------------------------------------------------------------
def test_no_kv_block_leaks_after_aborts_and_preemption(models):
    folder = str(models["plain"])
    opts = dict(method="diffusion", num_blocks=2, threshold=0.8, block_size=4)
    want = [o.token_ids for o in LLM(folder, **opts).generate(PROMPTS, GREEDY)]
    llm = LLM(folder, kv_cache_tokens=96, **opts)              # too small for all eight at once
    got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == want                  # the canvas survives recompute
    assert llm.engine.scheduler.num_preemptions > 0
    engine = llm.engine
    mixed = [GREEDY, SamplingParams(max_tokens=14, temperature=0.9, seed=1),
             SamplingParams(max_tokens=14, temperature=0, repetition_penalty=1.3, logprobs=0)]
    for round_ in range(3):
        ids = [engine.add_request(p, mixed[i % 3]) for i, p in enumerate(PROMPTS)]
        for _ in range(2 + round_):
            engine.step()
        for rid in ids[::2]:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests


# --- checkpoint layouts and options -------------------------------------------------------------
@pytest.mark.parametrize("variant,shift", [("sdar", False), ("fdv2", True)])
def test_published_layouts_load_and_decode(models, variant, shift):
    folder = models[variant]
    ours = load_model(folder)
    ids = torch.randint(0, 300, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_dense(ids), hf(folder)(ids).logits, atol=1e-4, rtol=0)
    llm = LLM(str(folder), method="diffusion", num_blocks=2, **ENGINE)
    method = llm.engine.method
    assert (method.block_size, method.mask_token_id, bool(method.logit_shift)) == (4, MASK, shift)
    check_against_reference(llm, folder, PROMPTS[:4], GREEDY, num_blocks=2)


class _Tok:
    def __init__(self, mask=None, eos=()):
        self.mask_token_id, self.eos_token_ids = mask, list(eos)


def test_family_defaults():
    fd = diffusion_spec({"architectures": ["Fast_dLLM_QwenForCausalLM"], "vocab_size": 151936}, _Tok(eos=[151643]))
    assert (fd.block_size, fd.mask_token_id, fd.logit_shift, fd.eos_token_ids) == (32, 151665, True, (151643, 151645))
    sdar = diffusion_spec({"architectures": ["SDARForCausalLM"], "vocab_size": 151936, "block_size": 8,
                           "mask_token_id": 151669}, _Tok(mask=5))
    assert (sdar.block_size, sdar.mask_token_id, sdar.logit_shift) == (8, 151669, False)
    assert set(sdar.eos_token_ids) == {151645, 151643}
    llada = diffusion_spec({"architectures": ["LLaDA2MoeModelLM"], "vocab_size": 157184}, _Tok())
    assert (llada.block_size, llada.mask_token_id, llada.eos_token_ids) == (32, 156895, (156892,))
    ours = diffusion_spec({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "block_size": 4,
                           "diffusion_logit_shift": True}, _Tok(mask=7, eos=[2]))
    assert (ours.block_size, ours.mask_token_id, ours.logit_shift, ours.eos_token_ids) == (4, 7, True, (2,))


@pytest.mark.parametrize("options,match", [
    ({"threshold": 0}, "threshold"), ({"threshold": 1.5}, "threshold"), ({"threshold": "high"}, "threshold"),
    ({"num_blocks": 0}, "num_blocks"), ({"num_blocks": 1.5}, "num_blocks"),
    ({"add_threshold": -0.1}, "add_threshold"), ({"semi_threshold": 2}, "semi_threshold"),
    ({"later_threshold": 0}, "later_threshold"),
    ({"floor": "random"}, "floor"),
    ({"steps": 4}, "unknown option"), ({"num_blocks": 4, "max_num_batched_tokens": 8}, "max_num_batched_tokens"),
])
def test_bad_options_are_clear_errors(models, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(models["plain"]), method="diffusion", **options)


def test_models_that_are_not_block_diffusion_are_refused(models, llama_dir, tmp_path):
    with pytest.raises(ValueError, match="block size"):
        LLM(str(llama_dir), method="diffusion")
    folder = tmp_path / "nomask"
    shutil.copytree(models["plain"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["mask_token_id"]
    (folder / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((folder / "tokenizer.json").read_text())       # rename <mask> away
    for entry in tok["added_tokens"]:
        if entry["content"] == "<mask>":
            entry["content"] = "<unused>"
    tok["model"]["vocab"] = {("<unused>" if k == "<mask>" else k): v for k, v in tok["model"]["vocab"].items()}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    del tcfg["mask_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg))
    with pytest.raises(ValueError, match="no mask token"):
        LLM(str(folder), method="diffusion")


def test_prompt_logprobs_are_refused_by_block_diffusion(models):
    # its prompt blocks are read bidirectionally: there is no next-token distribution per prompt token
    for variant in ("shift", "b1"):     # b1: causal blocks of one, yet still no next-token rows
        llm = LLM(str(models[variant]), method="diffusion")
        with pytest.raises(ValueError, match="prompt_logprobs: the diffusion method"):
            llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, prompt_logprobs=1))
        assert not llm.engine.has_unfinished()
