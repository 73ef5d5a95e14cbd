"""Block-diffusion training (leapfrog/train/diffusion.py): the packed attention mask against a
hand-written table and against separate forwards, target selection (masks, shift, complementary
pairs), and a toy two-stage run whose folder loads in transformers and leapfrog alike."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import write_mini_data

from leapfrog.data import corpus as data
from leapfrog.train.diffusion import (MULTI, SINGLE, DiffusionSpec, attention_mask, block_causal_mask,
                                      chain_masks, diffusion_loss, group_layout, make_batch, pack,
                                      reference_decode)
from leapfrog.train.loop import ModelShape, build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(vocab: int = 64):
    torch.manual_seed(0)
    return build_model(ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                  intermediate_size=64, max_position=64), vocab).eval()


def test_attention_mask_matches_hand_written_table():
    # Views: single-block (groups 0,1,2), MultiTF (blocks 0-1 one group, block 2 alone); clean.
    table = torch.tensor([
        # N0 N1 N2  M0 M1 M2  C0 C1 C2
        [1, 0, 0,  0, 0, 0,  0, 0, 0],   # N0: itself; no clean block before it
        [0, 1, 0,  0, 0, 0,  1, 0, 0],   # N1: itself + clean block 0
        [0, 0, 1,  0, 0, 0,  1, 1, 0],   # N2
        [0, 0, 0,  1, 0, 0,  0, 0, 0],   # M0: group {0,1} starts at block 0: no clean prefix
        [0, 0, 0,  1, 1, 0,  0, 0, 0],   # M1: the noisy earlier block of its group, no clean
        [0, 0, 0,  0, 0, 1,  1, 1, 0],   # M2: group {2}: clean blocks 0, 1
        [0, 0, 0,  0, 0, 0,  1, 0, 0],   # C0: block-causal among clean blocks only
        [0, 0, 0,  0, 0, 0,  1, 1, 0],   # C1
        [0, 0, 0,  0, 0, 0,  1, 1, 1],   # C2
    ])
    expected = torch.kron(table, torch.ones(2, 2, dtype=torch.long)).bool()
    got = attention_mask([np.arange(3), np.array([0, 0, 1])], block_size=2)
    assert torch.equal(got, expected)


def test_packed_forward_equals_separate_forwards():
    """Each noisy group of the packed row sees exactly what a plain block-causal forward of
    [clean prefix ; noisy group] sees (positions, mask, no leak from later blocks or other views)."""
    model, bs = tiny_model(), 4
    x0 = torch.randint(4, 64, (1, 16))
    masks = [np.random.default_rng(1).random(16) < 0.5, np.random.default_rng(2).random(16) < 0.5]
    groups = [np.arange(4), np.array([0, 1, 1, 1])]
    batch = pack(x0, [masks], [groups], [SINGLE, MULTI], DiffusionSpec(block_size=bs), mask_id=3)
    with torch.no_grad():
        hidden = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                             attention_mask=batch.attn_mask, use_cache=False).last_hidden_state[0]
        for v, (m, g) in enumerate(zip(masks, groups)):
            noisy = torch.where(torch.as_tensor(m), 3, x0[0])
            for group in np.unique(g):
                blocks = np.flatnonzero(g == group)
                lo, hi = blocks[0] * bs, (blocks[-1] + 1) * bs
                ids = torch.cat([x0[0, :lo], noisy[lo:hi]])[None]
                ref = model.model(input_ids=ids, attention_mask=block_causal_mask(hi, bs),
                                  use_cache=False).last_hidden_state[0, lo:hi]
                torch.testing.assert_close(hidden[v * 16 + lo:v * 16 + hi], ref, atol=1e-5, rtol=1e-5)
        clean = model.model(input_ids=x0, attention_mask=block_causal_mask(16, bs),
                            use_cache=False).last_hidden_state[0]
        torch.testing.assert_close(hidden[32:], clean, atol=1e-5, rtol=1e-5)


def test_unmasked_blocks_give_no_targets_and_zero_loss():
    spec, x0 = DiffusionSpec(block_size=4), torch.arange(10, 18)[None]
    none = pack(x0, [[np.zeros(8, bool)]], [[np.arange(2)]], [SINGLE], spec, mask_id=3)
    assert none.targets.numel() == 0
    model = tiny_model()
    loss, parts = diffusion_loss(model, none)
    assert loss.item() == 0.0 and parts == {}
    loss.backward()                                   # still a graph: an all-clean batch cannot crash a step
    # Mask probability 0 for block 0 (eps = 0, t = 0), positive for block 1: targets only in block 1.
    m = np.array([0, 0, 0, 0, 1, 0, 1, 1], bool)
    some = pack(x0, [[m]], [[np.arange(2)]], [SINGLE], DiffusionSpec(block_size=4, shift=False), 3)
    assert some.targets.tolist() == [14, 16, 17]
    assert diffusion_loss(model, some)[1]["single_targets"] == 3


def test_shift_alignment_on_a_hand_example():
    x0 = torch.arange(10, 18)[None]                     # tokens 10..17 at positions 0..7, blocks of 4
    m = np.zeros(8, bool)
    m[[1, 4, 6]] = True
    # Rows: view 0 = 0..7, view 1 = 8..15, clean = 16..23.
    views = [[m, m]], [[np.arange(2), np.array([0, 0])]]   # single-block view, one two-block group
    plain = pack(x0, *views, [SINGLE, MULTI], DiffusionSpec(block_size=4, shift=False), mask_id=3)
    assert plain.src.tolist() == [1, 4, 6, 9, 12, 14]          # position i predicts token i
    shifted = pack(x0, *views, [SINGLE, MULTI], DiffusionSpec(block_size=4, shift=True), mask_id=3)
    # Hidden i-1 predicts token i; the first token of block 1 (position 4) reads position 3 from the
    # clean copy (row 19) in the single-block view, and from its own noisy view (row 11) where
    # blocks 0 and 1 are one group.
    assert shifted.src.tolist() == [0, 19, 5, 8, 11, 13]
    assert shifted.targets.tolist() == plain.targets.tolist() == [11, 14, 16] * 2
    assert shifted.kinds.tolist() == [SINGLE] * 3 + [MULTI] * 3
    # Position 0 has no predictor when shifted: masked, but never a target.
    m0 = np.zeros(8, bool)
    m0[0] = True
    assert pack(x0, [[m0]], [[np.arange(2)]], [SINGLE], DiffusionSpec(shift=True), 3).targets.numel() == 0


@pytest.mark.parametrize("shift", [False, True])
def test_complementary_masks_cover_every_position_once(shift):
    spec = DiffusionSpec(block_size=4, shift=shift, complementary=True)
    x = torch.randint(4, 64, (3, 32))
    batch = make_batch(x, spec, 3, np.random.default_rng(0), multi_views=0)
    size = 3 * 32                                          # two views + clean per row
    rows, pos = batch.src // size, batch.src % size % 32 + int(shift)   # the target's position
    counts = torch.zeros(3, 32, dtype=torch.long).index_put_((rows, pos), torch.ones_like(pos), accumulate=True)
    expected = torch.ones(3, 32, dtype=torch.long)
    if shift:
        expected[:, 0] = 0                                  # nothing predicts position 0
    assert torch.equal(counts, expected)
    assert torch.equal(batch.targets, x[rows, pos])


def test_multitf_layouts_and_chain_noise():
    rng, spec = np.random.default_rng(0), DiffusionSpec(block_size=4, max_group=4)
    for _ in range(50):
        g = group_layout(13, 4, rng)
        assert (np.diff(g) >= 0).all() and np.bincount(g - g.min()).max() <= 4
        assert len(np.unique(g)) < 13                      # some group holds several blocks
        counts = chain_masks(g, 4, spec, rng).reshape(13, 4).sum(1)
        assert counts.min() >= 1
        for group in np.unique(g):                         # later blocks of a group are noisier
            assert (np.diff(counts[g == group]) >= 0).all()


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    """Stage 1 (fresh tiny model, single-block) then stage 2 (MultiTF) on the mini data."""
    from leapfrog.train.loop import train
    from leapfrog.train.recipes import tiny

    root = tmp_path_factory.mktemp("diffusion")
    data_dir, old = write_mini_data(root / "data"), data.CACHE_DIR
    data.CACHE_DIR = root / "cache"
    try:
        one = tiny("stories", root / "stage1", root / "run1")
        one.data_dir, one.max_steps, one.eval_interval, one.lr = str(data_dir), 12, 6, 1e-2
        one.recipe, one.align_to_bos, one.diffusion = "stories-diffusion", True, DiffusionSpec(block_size=4)
        first = train(one)
        two = tiny("stories", root / "checkpoints" / "stories-diffusion", root / "run2")
        two.data_dir, two.max_steps, two.eval_interval, two.init_from = str(data_dir), 3, 3, one.out_dir
        two.recipe, two.diffusion = "stories-diffusion-mb", DiffusionSpec(
            block_size=4, complementary=False, multi_views=1, multi_weight=0.5)
        second = train(two)
        # stage 5's shape: stage 1's folder as the frozen parent, a mask stream from stage 2
        three = tiny("stories", root / "stream", root / "run3")
        three.data_dir, three.max_steps, three.eval_interval, three.init_from = str(data_dir), 2, 2, one.out_dir
        three.recipe, three.mask_stream_from = "stories-diffusion-stream", two.out_dir
        three.diffusion = DiffusionSpec(block_size=4, complementary=False, multi_views=1, multi_weight=0.5,
                                        mask_stream=True)
        train(three)
    finally:
        data.CACHE_DIR = old
    return (one, first), (two, second), three


def test_toy_run_lowers_the_loss(toy_runs):
    (one, first), (two, second), _ = toy_runs
    history = torch.load(Path(one.run_dir) / "state.pt", weights_only=False)["history"]
    losses = [loss for _, loss in history["train"]]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5
    assert history["val"][-1][1] < history["val"][0][1]
    assert set(first["val_parts"]) >= {"single", "multi"}   # validation measures both losses
    assert second["init"]["val_loss"] == first["val_loss"] and second["val_parts"]["multi_targets"] > 0


def test_exported_folder_carries_the_contract_and_loads_alike(toy_runs, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leapfrog import config
    from leapfrog.models.loader import load_model
    from leapfrog.train.export import verify_sha256sums

    _, (two, _), _ = toy_runs
    folder = Path(two.out_dir)
    cfg = json.loads((folder / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(folder)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["block_size"], cfg["mask_token_id"], cfg["diffusion_logit_shift"]) == (
        4, tok.convert_tokens_to_ids("<mask>"), True)
    assert json.loads((folder / "leapfrog.json").read_text()) == {"default_method": "diffusion"}
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):   # copied verbatim
        assert (folder / name).read_bytes() == (Path(two.init_from) / name).read_bytes()
    assert verify_sha256sums(folder) == []
    monkeypatch.setattr(config, "CHECKPOINT_DIRS", [folder.parent])
    assert config.resolve_model("stories-diffusion") == folder

    ids = tok("the cat saw a big dog", return_tensors="pt").input_ids
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0]
        block = hf(input_ids=ids, attention_mask=block_causal_mask(ids.shape[1], 4)).logits[0]
    ours = load_model(folder).forward_dense(ids)[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(block, ref)                  # the diffusion mask reaches the model


def test_an_exported_two_stream_model_decodes_its_parents_text_by_default(toy_runs):
    """Stage 5's export: the parent's folder plus the stream, and leapfrog.json makes verified
    decoding the method's default there, so `diffusion` on the folder writes the parent's greedy
    text (the server's and CLI's default method for it is `diffusion`)."""
    from leapfrog import LLM, SamplingParams
    from leapfrog.train.export import verify_sha256sums

    (one, _), _, three = toy_runs
    folder = Path(three.out_dir)
    assert json.loads((folder / "leapfrog.json").read_text()) == {
        "default_method": "diffusion", "method_options": {"diffusion": {"verify": True}}}
    assert json.loads((folder / "config.json").read_text())["diffusion_mask_stream"] is True
    assert verify_sha256sums(folder) == []
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["the cat saw a big dog", "once there was"]
    llm = LLM(str(folder), method="diffusion", num_threads=1)
    assert llm.engine.method.verify and llm.engine.method.threshold == 0.0
    assert LLM(str(folder), method="diffusion", verify=False, num_threads=1).engine.method.threshold == 0.9
    got = [o.token_ids for o in llm.generate(prompts, greedy)]
    want = [o.token_ids for o in LLM(one.out_dir, method="ar", num_threads=1).generate(prompts, greedy)]
    assert got == want


def test_reference_decoder_and_readme(toy_runs):
    from transformers import AutoModelForCausalLM

    from leapfrog.train.check import CheckResult
    from leapfrog.train.readme import render

    _, (two, summary), _ = toy_runs
    folder = Path(two.out_dir)
    cfg = json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [1, 10, 11, 12, 13, 14]                       # ends mid-block: the block is completed
    new, forwards = reference_decode(model, prompt, cfg, max_new_tokens=10, threshold=2.0)
    assert len(new) == 10 and forwards == 10               # threshold > 1: one token per forward
    assert cfg["mask_token_id"] not in new
    fast, fewer = reference_decode(model, prompt, cfg, max_new_tokens=10, threshold=0.0)
    assert fewer == 3                                      # threshold 0: a block per forward (2 + 4 + 4)
    text = render(summary, CheckResult("stories-diffusion", {"tokens_per_forward": 1.0}, []), folder)
    for needle in ("## Block diffusion", "Multi-block teacher forcing", "mask_token_id",
                   'LLM("stories-diffusion", method="diffusion"', "initialised from"):
        assert needle in text
