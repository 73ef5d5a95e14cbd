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


def blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(w, T[kind])
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).astype(np.float32))


@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_unpacked_blocks_are_the_dequantized_weights(kind):
    raw, ref = blocks(kind, 5, 64)
    q, d, m = unpack_blocks(kind, raw)
    got = d.astype(np.float32).repeat(32, 1) * q.astype(np.float32) + m.astype(np.float32).repeat(32, 1)
    np.testing.assert_allclose(got, ref.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", QUANT_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 33, 100])
def test_products_equal_dequantize_then_matmul(kind, rows):
    n, k = 40, 96                                   # 40 columns: the last panel is padded
    raw, w = blocks(kind, n, k, seed=rows)
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
    assert quant_panels([("Q4_1", a), ("Q8_0", blocks("Q8_0", 16, 64)[0])]) is None      # mixed types
    assert quant_panels([("Q4_1", blocks("Q4_1", 8, 64)[0]), ("Q4_1", b)]) is None        # 8 rows: shared panel
    assert quant_panels([("Q6_K", a)]) is None


@pytest.mark.parametrize("kind", QUANT_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 9, 20])
def test_int8_products_are_llama_cpp_s_scheme(kind, rows):
    """matmul_precision="int8": each block of 32 activations quantized to int8 (scale max|x| / 127,
    round to nearest) and multiplied as integers: equal to the same arithmetic written out in
    torch, near the float32 product, and a row's result the same bits alone or in a batch."""
    from leapfrog.layers.quant import int8_layout
    n, k = 40, 96
    raw, w = blocks(kind, n, k, seed=rows)
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
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("rows", [4, 8, 16, 17, 40])
def test_amx_tiles_give_the_vnni_tiles_bits(kind, rows):
    """Products of 4 rows or more run on AMX tiles where the OS grants them: the same bits as the
    VNNI tile, for 4- and 8-bit panels, an odd number of blocks and more rows than a tile holds."""
    from leapfrog.layers.quant import int8_layout
    n, k = 40, 96
    raw, w = blocks(kind, n, k, seed=rows)
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
