"""matmul_precision="bfloat16": the CPU kernels' products with bfloat16 operands.

Oracles: the same products in float64 from the operands rounded by torch (`Tensor.bfloat16()`,
round to nearest even), and, for whole models, the invariants that make speculative decoding
lossless: a row's result does not depend on the rows beside it, so the layer path, the decode
loop and a verify step give the same tokens, and a drafted method equals `ar` at that precision.
"""
from __future__ import annotations

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.engine import decode_loop
from leapfrog.layers import linear as lin_mod
from leapfrog.layers.cpu_kernels import cpu_kernels
from leapfrog.layers.linear import Linear

mod = cpu_kernels()
pytestmark = [pytest.mark.skipif(mod is None, reason="no C++ compiler: the kernels are optional"),
              pytest.mark.usefixtures("bf16_products")]

PROMPTS = ["Once upon a time there was", "The cat liked to", "One day the cat met a big dog.", "春回大地"]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def rounded_product(x, w, b=None):
    y = x.bfloat16().double() @ w.bfloat16().double().T
    return (y if b is None else y + b.double()).float()


@pytest.mark.parametrize("m", [1, 2, 5, 9, 12, 13, 25, 61, 130])
@pytest.mark.parametrize("n,k", [(4096, 256), (13, 37), (16, 8), (1408, 704), (40, 301)])
def test_bf16_panels_equal_the_rounded_product_and_ignore_the_batch(m, n, k):
    """Each output is the float32 sum of the exact products of the rounded operands (odd k is
    padded with a zero pair), and a row's bits do not depend on the rows it is computed with:
    one row (two panels at a time), one tile of up to 16 rows, several tiles sharing a panel in
    slices of k, several tasks of 60 rows."""
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    panels = mod.pack_panels(w, bf16=True)
    assert panels.shape == (-(-n // 16), (k + 1) // 2, 32) and panels.dtype == torch.bfloat16
    full = mod.panel_linear(x, panels, b, n)
    ref = rounded_product(x, w, b)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=2e-5 * k ** 0.5)
    # not the float32 product: the rounding is real
    assert (full - torch.nn.functional.linear(x, w, b)).abs().max() > 1e-3
    rows = range(0, m, max(1, m // 5))
    alone = torch.stack([mod.panel_linear(x[i:i + 1], panels, b, n)[0] for i in rows])
    assert torch.equal(alone, full[list(rows)])
    if m > 3:
        assert torch.equal(mod.panel_linear(x[1:4], panels, b, n), full[1:4])


def test_activations_round_to_nearest_even_as_torch_does():
    """Through an identity weight the product is the rounded activation itself: ties to even,
    both signs, large and small normal numbers (not infinities, whose products with the zeros
    are NaN, nor denormals, which the instruction reads as zero)."""
    k = 32
    one = 1.0 + 2.0 ** -8                                   # halfway between two bfloat16 numbers
    vals = torch.tensor([one, 1.0 + 3 * 2.0 ** -8, -one, 3.14159, -2.71828, 1e30, -1e-30, 0.0, 65504.0,
                         1.0 + 2.0 ** -9, 7.0, -3.5, 123456.7, -0.1, 2.0 ** -126, 0.3] * 2)
    x = vals.view(1, k)
    panels = mod.pack_panels(torch.eye(k), bf16=True)
    y = mod.panel_linear(x, panels, torch.empty(0), k)
    assert torch.equal(y, x.bfloat16().float())


def test_bad_packed_weights_are_refused():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="packed weight does not match"):
        mod.panel_linear(x, mod.pack_panels(torch.randn(48, 32), bf16=True), torch.empty(0), 48)
    with pytest.raises(RuntimeError, match="packed weight does not match"):   # float32 layout, bfloat16 data
        mod.panel_linear(x, mod.pack_panels(torch.randn(48, 64)).bfloat16(), torch.empty(0), 48)


def test_compact_cpu_weights_packs_bfloat16_panels_for_every_linear():
    layer = Linear(64, 48, bias=True)                       # float32 values: no exact float16 copy
    assert lin_mod.compact_cpu_weights(layer, "bfloat16") == 0
    panels = lin_mod.kernel_panels(layer)
    assert panels is not None and panels.dtype == torch.bfloat16
    x = torch.randn(7, 64)
    with torch.inference_mode():
        y = layer(x)
    assert torch.equal(y, mod.panel_linear(x, panels, layer.bias, 48))
    torch.testing.assert_close(y, rounded_product(x, layer.weight.detach(), layer.bias.detach()), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        lin_mod.compact_cpu_weights(layer, "float8")


def test_the_engine_option_is_checked():
    with pytest.raises(ValueError, match="matmul_precision"):
        LLM("stories", matmul_precision="half")


def _run(llm: LLM, loop: bool, monkeypatch, prompts=PROMPTS, params=GREEDY) -> list:
    monkeypatch.setattr(decode_loop, "ENABLED", loop)
    try:
        return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    finally:
        monkeypatch.setattr(decode_loop, "ENABLED", True)


def test_layer_path_and_decode_loop_agree_in_bfloat16(llama_dir, monkeypatch):
    """The op-by-op layers, the decode loop one step per call and five steps per call give the
    same tokens and logprobs, alone and in a batch, and they are not float32's logprobs."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    layer = _run(LLM(str(llama_dir), matmul_precision="bfloat16"), False, monkeypatch, params=params)
    one = _run(LLM(str(llama_dir), matmul_precision="bfloat16", num_scheduler_steps=1), True, monkeypatch,
               params=params)
    multi_llm = LLM(str(llama_dir), matmul_precision="bfloat16", num_scheduler_steps=5)
    multi = _run(multi_llm, True, monkeypatch, params=params)
    assert layer == one == multi
    # without logprobs the loop runs several steps per call
    tokens = _run(multi_llm, True, monkeypatch)
    assert [t[:12] for t, _ in tokens] == [t for t, _ in layer]
    assert multi_llm.engine.decode_loop.num_loop_steps > multi_llm.engine.decode_loop.num_calls > 0
    alone = [_run(multi_llm, True, monkeypatch, prompts=[p], params=params)[0] for p in PROMPTS]
    assert alone == multi
    f32 = _run(LLM(str(llama_dir)), True, monkeypatch, params=params)
    # float32's logprobs of the same tokens differ, a little
    diffs = [abs(la["logprob"] - lb["logprob"]) for (ta, a), (tb, b) in zip(multi, f32) if ta == tb
             for la, lb in zip(a, b)]
    assert diffs and max(diffs) > 0 and max(diffs) < 0.05

def test_speculative_decoding_in_bfloat16_equals_ar_in_bfloat16(llama_dir, draft_dir):
    """Verify steps of several rows give a one-row step's bits, so a draft model's tokens are
    accepted exactly where `ar` at this precision would produce them."""
    engine = dict(max_batch_size=8, num_threads=2, matmul_precision="bfloat16")
    ar = LLM(str(llama_dir), **engine).generate(PROMPTS, GREEDY)
    llm = LLM(str(llama_dir), method="draft", draft_model=str(draft_dir), num_speculative_tokens=5, **engine)
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    stats = llm.engine.method.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_drafted_tokens"]


def test_a_model_folder_sets_its_matmul_precision(llama_dir, tmp_path):
    """leapfrog.json's engine_options set the default; the caller's option wins; other engine
    options are not a folder's to set (an error naming the file)."""
    import json
    import shutil

    from leapfrog.models.loader import CheckpointError
    folder = tmp_path / "m"
    shutil.copytree(llama_dir, folder)
    (folder / "leapfrog.json").write_text(json.dumps({"engine_options": {"matmul_precision": "bfloat16"}}))
    assert LLM(str(folder)).engine.config.matmul_precision == "bfloat16"
    assert LLM(str(folder), matmul_precision="float32").engine.config.matmul_precision == "float32"
    # the bench suites run their engines the same way: --matmul-precision, else the folder's
    import argparse

    from leapfrog.bench.common import matmul_precision
    assert matmul_precision(argparse.Namespace(matmul_precision=None), folder) == "bfloat16"
    assert matmul_precision(argparse.Namespace(matmul_precision="float32"), folder) == "float32"
    assert matmul_precision(argparse.Namespace(matmul_precision=None), llama_dir) == "float32"
    (folder / "leapfrog.json").write_text(json.dumps({"engine_options": {"max_batch_size": 3}}))
    with pytest.raises(CheckpointError, match=r"leapfrog.json: engine_options \['max_batch_size'\]"):
        LLM(str(folder))


def test_without_avx512_bf16_the_engine_falls_back_to_float32(llama_dir, monkeypatch, caplog):
    """A CPU without the instruction would run bfloat16 products as scalar loops: the engine
    says so and uses float32 products (a model folder's default must not make a model crawl)."""
    import logging

    monkeypatch.setattr(lin_mod, "bf16_products_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="leapfrog.engine.llm_engine"):
        llm = LLM(str(llama_dir), matmul_precision="bfloat16")
    assert llm.engine.config.matmul_precision == "float32"
    assert "AVX512-BF16" in caplog.text
    panels = lin_mod.kernel_panels(llm.engine.model.lm_head)
    assert panels is not None and panels.dtype != torch.bfloat16
    assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids == LLM(str(llama_dir)).generate(PROMPTS[:1], GREEDY)[0].token_ids
    # the bench suites name the products that ran
    import argparse

    from leapfrog.bench.common import matmul_precision
    assert matmul_precision(argparse.Namespace(matmul_precision="bfloat16"), llama_dir) == "float32"

