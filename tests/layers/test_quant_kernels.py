"""The CPU kernels' quantized panels (layers/quant.py, csrc/cpu_math.h): for every GGUF block type
they read, products equal torch's matmul on the weights dequantized by the gguf package, each
row's result the same bits whatever the rows beside it, and a GGUF model's linears get them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from leapfrog.layers.cpu_kernels import cpu_kernels  # noqa: E402
from leapfrog.layers.quant import QUANT_TYPES, quant_panels, unpack_blocks  # noqa: E402

mod = cpu_kernels()
pytestmark = pytest.mark.skipif(mod is None, reason="the C++ CPU kernels did not build")


RANDOM_BLOCKS = ("Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS")


def blocks(kind: str, n: int, k: int, seed: int = 0, k_scale: float | None = None) -> tuple[np.ndarray, torch.Tensor]:
    """(GGUF blocks [n, row bytes], the gguf package's dequantized weights [n, k']). K-quants and
    i-quants (which gguf-py cannot quantize) are random blocks, k' rounded up to their block; with
    a power-of-two `k_scale` as their d (and dmin) every sub-block's factor is exact in float16."""
    rng = np.random.default_rng(seed)
    if k_scale is None:       # weights of a trained model's size (the i-quants' grid runs to 127)
        k_scale = 2.0 ** (-9 if kind.endswith("_K") else -13)
    if kind in RANDOM_BLOCKS:
        per, size = gguf.GGML_QUANT_SIZES[T[kind]]
        k = -(-k // per) * per
        raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
        raw[..., 0:4 if kind.endswith("_K") else 2] = np.array([k_scale, k_scale / 2] if kind.endswith("_K") else [k_scale],
                                                               np.float16).view(np.uint8)
        raw = raw.reshape(n, -1)
    else:
        raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.1).astype(np.float32), T[kind])
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).astype(np.float32))


@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_unpacked_blocks_are_the_dequantized_weights(kind):
    raw, ref = blocks(kind, 5, 64)
    q, d, m = unpack_blocks(kind, raw)
    assert q.shape == ref.shape
    got = d.astype(np.float32).repeat(32, 1) * q.astype(np.float32) + m.astype(np.float32).repeat(32, 1)
    np.testing.assert_allclose(got, ref.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", QUANT_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 33, 100])
def test_products_equal_dequantize_then_matmul(kind, rows):
    n, k = 40, 96                                   # 40 columns: the last panel is padded
    raw, w = blocks(kind, n, k, seed=rows)
    k = w.shape[1]
    panels = quant_panels([(kind, raw)])
    x = torch.randn(rows, k)
    bias = torch.randn(n)
    got = mod.panel_linear(x, panels, bias, n)
    ref = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    for i in (0, rows - 1):                          # a row alone: the same bits as in the batch
        assert torch.equal(mod.panel_linear(x[i:i + 1], panels, bias, n)[0], got[i])


def test_a_packed_linears_shards_stack_their_panels():
    (a, wa), (b, wb) = blocks("Q4_1", 32, 64, 1), blocks("Q4_1", 16, 64, 2)
    panels = quant_panels([("Q4_1", a), ("Q4_1", b)])
    x = torch.randn(3, 64)
    torch.testing.assert_close(mod.panel_linear(x, panels, torch.empty(0), 48), x @ torch.cat([wa, wb]).T,
                               rtol=1e-5, atol=1e-5)
    assert quant_panels([("Q4_1", blocks("Q4_1", 8, 64)[0]), ("Q4_1", b)]) is None        # 8 rows: shared panel
    assert quant_panels([("Q6_K", a)]) is None


def test_shards_of_different_types_share_the_widest_types_panels():
    """A Q4_K_M file's q, k and v come in different types (Q4_K, Q5_0, Q6_K fall-backs): 4-bit and
    8-bit shards are read from one 8-bit panel set, each block still d * q + m."""
    parts = [blocks("Q4_K", 32, 256, 1), blocks("Q8_0", 16, 256, 2), blocks("Q5_0", 16, 256, 3)]
    panels = quant_panels([(kind, raw) for kind, (raw, _) in zip(("Q4_K", "Q8_0", "Q5_0"), parts)])
    x = torch.randn(3, 256)
    w = torch.cat([w for _, w in parts])
    torch.testing.assert_close(mod.panel_linear(x, panels, torch.empty(0), 64), x @ w.T, rtol=1e-5, atol=1e-5)
    four = quant_panels([("Q4_K", parts[0][0]), ("Q4_0", blocks("Q4_0", 16, 256, 4)[0])])
    assert four.shape[-1] == 64 + 32 * 16 // 2                  # all 4-bit: 4-bit panels


def test_k_quant_scales_are_rounded_to_float16_or_left_dequantized():
    """A K-quant sub-block's scale (float16 d times a 6-bit integer) is rounded to float16 for the
    panels: within float16's precision of the file's value. Scales float16 holds only as
    subnormals keep the weight on the dequantized path (no panels)."""
    raw, w = blocks("Q4_K", 16, 256, 5, k_scale=0.0021)
    q, d, m = unpack_blocks("Q4_K", raw)
    got = d.astype(np.float32).repeat(32, 1) * q + m.astype(np.float32).repeat(32, 1)
    assert np.abs(got - w.numpy()).max() <= 2.0 ** -10 * np.abs(w.numpy()).max()
    x = torch.randn(2, 256)
    torch.testing.assert_close(mod.panel_linear(x, quant_panels([("Q4_K", raw)]), torch.empty(0), 16),
                               x @ torch.from_numpy(got).T, rtol=1e-5, atol=1e-5)    # the rounded weights
    tiny, _ = blocks("Q5_K", 16, 256, 6, k_scale=2.0 ** -20)
    assert quant_panels([("Q5_K", tiny)]) is None


@pytest.mark.parametrize("kind", QUANT_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 9, 20])
def test_int8_products_are_llama_cpp_s_scheme(kind, rows):
    """matmul_precision="int8": each block of 32 activations quantized to int8 (scale max|x| / 127,
    round to nearest) and multiplied as integers: equal to the same arithmetic written out in
    torch, near the float32 product, and a row's result the same bits alone or in a batch."""
    from leapfrog.layers.quant import int8_layout
    n, k = 40, 96
    raw, w = blocks(kind, n, k, seed=rows)
    k = w.shape[1]
    q, d, m = unpack_blocks(kind, raw)
    panels = int8_layout(quant_panels([(kind, raw)]))
    assert panels.dtype == torch.int8
    x = torch.randn(rows, k)
    got = mod.panel_linear(x, panels, torch.empty(0), n)
    xb = x.reshape(rows, -1, 32)
    a = xb.abs().amax(-1) / 127
    inv = torch.where(a > 0, 1 / torch.where(a > 0, a, 1), 0)                          # float32, as the kernel
    xq = torch.round(xb * inv[..., None])                                               # [rows, NB, 32]
    qb = torch.from_numpy(q.astype(np.float32)).reshape(n, -1, 32)
    s = torch.einsum("rbk,nbk->rnb", xq.double(), qb.double())                        # exact integer sums
    ref = (torch.from_numpy(d.astype(np.float32)).double()[None] * s * a.double()[:, None]
           + torch.from_numpy(m.astype(np.float32)).double()[None] * (a * xq.sum(-1)).double()[:, None]).sum(-1)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    exact = x @ w.T
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()
    for i in (0, rows - 1):
        assert torch.equal(mod.panel_linear(x[i:i + 1], panels, torch.empty(0), n)[0], got[i])


def test_int8_products_hold_at_the_extremes():
    """8-bit weights at both ends (-128 and 127) against activations at full scale, neighbours
    alike: the AVX2 route's 16-bit pair sums must not saturate (and VNNI's are 32-bit anyway)."""
    from leapfrog.layers.quant import int8_layout
    n, k = 16, 64
    vals = np.where(np.arange(n * k).reshape(n, k) % 3 == 0, 127, -128).astype(np.int8)
    raw = np.zeros((n, k // 32, 34), np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw[..., 2:] = vals.reshape(n, k // 32, 32).view(np.uint8)
    raw = raw.reshape(n, -1)
    panels = int8_layout(quant_panels([("Q8_0", raw)]))
    w = torch.from_numpy(vals.astype(np.float32)) * float(np.float16(0.01))
    for x in (torch.full((2, k), 3.0), torch.full((2, k), -3.0), torch.tensor([1.0, -1.0]).repeat(2, k // 2)):
        got = mod.panel_linear(x, panels, torch.empty(0), n)
        torch.testing.assert_close(got, x @ w.T, rtol=1e-4, atol=1e-4)


def cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_amx_is_used_only_where_the_cpu_has_it():
    assert not mod.amx_available() or {"amx_tile", "amx_int8"} <= cpu_flags()


@pytest.mark.skipif(mod is None or not mod.amx_available(),
                    reason="needs AMX-INT8 with the tile state granted by the OS (arch_prctl)")
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q5_K", "IQ4_XS"])
@pytest.mark.parametrize("rows", [4, 8, 16, 17, 40])
def test_amx_tiles_give_the_vnni_tiles_bits(kind, rows):
    """Products of 4 rows or more run on AMX tiles where the OS grants them: the same bits as the
    VNNI tile, for 4- and 8-bit panels, an odd number of blocks and more rows than a tile holds."""
    from leapfrog.layers.quant import int8_layout
    n, k = 40, 96
    raw, w = blocks(kind, n, k, seed=rows)
    k = w.shape[1]
    panels = int8_layout(quant_panels([(kind, raw)]))
    x = torch.randn(rows, k)
    try:
        amx = mod.panel_linear(x, panels, torch.empty(0), n)
        mod.set_amx_products(False)
        vnni = mod.panel_linear(x, panels, torch.empty(0), n)
    finally:
        mod.set_amx_products(True)
    assert torch.equal(amx, vnni)
    assert (amx - x @ w.T).abs().max() <= 0.02 * (x @ w.T).abs().max()


def test_the_avx2_build_passes_these_tests_too():
    """On a CPU with AVX-512 the kernels' AVX2 paths (those of an AVX2-only machine, int8 products
    included) are built apart (LEAPFROG_CPU_ISA=avx2) and run through this file's tests."""
    import os
    import subprocess
    import sys
    if "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU's own build is the AVX2 one: the tests above ran it")
    env = {**os.environ, "LEAPFROG_CPU_ISA": "avx2"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", __file__,
                          "-k", "not avx2_build and not amx_tiles"], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.lower(), run.stdout[-1000:]


def test_int8_products_run_at_speed_on_avx2_and_wider():
    if " avx2" in open("/proc/cpuinfo").read():
        assert mod.int8_dot_available()


def test_the_loader_asks_int8_products_for_exactly_the_types_the_kernels_read():
    from leapfrog.checkpoint.gguf import KERNEL_TYPES
    assert set(KERNEL_TYPES) == set(QUANT_TYPES)


def test_requantized_panels_move_each_weight_by_at_most_half_a_step():
    from leapfrog.layers.quant import requantized_panels
    raw, w = blocks("Q4_K", 24, 256, 7, k_scale=0.0021)        # any float weight will do
    w[3, 32:64] = 0                                            # an all-zero block
    panels = requantized_panels(w)
    q = panels[..., 64:].reshape(2, 8, 32, 16).permute(0, 3, 1, 2).reshape(32, 256)[:24].float()
    d = panels[..., :32].contiguous().view(torch.float16).float().permute(0, 2, 1).reshape(32, 8)[:24]
    back = (q - 128) * d.repeat_interleave(32, 1)
    assert ((back - w).abs() <= d.repeat_interleave(32, 1) / 2 + 1e-7).all()
    assert (back[3, 32:64] == 0).all()
    x = torch.randn(3, 256)
    torch.testing.assert_close(mod.panel_linear(x, panels, torch.empty(0), 24), x @ back.T, rtol=1e-5, atol=1e-5)
