"""Two-stream block diffusion (leapfrog/train/mask_stream.py, leapfrog/models/mask_stream.py):
known tokens run the AR parent causally, mask tokens a mask stream block-wise.

Oracles: threshold 1.0 is exactly the parent's `ar` decoding; the engine (paged KV, stored
blocks, carried logits, batching, multi-block) equals test_diffusion's slow full-recompute
sampler run over the transformers two-stream forward of train.mask_stream; the packed training
rows equal per-sequence forwards under the same rule."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import build_model
from test_diffusion import ENGINE, GREEDY, MASK, PROMPTS, reference

from leapfrog import LLM, SamplingParams
from leapfrog.models.loader import CheckpointError, load_model
from leapfrog.train import mask_stream
from leapfrog.train.diffusion import DiffusionSpec, attention_mask, diffusion_loss, pack, SINGLE, MULTI

pytestmark = pytest.mark.usefixtures("one_thread")


def two_stream_folder(src: Path, dst: Path, noise: float, scale: float = 12.0) -> Path:
    """The tiny Llama with a mask stream: the parent's layers plus seeded noise, the LM head
    sharpened (so confidences cross thresholds), the contract in config.json."""
    from transformers import AutoModelForCausalLM
    from conftest import write_tokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    stream = mask_stream.attach(model, None, MASK)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in stream.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    model.config.update({"block_size": 4, "mask_token_id": MASK, "diffusion_logit_shift": True})
    # `ar` on these random weights would write the mask token, which diffusion never proposes
    model.generation_config.suppress_tokens = [MASK]
    model.save_pretrained(dst)
    write_tokenizer(dst)
    return dst


class TwoStream:
    """test_diffusion.reference's model interface over train.mask_stream's forward (the mask it
    is given is replaced by the two-stream rule)."""

    def __init__(self, folder: Path) -> None:
        self.model = mask_stream.from_folder(folder)

    def __call__(self, ids, attention_mask=None):
        hidden = mask_stream.hidden_states(self.model, ids, torch.arange(ids.shape[1])[None],
                                           mask_stream.block_rule_mask(ids, 4, MASK), MASK)
        return type("Out", (), {"logits": self.model.lm_head(hidden)})


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mask_stream")
    llama = build_model(root / "src", "llama")
    return {"src": llama, "stream": two_stream_folder(llama, root / "stream", noise=0.05),
            "copy": two_stream_folder(llama, root / "copy", noise=0.0)}


def test_threshold_one_decodes_exactly_the_parent(folders):
    folder = str(folders["stream"])
    ar = LLM(folder, **ENGINE).generate(PROMPTS, GREEDY)
    for blocks in (1, 3):
        dif = LLM(folder, method="diffusion", threshold=1.0, num_blocks=blocks, **ENGINE).generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in dif] == [o.token_ids for o in ar]


@pytest.mark.parametrize("rule", [dict(threshold=0.9), dict(threshold=0.6),
                                  dict(num_blocks=3, threshold=0.8, add=0.2, semi=0.5)])
@pytest.mark.parametrize("kernel", [True, False])
def test_engine_equals_two_stream_full_recompute(folders, rule, kernel):
    """Both attention paths: the CPU paged kernel (one context length per query row) and the
    padded SDPA groups (a mask per row)."""
    folder = folders["stream"]
    opts = {("add_threshold" if k == "add" else "semi_threshold" if k == "semi" else k): v for k, v in rule.items()}
    llm = LLM(str(folder), method="diffusion", **opts, **ENGINE)
    llm.engine.runner.cpu_decode_kernel = kernel and llm.engine.runner.cpu_decode_kernel
    outs = llm.generate(PROMPTS, GREEDY)
    ref = TwoStream(folder)
    for prompt, out in zip(PROMPTS, outs):
        ids, steps = reference(ref, prompt, GREEDY, block=4, shift=True, **rule)
        assert (out.token_ids, out.metrics.num_forwards) == (ids, steps), f"prompt {prompt}"
    assert llm.engine.block_manager.num_used_blocks == 0
    stats = llm.engine.method.stats()
    assert stats["decided_tokens_per_step"] > 1.05 and stats["num_stored_blocks"] > 0


def test_the_mask_stream_decides_what_it_proposes(folders):
    """The stream's weights reach the output: the same parent with another mask stream (an
    exact copy of the parent's layers) decodes other text at the same threshold, so an engine
    that ignored the stream could not pass the comparison with the reference above."""
    a = LLM(str(folders["stream"]), method="diffusion", threshold=0.6, **ENGINE).generate(PROMPTS, GREEDY)
    b = LLM(str(folders["copy"]), method="diffusion", threshold=0.6, **ENGINE).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in a] != [o.token_ids for o in b]


def test_seeded_sampling_equals_the_reference(folders):
    folder = folders["stream"]
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(4)]
    llm = LLM(str(folder), method="diffusion", threshold=0.7, **ENGINE)
    ref = TwoStream(folder)
    for prompt, p, out in zip(PROMPTS, params, llm.generate(PROMPTS[:4], params)):
        ids, _ = reference(ref, prompt, p, block=4, shift=True, threshold=0.7)
        assert out.token_ids == ids


# --- verified decoding ---------------------------------------------------------------------------
def verified_reference(model, prompt: list[int], params: SamplingParams, *, threshold: float,
                       num_blocks: int = 1, add: float = 0.1, block: int = 4) -> tuple[list[int], int]:
    """Slow greedy verified decoding, no KV cache: (output ids, forwards). Each forward feeds the
    committed text, the drafts, then masks to the end of the block window; the parent's rows
    (before each draft) accept drafts while they agree and give one token more; when every draft
    held, the mask rows' confident predictions after that token are the next drafts."""
    B, P = block, len(prompt)
    text, drafts, active, steps = list(prompt), [], 1, 0
    while len(text) < P + params.max_tokens:
        n, front = len(text), len(text) // B
        ids = text + drafts + [MASK] * ((front + num_blocks) * B - n - len(drafts))
        logits = model(torch.tensor([ids])).logits[0]
        steps += 1
        need = list(range(n, min(P + params.max_tokens, (front + active) * B)))
        x = logits[[p - 1 for p in need]]
        x[:, MASK] = float("-inf")
        conf, tok = x.softmax(-1).max(-1)
        conf, tok = conf.tolist(), tok.tolist()
        m = min(len(drafts), len(need) - 1)
        k = 0
        while k < m and drafts[k] == tok[k]:
            k += 1
        out = tok[:k + 1]                         # accepted drafts are the parent's own tokens
        held = k == m == len(drafts)
        drafts = []
        if held:
            for i in range(len(out), len(need)):
                if conf[i] <= threshold:
                    break
                drafts.append(tok[i])
        text += out
        n2 = len(text)
        active = max(1, front + active - n2 // B)
        while (active < num_blocks and (n2 // B + active) * B < P + params.max_tokens
               and sum(p < n2 for p in range((n2 // B + active - 1) * B, (n2 // B + active) * B)) / B > add):
            active += 1
    return text[P:], steps


@pytest.mark.parametrize("which", ["stream", "copy"])
@pytest.mark.parametrize("rule", [dict(threshold=0.0), dict(threshold=0.5),
                                  dict(threshold=0.0, num_blocks=3, add=0.2)])
def test_verified_decoding_is_the_parent_in_fewer_forwards(folders, which, rule):
    """verify=True: the text is `ar`'s token for token at any threshold, and the engine (paged KV
    kept per verified position, batching, multi-block windows) takes the forwards the slow
    verified sampler takes, so the drafts it feeds and keeps are the rule's; drafts were accepted
    (fewer forwards than tokens)."""
    folder = str(folders[which])
    opts = {("add_threshold" if k == "add" else k): v for k, v in rule.items()}
    ar = LLM(folder, **ENGINE).generate(PROMPTS, GREEDY)
    llm = LLM(folder, method="diffusion", verify=True, **opts, **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    ref = TwoStream(folders[which])
    for prompt, out in zip(PROMPTS, outs):
        ids, steps = verified_reference(ref, prompt, GREEDY, **rule)
        assert (out.token_ids, out.metrics.num_forwards) == (ids, steps), f"prompt {prompt}"
    stats = llm.engine.method.stats()
    assert stats["num_accepted_tokens"] > 0
    assert sum(o.metrics.num_forwards for o in outs) < sum(len(o.token_ids) for o in outs)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("num_blocks", [1, 2])
def test_verified_decoding_under_penalties_bans_and_min_tokens_is_the_parent(folders, num_blocks):
    """A verify step's parent rows come after the drafts fed before them: penalties, multi-token
    bad words and min_tokens see those drafts, as `ar` saw the same tokens committed."""
    folder = str(folders["copy"])
    ar = LLM(folder, **ENGINE)
    base = ar.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    tok = ar.engine.tokenizer
    pair = tok.decode(base[0].token_ids[4:6])
    stop = base[1].token_ids[3]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, bad_words=[pair.strip() or pair]),
              SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop], min_tokens=8),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=0.3)]
    params = [p for p in params for _ in PROMPTS]          # every prompt under every setting
    prompts = PROMPTS * 3
    want = [o.token_ids for o in ar.generate(prompts, params)]
    llm = LLM(folder, method="diffusion", verify=True, threshold=0.0, num_blocks=num_blocks, **ENGINE)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert llm.engine.method.stats()["num_accepted_tokens"] > 0


def test_verified_decoding_honours_the_requests_draft_cap_and_counts_its_drafts(folders):
    """A request's num_speculative_tokens bounds the drafts verified for it (0: none, one token a
    forward, drafting_off "request"), and its metrics carry its own drafted / accepted counts and
    tokens per verify step, as a speculative method's do; the text stays the parent's."""
    folder = str(folders["copy"])
    want = [o.token_ids for o in LLM(folder, **ENGINE).generate(PROMPTS, GREEDY)]
    llm = LLM(folder, method="diffusion", verify=True, threshold=0.0, **ENGINE)
    free, one, off = (llm.generate(PROMPTS, SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0,
                                                           num_speculative_tokens=cap)) for cap in (None, 1, 0))
    for outs in (free, one, off):
        assert [o.token_ids for o in outs] == want
    total = llm.engine.method.stats()
    assert sum(o.metrics.num_drafted_tokens for o in free + one + off) == total["num_drafted_tokens"]
    assert sum(o.metrics.num_accepted_tokens for o in free + one + off) == total["num_accepted_tokens"]
    assert sum(o.metrics.num_accepted_tokens for o in free) > 0
    for o in free:
        assert o.metrics.drafting_off is None and o.metrics.acceptance_length >= 1
    assert max(o.metrics.acceptance_length for o in free) > 1
    assert max(o.metrics.num_drafted_tokens for o in one) > 0
    for o in one:       # at most one draft a step: at most two tokens a forward
        assert o.metrics.num_forwards >= len(o.token_ids) / 2
    for o in off:
        assert (o.metrics.num_drafted_tokens, o.metrics.drafting_off) == (0, "request")
        assert o.metrics.num_forwards >= len(o.token_ids)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_verified_logprobs_are_the_parents(folders):
    folder = str(folders["copy"])
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2)
    ar = LLM(folder, **ENGINE).generate(PROMPTS, params)
    dif = LLM(folder, method="diffusion", verify=True, threshold=0.0, **ENGINE).generate(PROMPTS, params)
    assert sum(d.metrics.num_forwards for d in dif) < sum(len(d.token_ids) for d in dif)
    for a, d in zip(ar, dif):
        assert d.token_ids == a.token_ids
        assert [e["token_id"] for e in d.logprobs] == d.token_ids
        np.testing.assert_allclose([e["logprob"] for e in d.logprobs], [e["logprob"] for e in a.logprobs],
                                   atol=1e-4)


def test_verified_sampling_keeps_the_parents_distribution(folders):
    """Sampled requests: the rejection rule against each draft's own distribution. One position's
    token frequencies over many seeds match the parent's softmax there (the first token is the
    parent's own draw; the second is a verified draft or the residual's)."""
    folder = folders["copy"]
    prompt = PROMPTS[5]
    temp = 1.5
    params = [SamplingParams(max_tokens=3, temperature=temp, seed=i, ignore_eos=True) for i in range(400)]
    llm = LLM(str(folder), method="diffusion", verify=True, threshold=0.0, **ENGINE)
    outs = llm.generate([prompt] * len(params), params)
    assert llm.engine.method.stats()["num_drafted_tokens"] > 0
    ref = TwoStream(folder)
    first = outs[0].token_ids[0]
    seconds = [o.token_ids[1] for o in outs if o.token_ids[0] == first]
    # the parent's distribution of the second token after (prompt, first): causal, so masks do not matter
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + [first]])).logits[0, -1]
    logits[MASK] = float("-inf")
    p = (logits / temp).softmax(-1)
    top = p.argsort(descending=True)[:3].tolist()
    freq = [sum(t == k for t in seconds) / len(seconds) for k in top]
    assert len(seconds) >= 60
    for k, f in zip(top, freq):
        assert abs(f - float(p[k])) < 4 * (float(p[k]) * (1 - float(p[k])) / len(seconds)) ** 0.5 + 0.02, (k, f, float(p[k]))


def test_verify_needs_a_two_stream_model(folders, tmp_path):
    """A one-stream diffusion model's rows all see their block: nothing would verify the drafts."""
    from test_diffusion import diffusion_folder
    plain = diffusion_folder(folders["src"], tmp_path / "plain", block_size=4, mask_token_id=MASK,
                             diffusion_logit_shift=True)
    with pytest.raises(ValueError, match="diffusion_mask_stream"):
        LLM(str(plain), method="diffusion", verify=True, **ENGINE)
    with pytest.raises(ValueError, match="verify='yes'"):
        LLM(str(folders["stream"]), method="diffusion", verify="yes", **ENGINE)


def test_transformers_reads_the_folder_as_its_parent(folders):
    from transformers import AutoModelForCausalLM
    ids = torch.tensor([PROMPTS[1]])
    hf = AutoModelForCausalLM.from_pretrained(folders["stream"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0]
    ours = load_model(folders["stream"], suppress=False).forward_dense(ids)[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_a_broken_mask_stream_is_named(folders, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(folders["stream"], bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["mask_stream.layers.1.mlp.down_proj.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="mask_stream.layers.1.mlp.down_proj"):
        load_model(bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["diffusion_mask_stream"] = "yes"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json.*diffusion_mask_stream"):
        load_model(bad)


# --- training ---------------------------------------------------------------------------------
def test_training_mask_follows_the_two_stream_rule():
    """Views: single-block (blocks 0, 1), MultiTF (both blocks one group); clean. Block size 2,
    masked positions: view 0 at 1 and 2, view 1 at 0. Known rows and the clean copy are causal."""
    table = torch.tensor([
        # N0 N1 N2 N3  M0 M1 M2 M3  C0 C1 C2 C3
        [1, 0, 0, 0,  0, 0, 0, 0,  0, 0, 0, 0],   # N0 known
        [1, 1, 0, 0,  0, 0, 0, 0,  0, 0, 0, 0],   # N1 masked: its block
        [0, 0, 1, 1,  0, 0, 0, 0,  1, 1, 0, 0],   # N2 masked: its block + clean block 0
        [0, 0, 1, 1,  0, 0, 0, 0,  1, 1, 0, 0],   # N3 known: causal (N2) + clean block 0
        [0, 0, 0, 0,  1, 1, 0, 0,  0, 0, 0, 0],   # M0 masked
        [0, 0, 0, 0,  1, 1, 0, 0,  0, 0, 0, 0],   # M1 known: causal
        [0, 0, 0, 0,  1, 1, 1, 0,  0, 0, 0, 0],   # M2 known: causal through its group
        [0, 0, 0, 0,  1, 1, 1, 1,  0, 0, 0, 0],   # M3 known
        [0, 0, 0, 0,  0, 0, 0, 0,  1, 0, 0, 0],   # clean: causal
        [0, 0, 0, 0,  0, 0, 0, 0,  1, 1, 0, 0],
        [0, 0, 0, 0,  0, 0, 0, 0,  1, 1, 1, 0],
        [0, 0, 0, 0,  0, 0, 0, 0,  1, 1, 1, 1],
    ]).bool()
    masks = [np.array([0, 1, 1, 0], bool), np.array([1, 0, 0, 0], bool)]
    got = attention_mask([np.arange(2), np.array([0, 0])], block_size=2, masks=masks)
    assert torch.equal(got, table)


def test_packed_two_stream_rows_equal_separate_forwards(folders):
    """Each view of a packed row computes what one sequence [clean prefix ; noisy group] computes
    under the two-stream rule, and the clean copy is the parent's causal forward."""
    model = mask_stream.from_folder(folders["stream"])
    bs, spec = 4, DiffusionSpec(block_size=4, mask_stream=True)
    x0 = torch.randint(4, 60, (1, 16), generator=torch.Generator().manual_seed(3))
    masks = [np.random.default_rng(1).random(16) < 0.5, np.random.default_rng(2).random(16) < 0.5]
    groups = [np.arange(4), np.array([0, 1, 1, 1])]
    batch = pack(x0, [masks], [groups], [SINGLE, MULTI], spec, mask_id=MASK)
    with torch.no_grad():
        hidden = mask_stream.hidden_states(model, batch.input_ids, batch.position_ids, batch.attn_mask, MASK)[0]
        for v, (m, g) in enumerate(zip(masks, groups)):
            noisy = torch.where(torch.as_tensor(m), MASK, x0[0])
            for group in np.unique(g):
                blocks = np.flatnonzero(g == group)
                lo, hi = blocks[0] * bs, (blocks[-1] + 1) * bs
                ids = torch.cat([x0[0, :lo], noisy[lo:hi]])[None]
                ref = mask_stream.hidden_states(model, ids, torch.arange(hi)[None],
                                                mask_stream.block_rule_mask(ids, bs, MASK), MASK)[0, lo:hi]
                torch.testing.assert_close(hidden[v * 16 + lo:v * 16 + hi], ref, atol=1e-5, rtol=1e-5)
        clean = model.model(input_ids=x0).last_hidden_state[0]
        torch.testing.assert_close(hidden[32:], clean, atol=1e-5, rtol=1e-5)
        loss, parts = diffusion_loss(model, batch, mask_id=MASK)
    assert parts["single_targets"] > 0 and torch.isfinite(loss)


def test_training_moves_only_the_mask_stream(folders):
    """A few optimizer steps: the parent's tensors stay bit for bit, the stream's change, and the
    loss falls on the batch it trains on."""
    from leapfrog.train.loop import load_pretrained
    parent, _ = load_pretrained(str(folders["copy"]))
    before = {k: v.clone() for k, v in parent.state_dict().items()}
    mask_stream.attach(parent, None, MASK)
    spec = DiffusionSpec(block_size=4, complementary=True, mask_stream=True)
    from leapfrog.train.diffusion import make_batch
    batch = make_batch(torch.randint(4, 60, (2, 16), generator=torch.Generator().manual_seed(5)), spec, MASK,
                       np.random.default_rng(0), 0, True)
    opt = torch.optim.AdamW([p for p in parent.parameters() if p.requires_grad], lr=3e-3)
    stream0 = {k: v.clone() for k, v in parent.mask_stream.state_dict().items()}
    losses = []
    for _ in range(5):
        loss, _ = diffusion_loss(parent, batch, mask_id=MASK)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    after = parent.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert any(not torch.equal(parent.mask_stream.state_dict()[k], v) for k, v in stream0.items())
    assert losses[-1] < losses[0]


def test_pipeline_stages_refuse_a_mask_stream(monkeypatch):
    """The two-stream forward runs every layer of both streams: a pipeline stage refuses such a
    checkpoint with a message naming the key, instead of computing wrong rows (tensor-parallel
    ranks run it: tests/engine/test_tensor_parallel.py)."""
    from leapfrog.layers import parallel as tp
    from leapfrog.models import mask_stream as engine_side
    cfg = {"diffusion_mask_stream": True, "mask_token_id": 3}
    assert engine_side.has_mask_stream(cfg) and not engine_side.has_mask_stream({})
    monkeypatch.setattr(tp, "pp_size", lambda: 2)
    with pytest.raises(ValueError, match="diffusion_mask_stream.*pipeline stages"):
        engine_side.has_mask_stream(cfg)
