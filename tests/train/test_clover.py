"""stories-clover's parts (leapfrog/train/clover.py): experts grown from a smaller MoE keep its
function when no noise is added (copies x top-k), and the LLaDA2-MoE export loads through the
LLaDA2 loader with the Qwen3-MoE folder's logits, in leapfrog and against transformers."""
from __future__ import annotations

import json

import math

import pytest
import torch

from conftest import VOCAB, write_tokenizer
from leapfrog.models.loader import load_model
from leapfrog.train.clover import export_llada2, grow_experts
from leapfrog.train.export import verify_sha256sums
from leapfrog.train.loop import ModelShape, build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_moe(experts: int = 4, top_k: int = 2):
    torch.manual_seed(0)
    model = build_model(ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                   max_position=64, num_experts=experts, num_experts_per_tok=top_k,
                                   moe_intermediate_size=16), VOCAB).eval()
    with torch.no_grad():                  # spread the router, so that choices differ per token
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


def test_grown_experts_without_noise_keep_the_function():
    model = tiny_moe()
    grown = grow_experts(model, 12, 6).eval()
    assert grown.config.num_experts == 12 and grown.config.num_experts_per_tok == 6
    ids = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(grown(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(grow_experts(model, 12, 2).eval()(ids).logits, model(ids).logits, atol=1e-3)


def test_noise_leaves_the_first_copies_alone():
    model = tiny_moe()
    grown = grow_experts(model, 8, 2, noise=0.05, seed=1)
    for old, new in zip(model.model.layers, grown.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            a, b = getattr(old.mlp.experts, name), getattr(new.mlp.experts, name)
            assert torch.equal(b[:4], a) and not torch.allclose(b[4:], a)
        assert torch.equal(new.mlp.gate.weight[:4], old.mlp.gate.weight)
    with pytest.raises(ValueError, match="multiple"):
        grow_experts(model, 6, 2)


def test_llada2_export_loads_with_the_same_logits(tmp_path):
    model = tiny_moe(experts=6, top_k=2)
    qwen = tmp_path / "qwen3-moe"
    model.save_pretrained(qwen)
    write_tokenizer(qwen)
    cfg = json.loads((qwen / "config.json").read_text())
    cfg.update(block_size=4, mask_token_id=3, diffusion_logit_shift=True)     # a block-diffusion folder
    (qwen / "config.json").write_text(json.dumps(cfg))
    llada = export_llada2(qwen, tmp_path / "llada2")
    exported = json.loads((llada / "config.json").read_text())
    assert exported["architectures"] == ["LLaDA2MoeModelLM"] and exported["block_size"] == 4
    assert (llada / "SHA256SUMS").is_file() and verify_sha256sums(llada) == []    # checked on every load
    ids = torch.randint(0, VOCAB, (1, 21))
    with torch.no_grad():
        theirs = model(ids).logits
        ours_qwen = load_model(qwen).forward_dense(ids)
        ours_llada = load_model(llada).forward_dense(ids)
    torch.testing.assert_close(ours_llada, ours_qwen, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_llada, theirs, atol=1e-4, rtol=1e-4)


def test_top1_has_no_llada2_equivalent(tmp_path):
    folder = tmp_path / "top1"
    tiny_moe(top_k=1).save_pretrained(folder)
    with pytest.raises(ValueError, match="renormalises"):
        export_llada2(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()                # nothing half-written


def test_toy_clover_pipeline_grows_trains_exports_and_decodes(tmp_path):
    """A tiny MoE trained briefly, grown (4 -> 8 experts) into a block-diffusion stage, exported in
    LLaDA2's layout, then decoded by `diffusion` through the engine."""
    from conftest import write_mini_data
    from leapfrog import LLM, SamplingParams
    from leapfrog.data import corpus as data
    from leapfrog.train.diffusion import DiffusionSpec
    from leapfrog.train.loop import train
    from leapfrog.train.recipes import tiny

    data_dir, old = write_mini_data(tmp_path / "data"), data.CACHE_DIR
    data.CACHE_DIR = tmp_path / "cache"
    moe = ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                     max_position=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    try:
        one = tiny("stories", tmp_path / "moe", tmp_path / "run1")
        one.data_dir, one.max_steps, one.eval_interval, one.model = str(data_dir), 4, 4, moe
        train(one)
        two = tiny("stories", tmp_path / "clover", tmp_path / "run2")
        two.data_dir, two.max_steps, two.eval_interval, two.init_from = str(data_dir), 4, 4, one.out_dir
        two.recipe, two.align_to_bos, two.diffusion = "stories-clover", True, DiffusionSpec(block_size=4)
        two.grow_experts = (8, 2, 0.01)
        result = train(two)
    finally:
        data.CACHE_DIR = old
    assert math.isfinite(result["val_loss"])
    history = torch.load(tmp_path / "run2" / "state.pt", weights_only=False)["history"]
    assert len(history["train"]) == 4                         # the grown model trained its steps
    cfg = json.loads((tmp_path / "clover" / "config.json").read_text())
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == 8 and cfg["block_size"] == 4
    llada = export_llada2(tmp_path / "clover", tmp_path / "clover-llada2")
    ids = torch.randint(4, 200, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(load_model(llada).forward_dense(ids), load_model(tmp_path / "clover").forward_dense(ids),
                                   atol=1e-5, rtol=1e-5)
    out = LLM(str(llada), method="diffusion").generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))
    assert out[0].finish_reason in ("length", "stop") and out[0].token_ids
