"""The optional C++ CPU kernels equal the torch ops they replace (oracle: torch itself)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from leapfrog.layers.cpu_kernels import cpu_kernels
from leapfrog.layers.linear import Linear, PackedLinear
from leapfrog.layers.norm import RMSNorm

mod = cpu_kernels()
pytestmark = pytest.mark.skipif(mod is None, reason="no C++ compiler: the kernels are optional")


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 17, 33])
@pytest.mark.parametrize("n,k", [(4096, 256), (13, 37), (6, 8), (5, 300), (1100, 1003)])
def test_skinny_linear_equals_torch(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(mod.skinny_linear(x, w, torch.empty(0)), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(mod.skinny_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_one_row_reads_the_weight_row_by_row():
    """One row of x (a decode step) takes the row-by-row path, here with a weight bigger than
    the caches and a K with both tails: its result equals torch, and the float16 weight widens
    to the float32 result exactly."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(1, 1000, generator=g), torch.randn(2048, 1000, generator=g).half()
    torch.testing.assert_close(mod.skinny_linear(x, w, torch.empty(0)), F.linear(x, w.float()), rtol=1e-5, atol=1e-4)
    assert torch.equal(mod.skinny_linear(x, w, torch.empty(0)), mod.skinny_linear(x, w.float(), torch.empty(0)))


@pytest.mark.parametrize("n,k", [(4096, 256), (13, 37), (1100, 1003), (512, 64)])
@pytest.mark.parametrize("half", [False, True])
def test_a_rows_result_does_not_depend_on_its_batch(n, k, half):
    """Decode steps (one row) and verification steps (several rows) sum every product in the
    same order: greedy speculative decoding must stay token for token equal to greedy decoding."""
    g = torch.Generator().manual_seed(n + k)
    x, w, b = torch.randn(9, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    w = w.half() if half else w
    together = mod.skinny_linear(x, w, b)
    for i in range(9):
        assert torch.equal(mod.skinny_linear(x[i:i + 1], w, b)[0], together[i])


def test_skinny_linear_reads_strided_inputs():
    x = torch.randn(16, 64)[::2]                    # non-contiguous rows
    w = torch.randn(64, 40).t()                     # a transposed view
    torch.testing.assert_close(mod.skinny_linear(x, w, torch.empty(0)), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 256), (9, 4, 64), (300, 96), (2, 3, 7)])
def test_rms_norm_equals_torch(shape):
    x, w = torch.randn(*shape), torch.randn(shape[-1])
    torch.testing.assert_close(mod.rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5), rtol=1e-5, atol=1e-5)


def test_layers_use_the_kernels_only_where_autograd_is_not_needed():
    lin, packed, norm = Linear(32, 32, bias=True), PackedLinear(32, {"a": 8, "b": 16}), RMSNorm(32)
    x = torch.randn(3, 5, 32)
    with torch.inference_mode():
        for layer in (lin, packed):
            torch.testing.assert_close(layer.forward(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(norm.forward(x), F.rms_norm(x, (32,), norm.weight, norm.eps))
    # Training: gradients must flow (the kernels have no backward).
    y = norm.forward(lin.forward(x.requires_grad_()))
    y.sum().backward()
    assert lin.weight.grad is not None and norm.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("m", [1, 2, 3, 9])
@pytest.mark.parametrize("n,k", [(4096, 256), (13, 37), (5, 300), (1100, 1003), (600, 1000)])
def test_skinny_linear_widens_float16_weights_exactly(m, n, k):
    """A float16 weight gives the float32 kernel's result: widening is exact and the summation
    order is the same (the scalar tail may round a multiply-add differently)."""
    g = torch.Generator().manual_seed(m + n + k)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    w16 = torch.randn(n, k, generator=g).half()
    torch.testing.assert_close(mod.skinny_linear(x, w16, b), mod.skinny_linear(x, w16.float(), b),
                               rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(mod.skinny_linear(x, w16, b), F.linear(x, w16.float(), b), rtol=1e-5, atol=1e-4)


def test_compact_cpu_weights_only_copies_exact_weights_and_drops_stale_copies():
    """A float16-exact weight gets a float16 copy and float16 panels, another float32 panels;
    both layers then compute through their panels (the same bits as the float32 panels of the
    same values), and a weight updated in place falls back to torch."""
    from leapfrog.layers.linear import compact_cpu_weights, kernel_panels

    exact, inexact = Linear(64, 48), Linear(64, 48)
    with torch.no_grad():
        exact.weight.copy_(exact.weight.half().float())
    model = torch.nn.Sequential(exact, inexact)
    assert compact_cpu_weights(model) == 1
    assert "_half_weight" in exact.__dict__ and "_half_weight" not in inexact.__dict__
    assert kernel_panels(exact).dtype == torch.float16 and kernel_panels(inexact).dtype == torch.float32
    x = torch.randn(2, 64)
    with torch.inference_mode():
        for layer in (exact, inexact):
            assert torch.equal(layer(x), mod.panel_linear(x, mod.pack_panels(layer.weight.detach()), torch.empty(0), 48))
        torch.testing.assert_close(inexact(x), F.linear(x, inexact.weight), rtol=1e-5, atol=1e-4)
    with torch.no_grad():                             # an in-place update (an optimiser step)
        exact.weight.add_(0.5)
    with torch.inference_mode():                      # the copies are stale: not used
        torch.testing.assert_close(exact(x), F.linear(x, exact.weight, exact.bias), rtol=1e-5, atol=1e-4)


def _attention_reference(q, k_cache, v_cache, tables, lens, block_size, scale, window=0):
    """Per sequence: gather its keys/values through the block table (the last `window` of them
    with a window), plain softmax attention."""
    out = []
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)    # [H, n, D]
        v = v_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)
        p = ((k @ q[b].unsqueeze(-1)).squeeze(-1) * scale).softmax(-1)           # [H, n]
        out.append((p.unsqueeze(1) @ v).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (4, 4, 16), (6, 2, 12), (2, 1, 8), (9, 3, 64), (8, 2, 64)])
def test_paged_decode_attention_equals_gathered_softmax(dtype, heads, kv_heads, dim):
    """Scattered blocks, contexts from 1 slot to several blocks (and not multiples of the SIMD
    width) and to several of the kernel's attention chunks (128 positions: 129, 300, 600),
    large logits (the vectorised exp), every cache dtype the engine offers."""
    g = torch.Generator().manual_seed(heads * 100 + dim)
    block_size, num_blocks = 16, 60
    k_cache = (torch.randn(num_blocks * block_size, kv_heads, dim, generator=g) * 4).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    lens = torch.tensor([1, 7, 16, 33, 100, 129, 300, 600])
    tables = torch.randint(num_blocks, (lens.numel(), 38), generator=g)     # blocks may repeat
    q = torch.randn(lens.numel(), heads, dim, generator=g) * 4
    scale = dim ** -0.5
    got = mod.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, scale)
    torch.testing.assert_close(got, _attention_reference(q, k_cache, v_cache, tables, lens, block_size, scale),
                               rtol=1e-4, atol=1e-5)
    # a sliding window (Gemma 3's local layers): shorter than some contexts, not a block multiple,
    # and across a chunk boundary
    for window in (5, 16, 200):
        got = mod.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, scale, window)
        want = _attention_reference(q, k_cache, v_cache, tables, lens, block_size, scale, window)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_decoder_layer_equals_the_layer_by_layer_path(family_dirs, family, monkeypatch):
    """Decode and multi-row (verification-shaped) steps through the one-call C++ layer give the
    logits of the op-by-op layers (q/k/v bias for Qwen2, per-head q/k norm for Qwen3); and the
    fused path is the one taken by the engine's CPU decode steps."""
    import leapfrog.models.llama as llama
    from leapfrog import LLM, SamplingParams

    calls = []
    real = llama.DecoderLayer.forward_fused
    monkeypatch.setattr(llama.DecoderLayer, "forward_fused", lambda self, *a: calls.append(1) or real(self, *a))
    llm = LLM(str(family_dirs[family]), max_batch_size=4, kv_cache_tokens=512)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [[5, 9, 11, 3, 7], [4, 4, 8], [12, 6, 2, 19, 21, 30, 31]]
    # The whole forward in one C++ call (DecodeLoop.forward) gives the fused layers' bits.
    whole = llm.generate(prompts, params)
    assert not calls, "with the decode loop's forward no layer runs on its own"
    monkeypatch.setattr(llama, "_FORWARD_LOOP", False)
    fused = llm.generate(prompts, params)
    assert calls, "decode steps should run through the fused layer"
    for a, b in zip(whole, fused):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    monkeypatch.setattr(llama, "_FUSED_LAYERS", False)
    calls.clear()
    plain = llm.generate(prompts, params)
    assert not calls
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert abs(la["logprob"] - lb["logprob"]) < 1e-4
            assert [i for i, _ in la["top"]] == [i for i, _ in lb["top"]]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(la["top"], lb["top"]))
    # Weights changed in place (as a training step does): the fused layer's cached weight
    # list must notice, not keep serving the old float16 copies.
    with torch.no_grad():
        for layer in llm.engine.model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.5)
    plain = llm.generate(prompts, params)
    monkeypatch.setattr(llama, "_FUSED_LAYERS", True)
    fused = llm.generate(prompts, params)
    assert calls
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 9, 12, 33, 64, 130])
@pytest.mark.parametrize("n,k", [(4096, 256), (13, 37), (16, 8), (1408, 704), (40, 300)])
def test_panel_linear_equals_torch_and_ignores_its_batch(m, n, k):
    """The packed-panel kernel gives F.linear's result, and a row's output is bit-identical
    whatever rows share its tile (each element summed over k in order): one row (two panels at
    a time), one group of rows, several groups taking the panel in slices of k. Float16 panels
    give exactly the float32 panels' result for the same values."""
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    panels = mod.pack_panels(w)
    assert panels.shape == (-(-n // 16), k, 16) and panels.dtype == torch.float32
    torch.testing.assert_close(mod.panel_linear(x, panels, b, n), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(mod.panel_linear(x, panels, torch.empty(0), n), F.linear(x, w), rtol=1e-5, atol=1e-4)
    full = mod.panel_linear(x, panels, b, n)
    rows = range(0, m, max(1, m // 4))
    alone = torch.stack([mod.panel_linear(x[i:i + 1], panels, b, n)[0] for i in rows])
    assert torch.equal(alone, full[list(rows)])
    w16 = w.half()
    p16 = mod.pack_panels(w16)
    assert p16.dtype == torch.float16
    assert torch.equal(mod.panel_linear(x, p16, b, n), mod.panel_linear(x, mod.pack_panels(w16.float()), b, n))


def test_panel_linear_rejects_panels_of_another_weight():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="packed weight does not match"):
        mod.panel_linear(x, mod.pack_panels(torch.randn(48, 64)), torch.empty(0), 16)   # N too small for 3 panels
    with pytest.raises(RuntimeError, match="packed weight does not match"):
        mod.panel_linear(x, mod.pack_panels(torch.randn(48, 32)), torch.empty(0), 48)


def test_medium_row_counts_use_current_panels_only():
    """compact_cpu_weights packs panels; up to 256 rows go through them (same result as F.linear);
    once the weight changes in place the stale panels are not used."""
    from leapfrog.layers import linear as lin_mod

    layer = Linear(64, 48, bias=True)
    lin_mod.compact_cpu_weights(layer)
    assert lin_mod.kernel_panels(layer) is not None
    x = torch.randn(40, 64)
    with torch.inference_mode():
        y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    assert torch.equal(y, mod.panel_linear(x, lin_mod.kernel_panels(layer), layer.bias, 48))
    with torch.no_grad():
        layer.weight.add_(0.25)
    assert lin_mod.kernel_panels(layer) is None
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_layer_with_panels_equals_the_layer_by_layer_path(family_dirs, threads):
    """A 40-sequence batch (over the few-row kernel's 32 rows: packed panels inside the fused
    layer, and with several threads the layer split by rows, never inside a sequence) gives
    the op-by-op layers' tokens and log-probabilities. The first step prefills prompts of 2-8
    tokens together (168 rows, a sequence's rows reading the keys its other rows wrote), the
    rest decode 40 rows."""
    import leapfrog.models.llama as llama
    from leapfrog import LLM, SamplingParams

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(str(family_dirs["llama"]), max_batch_size=40, kv_cache_tokens=4096)
        assert any(x.dim() == 3 for x in llm.engine.model.model.layers[0]._fused_weights())
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
        prompts = [[5 + i % 20, 9, 11 + i % 7, 3, 8, 2, 6, 1][:2 + i % 7] for i in range(40)]
        assert sum(map(len, prompts)) <= 256
        whole = llm.generate(prompts, params)          # DecodeLoop.forward: whole forwards
        llama._FORWARD_LOOP = False
        try:
            fused = llm.generate(prompts, params)      # decode_layer, one call per layer
            llama._FUSED_LAYERS = False
            plain = llm.generate(prompts, params)
        finally:
            llama._FUSED_LAYERS = llama._FORWARD_LOOP = True
    finally:
        torch.set_num_threads(before)
    for a, b, c in zip(fused, plain, whole):
        assert a.token_ids == b.token_ids == c.token_ids and a.logprobs == c.logprobs
        for la, lb in zip(a.logprobs, b.logprobs):
            assert abs(la["logprob"] - lb["logprob"]) < 1e-4


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A killed build leaves torch's lock file behind, and the next load would wait on it
    forever: locks older than STALE_LOCK_SECONDS are removed, younger ones (a build running in
    another process) are left alone."""
    import time as _time

    from leapfrog.layers import cpu_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory
    lock = Path(_get_build_directory("leapfrog_cpu_test", verbose=False)) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    cpu_kernels._clear_stale_lock("leapfrog_cpu_test")
    assert lock.exists()
    old = _time.time() - cpu_kernels.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    cpu_kernels._clear_stale_lock("leapfrog_cpu_test")
    assert not lock.exists()


def test_a_cpu_without_avx2_gets_the_torch_paths_without_a_build(monkeypatch, capsys):
    """The kernels' vector code needs AVX2 and FMA: elsewhere nothing is compiled (a failing
    build would cost every process a minute), and the reason is said once."""
    import leapfrog.layers.cpu_kernels as ck
    import torch.utils.cpp_extension as ext

    monkeypatch.setattr(ck, "_tried", False)
    monkeypatch.setattr(ck, "_module", None)
    monkeypatch.setattr(ck, "_cpu_flags", lambda: {"sse4_2", "avx", "fma"})
    monkeypatch.setattr(ext, "load", lambda *a, **k: pytest.fail("built on a CPU without AVX2"))
    assert ck.unsupported_cpu() == "they need AVX2 and FMA (this CPU lacks avx2)"
    assert ck.cpu_kernels() is None and ck.cpu_kernels() is None
    assert capsys.readouterr().err.count("lacks avx2") == 1
    monkeypatch.setattr(ck.platform, "machine", lambda: "aarch64")
    assert "x86-64" in ck.unsupported_cpu()
    monkeypatch.setattr(ck.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(ck, "_cpu_flags", lambda: None)        # cannot tell: the build is tried
    assert ck.unsupported_cpu() is None


def test_a_built_module_loads_without_the_extension_builder(tmp_path):
    """Once built, the kernels load straight from the recorded file in a new process: torch's
    extension builder and setuptools stay out of the server's memory. A record pointing at a
    missing or broken file falls back to the builder."""
    import subprocess
    import sys

    from leapfrog.layers import cpu_kernels as ck

    probe = ("import sys; from leapfrog.layers.cpu_kernels import cpu_kernels; m = cpu_kernels(); "
             "print(m is not None, 'torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)")
    env = {**os.environ, "LEAPFROG_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert first.stdout.split() == ["True", "True", "True"]          # no record yet: the builder ran
    records = list((tmp_path / "kernels").glob("*.path"))
    assert len(records) == 1 and Path(records[0].read_text()).is_file()
    second = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert second.stdout.split() == ["True", "False", "False"]
    records[0].write_text(str(tmp_path / "gone.so"))
    assert ck._import_built("leapfrog_cpu_gone", records[0]) is None
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not an ELF file")
    records[0].write_text(str(broken))
    assert ck._import_built("leapfrog_cpu_broken", records[0]) is None
    third = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert third.stdout.split()[0] == "True" and Path(records[0].read_text()).is_file()


def _markov_reference(base, w1, w2t, anchor):
    """Eq. 4 with argmax drafts, position by position in torch."""
    logits, prev, ids = base.clone(), anchor, []
    for k in range(base.shape[1]):
        logits[:, k] += w1[prev] @ w2t
        prev = logits[:, k].argmax(-1)
        ids.append(prev)
    return torch.stack(ids, 1), logits


@pytest.mark.parametrize("threads", [0, 1, 2, 3])
@pytest.mark.parametrize("b,g,v,r", [(1, 8, 4096, 64), (3, 4, 1000, 7), (2, 3, 33, 5), (1, 1, 17, 2)])
@pytest.mark.parametrize("half", [False, True])
def test_markov_argmax_equals_the_position_by_position_stage(threads, b, g, v, r, half):
    """The C++ Markov stage (V split across threads, float16 W2 widened exactly) against the
    torch loop: the same drafts, the same corrected logits."""
    gen = torch.Generator().manual_seed(b * 100 + v + r)
    w1 = torch.randn(v, r, generator=gen)
    w2t = (torch.randn(r, v, generator=gen) * 0.3).half().float()     # exactly float16
    base, anchor = torch.randn(b, g, v, generator=gen), torch.randint(0, v, (b,), generator=gen)
    want_ids, want = _markov_reference(base, w1, w2t, anchor)
    got = base.clone()
    ids = mod.markov_argmax(got, w1, w2t.half() if half else w2t, anchor, threads)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_markov_argmax_breaks_ties_and_nans_as_torch_argmax():
    v = 70                                                   # slices of 32 columns and a tail
    w1, w2t = torch.zeros(v, 4), torch.zeros(4, v)
    base = torch.zeros(1, 3, v)
    base[0, 0, [40, 65]] = 2.0                               # a tie across slices: lowest index
    base[0, 1, 66] = float("nan")                            # NaN wins, as in torch.argmax
    base[0, 2, 5] = base[0, 2, 37] = 1.0
    want = base.argmax(-1)
    for threads in (1, 2, 3):
        assert torch.equal(mod.markov_argmax(base.clone(), w1, w2t, torch.tensor([0]), threads), want)
    with pytest.raises(RuntimeError, match="out of range"):
        mod.markov_argmax(base.clone(), w1, w2t, torch.tensor([v]), 1)
