// Decode attention straight from the paged KV cache, for CPUs.
//
// One query token per sequence attends to its whole context, reading keys and values slot
// by slot through the block table. This avoids materialising a gathered [B, L, KVH, D] copy
// of the cache per layer and the poor efficiency of SDPA on [B, H, 1, D] queries, which
// together dominate batched decoding on a CPU. CUDA uses SDPA / flash-attn instead.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

using namespace lf;

// Work (multiply-adds) below which a kernel runs on the calling thread alone. Waking OpenMP
// workers costs tens of microseconds with passive waiting (which leapfrog sets, because
// spinning workers are ruinous on a shared CPU): more than a decode step's small products take.
static constexpr int64_t kMinParallelWork = 1 << 21;

// A few-row product is split across threads from this much work on: two threads stream a
// weight at up to twice the bandwidth of one, which outweighs waking the second.
static constexpr int64_t kStreamedParallelWork = 1 << 16;

static inline int64_t grain_for(int64_t work_per_item, int64_t min_work = kMinParallelWork) {
  return std::max<int64_t>(1, min_work / std::max<int64_t>(1, work_per_item));
}

// One task per (sequence, query head); online over the context: scores, softmax, weighted sum.
template <typename scalar_t>
static void decode_kernel(const float* q, const scalar_t* k, const scalar_t* v,
                          const int64_t* tables, const int64_t* ctx_lens, float* out,
                          int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                          int64_t block_size, float scale, int64_t window) {
  const int64_t group = H / KVH;
  int64_t total_ctx = 0;
  for (int64_t b = 0; b < B; ++b) total_ctx += ctx_lens[b];
  const int64_t grain = grain_for(2 * D * std::max<int64_t>(1, total_ctx / std::max<int64_t>(1, B)));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, g = h / group;
      const int64_t n = ctx_lens[b], p0 = window_start(n, window);
      const float* qv = q + (b * H + h) * D;
      const int64_t* table = tables + b * max_blocks;
      scores.assign(n, 0.f);
      float mx = -INFINITY;
      for (int64_t p = p0; p < n; ++p) {
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        const scalar_t* kv = k + (slot * KVH + g) * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qv[d] * static_cast<float>(kv[d]);
        s *= scale;
        scores[p] = s;
        mx = s > mx ? s : mx;
      }
      float denom = 0.f;
      for (int64_t p = p0; p < n; ++p) {
        scores[p] = std::exp(scores[p] - mx);
        denom += scores[p];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = p0; p < n; ++p) {
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        const scalar_t* vv = v + (slot * KVH + g) * D;
        const float w = scores[p];
        float* a = acc.data();
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<float>(vv[d]);
      }
      float* o = out + (b * H + h) * D;
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
    }
  });
}

#if defined(LEAPFROG_AVX2)
// Float32 (or, with F16C, float16) caches with D a multiple of 8 (every model we serve): one task
// per (sequence, KV head) walks its slots once, in order, and serves every query head of the
// group from each key and value row (attend_group in cpu_math.h). A large batch's decode step
// reads far more KV than L3 holds, so reading each cache line once and sequentially is what
// counts.
template <typename kv_t>
static void decode_kernel_gqa(const float* q, const kv_t* k, const kv_t* v,
                              const int64_t* tables, const int64_t* ctx_lens, float* out,
                              int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                              int64_t block_size, float scale, int64_t window) {
  const int64_t group = H / KVH;
  int64_t total_ctx = 0;
  for (int64_t b = 0; b < B; ++b) total_ctx += ctx_lens[b] - window_start(ctx_lens[b], window);
  const int64_t grain = grain_for(2 * D * group * std::max<int64_t>(1, total_ctx / std::max<int64_t>(1, B)));
  at::parallel_for(0, B * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t bg = begin; bg < end; ++bg) {
      // rows taken first, last, second, second-to-last...: a thread's range of tasks mixes the
      // short and long contexts of a prompt's causal rows instead of holding all the long ones
      const int64_t j = bg / KVH, g = bg % KVH, b = j % 2 == 0 ? j / 2 : B - 1 - j / 2;
      const int64_t start = window_start(ctx_lens[b], window), n = ctx_lens[b] - start;
      scratch.resize(attn_scratch_floats(n, group, D));
      attend_group(q + b * H * D, k, v, tables + b * max_blocks, n, block_size, KVH, D, g, group,
                   scale, out + b * H * D, scratch.data(), start);
    }
  });
}
#endif

// q: [B, H, D] float32; k_cache, v_cache: [S, KVH, D]; block_tables: [B, MB] int64;
// ctx_lens: [B] int64 (>= 1); window > 0: each row sees its last `window` keys only (a sliding
// window's layer). Returns [B, H, D] float32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens,
                                     int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3, "q must be [B,H,D], caches [S,KVH,D]");
  auto qf = q.to(torch::kFloat32).contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = ctx_lens.to(torch::kInt64).contiguous();
  const int64_t B = qf.size(0), H = qf.size(1), D = qf.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D, "head layout mismatch");
  auto out = torch::empty({B, H, D}, qf.options());
#if defined(LEAPFROG_AVX2)
  const bool simd_ok = D % 8 == 0 && k_cache.is_contiguous() && v_cache.is_contiguous();
  if (simd_ok && k_cache.scalar_type() == torch::kFloat32) {
    decode_kernel_gqa<float>(qf.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                             tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                             B, H, KVH, D, tables.size(1), block_size, static_cast<float>(scale), window);
    return out;
  }
#if defined(__F16C__)
  if (simd_ok && k_cache.scalar_type() == torch::kHalf) {
    decode_kernel_gqa<at::Half>(qf.data_ptr<float>(), k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(),
                                tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                                B, H, KVH, D, tables.size(1), block_size, static_cast<float>(scale), window);
    return out;
  }
#endif
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(qf.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                            B, H, KVH, D, tables.size(1), block_size, static_cast<float>(scale), window);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Skinny matmul y[M, N] = x[M, K] . w[N, K]^T for a few rows (decode, draft verification).
//
// For 2 <= M <= 32 the BLAS kernel streams the weights again for every few rows of x, so a
// verify step costs several decode steps. Here each weight row is read once into L1 and used
// for every row of x (which stays in L1/L2): cost ~ one weight read.

// One row of x against each weight row (dot_row in cpu_math.h): each weight row is read once
// from memory for all rows of x, and a sequence's logits do not depend on how many rows its
// step has, so greedy speculative decoding, which verifies in steps of several rows, stays
// token for token equal to greedy decoding one row a step.
template <typename wt>
static void skinny_kernel(const float* x, const wt* w, const float* bias, float* y,
                          int64_t M, int64_t N, int64_t K) {
  const bool pair = N * K * static_cast<int64_t>(sizeof(wt)) <= kPairRowsMaxBytes;
  at::parallel_for(0, N, grain_for(M * K, kStreamedParallelWork), [&](int64_t n0, int64_t n1) {
    dot_rows(x, M, w, bias, y, N, n0, n1, K, pair);
  });
}

// x: [M, K] float32, w: [N, K] float32 or float16 (widened exactly in the kernel, so a
// float16 checkpoint is computed as if loaded in float32 while half the bytes stream from
// memory), bias: [N] float32 or empty. Returns [M, N] float32.
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M,K], w [N,K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "skinny_linear: x must be float32");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kHalf,
              "skinny_linear: w must be float32 or float16");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const bool has_bias = bias.defined() && bias.numel() == N;
  auto bc = has_bias ? bias.to(torch::kFloat32).contiguous() : bias;
  const float* bp = has_bias ? bc.data_ptr<float>() : nullptr;
  if (wc.scalar_type() == torch::kHalf)
    skinny_kernel<at::Half>(xc.data_ptr<float>(), wc.data_ptr<at::Half>(), bp, y.data_ptr<float>(), M, N, K);
  else
    skinny_kernel<float>(xc.data_ptr<float>(), wc.data_ptr<float>(), bp, y.data_ptr<float>(), M, N, K);
  return y;
}

// ---------------------------------------------------------------------------------------------
// Products from packed column panels (cpu_math.h, panel_rows): panel p holds output columns
// 16p..16p+15 as [K][16] values, float16 for a float16-exact weight (half the bytes to stream)
// or float32. One kernel for every row count a decode, verify or batched step has: each output
// is summed over k in order whatever the rows, so a row's result does not depend on its batch.
// BLAS does these shapes at ~35% of this CPU's float32 peak (its blocking is tuned for large
// products) and the row-major few-row kernel at about a third for 9 rows.
torch::Tensor pack_panels(torch::Tensor w, bool bf16) {
  TORCH_CHECK(w.dim() == 2, "pack_panels: w must be [N, K]");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kHalf,
              "pack_panels: w must be float32 or float16");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + kPanel - 1) / kPanel;
  if (bf16) {
    // [N, K] -> zero rows up to 16P and a zero column to an even K -> [P, 16, K2, 2] ->
    // [P, K2, 16, 2], rounded to bfloat16 (cpu_math.h, panel_rows_bf16)
    const int64_t K2 = (K + 1) / 2;
    auto padded = torch::zeros({P * kPanel, 2 * K2}, wc.options().dtype(torch::kBFloat16));
    padded.narrow(0, 0, N).narrow(1, 0, K).copy_(wc);     // rounded to nearest even here
    return padded.view({P, kPanel, K2, 2}).permute({0, 2, 1, 3}).contiguous().view({P, K2, 2 * kPanel});
  }
  // [N, K] -> zero rows up to 16P -> [P, 16, K] -> [P, K, 16]
  auto padded = torch::zeros({P * kPanel, K}, wc.options());
  padded.narrow(0, 0, N).copy_(wc);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

// Whether packed panels wp fit x [M, K] and N outputs: [P, K, 16] float32 or float16, or
// [P, ceil(K/2), 32] bfloat16.
static bool panels_match(const torch::Tensor& wp, int64_t K, int64_t N) {
  if (wp.dim() != 3 || !wp.is_contiguous() || wp.size(0) * kPanel < N || (wp.size(0) - 1) * kPanel >= N) return false;
  if (wp.scalar_type() == torch::kUInt8 || wp.scalar_type() == torch::kChar)   // quantized: [P, K / 32, bytes]
    return K % kQBlock == 0 && wp.size(1) == K / kQBlock && q_panel_bits(wp.size(2)) != 0;
  if (wp.scalar_type() == torch::kBFloat16) return wp.size(1) == (K + 1) / 2 && wp.size(2) == 2 * kPanel;
  return (wp.scalar_type() == torch::kFloat32 || wp.scalar_type() == torch::kHalf) && wp.size(1) == K &&
         wp.size(2) == kPanel;
}

// Rows per task of a panel product: tasks are (panel, row chunk), panel-major, so a thread's
// consecutive tasks reuse the panel it just read; few-row products are split by panels alone.
static constexpr int64_t kPanelChunkRows = 10 * kPanelTileRows;

// x: [M, K] float32; wp: pack_panels(w) for w [N, K]; bias: [N] or empty. Returns [M, N].
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "panel_linear: x must be [M, K] float32");
  TORCH_CHECK(panels_match(wp, x.size(1), N), "panel_linear: packed weight does not match x");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = wp.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const bool has_bias = bias.defined() && bias.numel() == N;
  auto bc = has_bias ? bias.to(torch::kFloat32).contiguous() : bias;
  const float* bp = has_bias ? bc.data_ptr<float>() : nullptr;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t RB = (M + kPanelChunkRows - 1) / kPanelChunkRows;
  // Tasks (panel, chunk of rows), panel-major; rows_fn(m0, rows, p, p1) computes a chunk's
  // rows over panels p..p1-1 (consecutive panels of one chunk together: one row, the
  // two-panel kernel).
  auto tasks = [&](auto&& rows_fn) {
    at::parallel_for(0, P * RB, grain_for(std::min(M, kPanelChunkRows) * kPanel * K, kStreamedParallelWork),
                     [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1;) {
        const int64_t p = t / RB, c = t % RB, m0 = c * kPanelChunkRows;
        const int64_t rows = std::min<int64_t>(kPanelChunkRows, M - m0);
        int64_t p1 = p + 1;
        while (RB == 1 && t + (p1 - p) < t1 && p1 < P) ++p1;
        rows_fn(m0, rows, p, p1);
        t += p1 - p;
      }
    });
  };
  auto run = [&](auto* panels) {
    tasks([&](int64_t m0, int64_t rows, int64_t p, int64_t p1) {
      panel_rows(xp + m0 * K, rows, K, panels, p, p1, bp, yp + m0 * N, N, N);
    });
  };
  if (wp.scalar_type() == torch::kUInt8 || wp.scalar_type() == torch::kChar) {
    const uint8_t* panels = reinterpret_cast<const uint8_t*>(wp.data_ptr());
    const int64_t bytes = wp.size(2);
    const bool int8 = wp.scalar_type() == torch::kChar;
    QRows xq;                        // the rows quantized once for every task
    if (int8) q8_rows(xp, K, M, K, xq);
    tasks([&](int64_t m0, int64_t rows, int64_t p, int64_t p1) {
      if (int8) q_panel_rows_int8(xq, m0, rows, K, panels, bytes, p, p1, bp, yp + m0 * N, N, N);
      else q_panel_rows(xp + m0 * K, rows, K, panels, bytes, p, p1, bp, yp + m0 * N, N, N);
    });
  } else if (wp.scalar_type() == torch::kBFloat16) {
    // the rows rounded to bfloat16 pairs once, then the same tasks over the bfloat16 panels
    const int64_t K2 = (K + 1) / 2;
    std::vector<uint32_t> pairs(M * K2);
    bf16_pairs(xp, K, M, K, pairs.data());
    const uint16_t* panels = reinterpret_cast<const uint16_t*>(wp.data_ptr());
    tasks([&](int64_t m0, int64_t rows, int64_t p, int64_t p1) {
      panel_rows_bf16(pairs.data() + m0 * K2, rows, K2, panels, p, p1, bp, yp + m0 * N, N, N);
    });
  } else if (wp.scalar_type() == torch::kHalf) {
    run(wp.data_ptr<at::Half>());
  } else {
    run(wp.data_ptr<float>());
  }
  return y;
}

// Rows ids of a weight held in quantized panels ([P, NB, bytes per block], uint8 or int8 layout),
// dequantized: [n, 32 NB] float32 (an embedding lookup in a table kept as its blocks).
torch::Tensor panel_rows_gather(torch::Tensor panels, torch::Tensor ids) {
  TORCH_CHECK(panels.dim() == 3 && (panels.scalar_type() == torch::kUInt8 || panels.scalar_type() == torch::kChar) &&
              q_panel_bits(panels.size(2)) != 0, "panel_rows_gather: panels must be quantized panels");
  auto pc = panels.contiguous();
  auto ic = ids.reshape(-1).to(torch::kLong).contiguous();
  const int64_t n = ic.numel(), NB = pc.size(1), rows = pc.size(0) * kPanel;
  auto out = torch::empty({n, NB * kQBlock}, torch::kFloat32);
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "panel_rows_gather: index ", ip[i], " out of range");
  const uint8_t* pp = reinterpret_cast<const uint8_t*>(pc.data_ptr());
  const bool int8 = pc.scalar_type() == torch::kChar;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) q_panel_row(pp, pc.size(2), int8, NB, ip[i], op + i * NB * kQBlock);
  });
  return out;
}

// RMSNorm over the last dimension, float32: one pass for the mean square, one for the scale.
// torch's CPU rms_norm is several kernels; this is one pass per row.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "float32 only");
  auto xc = x.contiguous();
  const int64_t D = w.numel(), R = xc.numel() / D;
  TORCH_CHECK(xc.size(-1) == D, "rms_norm: last dimension must match the weight");
  auto y = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, grain_for(2 * D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(xp + r * D, wp, yp + r * D, D, static_cast<float>(eps));
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// One whole Llama-family decoder layer for a step's query rows on a CPU (decode batches, draft
// verification, diffusion canvases): the same arithmetic as the layer-by-layer path (the
// kernels above plus RoPE, the KV write and SwiGLU written out here), in one call instead of
// ~20 small torch ops, whose dispatch costs more than the arithmetic at this size.
//
// w: {input_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, post_norm, gate_up_w, gate_up_b,
//     down_w, down_b}; biases and q/k norms may be empty. x: [T, d] float32; cos, sin: [T, rot];
// slots: [T] cache slot written by each row; tables/ctx_lens: one kernel row per query row.
static inline void rms_inplace(float* v, const float* w, int64_t n, float eps) { rms_row(v, w, v, n, eps); }

// The fused layers' weights: w[0..11] as documented at decode_layer, then optionally the
// float32 weights of the four projections (w[12..15]: qkv, o, gate_up, down) for steps of more
// than kSkinnyRows rows, which go to BLAS (the few-row kernel's w[1], w[5], w[8], w[10] may be
// float16 copies).
static constexpr int64_t kSkinnyRows = 32;

// w[16..19], when present: the same four weights packed for panel_linear (empty where not
// packed), used for every step of up to kPanelRows rows: one kernel, so a row's sums are the
// same whatever the batch (a one-row decode step, a verify step, a batch of 64).
static constexpr int64_t kPanelRows = 256;

static torch::Tensor project(const torch::Tensor& x, const std::vector<torch::Tensor>& w, int64_t i,
                             int64_t f32_index) {
  const int64_t packed = f32_index + 4;
  // quantized panels (GGUF blocks) serve every row count: their layer keeps no float32 weights
  const bool quantized = w.size() == 20 && (w[packed].scalar_type() == torch::kUInt8 ||
                                            w[packed].scalar_type() == torch::kChar);
  if ((x.size(0) <= kPanelRows || quantized) && w.size() == 20 && w[packed].dim() == 3)
    return panel_linear(x, w[packed], w[i + 1], w[f32_index].size(0));
  if (x.size(0) > kSkinnyRows && w.size() >= 16) {
    const auto& b = w[i + 1];
    return b.numel() ? at::linear(x, w[f32_index], b) : at::linear(x, w[f32_index]);
  }
  return skinny_linear(x, w[i], w[i + 1]);
}

// Input norm, packed q/k/v, per-head q/k norm and RoPE: the [T, (H + 2 KVH) D] projections
// with q and k rotated in place.
static torch::Tensor qkv_rope(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                              const torch::Tensor& cos, const torch::Tensor& sin, int64_t H,
                              int64_t KVH, int64_t D, double eps, double qk_eps) {
  TORCH_CHECK(w.size() == 12 || w.size() == 16 || w.size() == 20, "fused layer: 12, 16 or 20 weight tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "fused layer: x must be [T, d] float32");
  const int64_t T = x.size(0), width = (H + 2 * KVH) * D;
  auto qkv = project(rms_norm(x, w[0], eps), w, 1, 12);
  TORCH_CHECK(qkv.size(1) == width, "fused layer: qkv width mismatch");
  float* p = qkv.data_ptr<float>();
  auto cs = cos.to(torch::kFloat32).contiguous(), sn = sin.to(torch::kFloat32).contiguous();
  const int64_t rot = cs.size(-1), half = rot / 2;
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  const bool qk_norm = w[3].numel() == D && w[4].numel() == D;
  const float* qn = qk_norm ? w[3].data_ptr<float>() : nullptr;
  const float* kn = qk_norm ? w[4].data_ptr<float>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cp + t * rot;
    const float* si = sp + t * rot;
    for (int64_t hd = 0; hd < H + KVH; ++hd) {
      float* v = p + t * width + hd * D;
      if (qk_norm) rms_inplace(v, hd < H ? qn : kn, D, static_cast<float>(qk_eps));
      rope_head(v, c, si, half);
    }
  }
  return qkv;
}

// Post norm, gate/up, SwiGLU and down: the MLP's output, without the residual.
static torch::Tensor norm_swiglu(const torch::Tensor& x, const std::vector<torch::Tensor>& w, double eps) {
  const int64_t T = x.size(0);
  auto gu = project(rms_norm(x, w[7], eps), w, 8, 14);
  const int64_t I = gu.size(1) / 2;
  auto act = torch::empty({T, I}, gu.options());
  const float* g = gu.data_ptr<float>();
  float* a = act.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) silu_mul(g + t * 2 * I, g + t * 2 * I + I, a + t * I, I);
  return project(act, w, 10, 15);
}

// Output projection and residual, then post norm, SwiGLU and residual.
static torch::Tensor out_mlp(const torch::Tensor& x, const torch::Tensor& o,
                             const std::vector<torch::Tensor>& w, double eps) {
  auto x2 = x + project(o.reshape({x.size(0), -1}), w, 5, 13);
  return x2.add_(norm_swiglu(x2, w, eps));
}

static torch::Tensor attend_rows(const torch::Tensor& qkv, torch::Tensor& k_cache, torch::Tensor& v_cache,
                                 const torch::Tensor& slots, const torch::Tensor& block_tables,
                                 const torch::Tensor& ctx_lens, int64_t block_size, int64_t H, int64_t KVH,
                                 int64_t D, double scale);

// The attention half of a layer: input norm, q/k/v with RoPE, the step's keys and values
// written to the paged cache, attention over it. Returns the heads' outputs [T, H, D].
static torch::Tensor attention_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                                    const torch::Tensor& cos, const torch::Tensor& sin,
                                    torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots,
                                    const torch::Tensor& block_tables, const torch::Tensor& ctx_lens,
                                    int64_t block_size, int64_t H, int64_t KVH, int64_t D, double scale,
                                    double eps, double qk_eps) {
  auto qkv = qkv_rope(x, w, cos, sin, H, KVH, D, eps, qk_eps);
  return attend_rows(qkv, k_cache, v_cache, slots, block_tables, ctx_lens, block_size, H, KVH, D, scale);
}

// The step's keys and values (qkv [T, (H + 2 KVH) D], rotated) written to the paged cache, then
// every row's attention over its context. Returns the heads' outputs [T, H, D].
static torch::Tensor attend_rows(const torch::Tensor& qkv, torch::Tensor& k_cache, torch::Tensor& v_cache,
                                 const torch::Tensor& slots, const torch::Tensor& block_tables,
                                 const torch::Tensor& ctx_lens, int64_t block_size, int64_t H, int64_t KVH,
                                 int64_t D, double scale) {
  const int64_t T = qkv.size(0), width = qkv.size(1);
  const float* p = qkv.data_ptr<float>();
  auto sl = slots.to(torch::kInt64).contiguous();
  const int64_t* slp = sl.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "decode_layer_kv", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      const float* kr = p + t * width + H * D;
      const float* vr = kr + KVH * D;
      scalar_t* kd = kc + slp[t] * KVH * D;
      scalar_t* vd = vc + slp[t] * KVH * D;
      for (int64_t i = 0; i < KVH * D; ++i) {
        kd[i] = static_cast<scalar_t>(kr[i]);
        vd[i] = static_cast<scalar_t>(vr[i]);
      }
    }
  });
  auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
  return paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, block_size, scale, 0);
}

static torch::Tensor layer_rows(const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                                const torch::Tensor& cos, const torch::Tensor& sin,
                                torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots,
                                const torch::Tensor& block_tables, const torch::Tensor& ctx_lens,
                                int64_t block_size, int64_t H, int64_t KVH, int64_t D, double scale,
                                double eps, double qk_eps) {
  auto o = attention_rows(x, w, cos, sin, k_cache, v_cache, slots, block_tables, ctx_lens, block_size,
                          H, KVH, D, scale, eps, qk_eps);
  return out_mlp(x, o, w, eps);
}

// A tensor-parallel rank's share of a layer, cut where the ranks' partial sums meet: its heads'
// attention through its columns of the output projection (attention_partial), then, after the
// caller's all-reduce and residual, its columns of gate/up through its rows of down
// (mlp_partial). Each returns the rank's partial sum [T, d], to be all-reduced. The weights are
// decode_layer's, of the rank's shard; a row-parallel bias is on one rank only.
torch::Tensor attention_partial(torch::Tensor x, std::vector<torch::Tensor> w, torch::Tensor cos,
                                torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor slots, torch::Tensor block_tables, torch::Tensor ctx_lens,
                                int64_t block_size, int64_t H, int64_t KVH, int64_t D, double scale,
                                double eps, double qk_eps) {
  auto o = attention_rows(x, w, cos, sin, k_cache, v_cache, slots, block_tables, ctx_lens, block_size,
                          H, KVH, D, scale, eps, qk_eps);
  return project(o.reshape({x.size(0), -1}), w, 5, 13);
}

torch::Tensor mlp_partial(torch::Tensor x, std::vector<torch::Tensor> w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "mlp_partial: x must be [T, d] float32");
  return norm_swiglu(x, w, eps);
}

// One Llama-family decoder layer over a step's query rows. A batch of kSkinnyRows + 1 to
// kPanelRows rows with packed panels is split by rows, one slice per thread, each running the
// whole layer (no sequence is cut: its rows' keys are written and read by the same thread), so
// the layer is one parallel region instead of one per product and the attention: with passive
// OpenMP waiting each region wakes the workers again, which cost a 64-row step ~30%.
torch::Tensor decode_layer(torch::Tensor x, std::vector<torch::Tensor> w, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor slots, torch::Tensor block_tables, torch::Tensor ctx_lens,
                           int64_t block_size, int64_t H, int64_t KVH, int64_t D, double scale,
                           double eps, double qk_eps) {
  const int64_t T = x.size(0), threads = at::get_num_threads();
  const bool split = threads > 1 && T > kSkinnyRows && T <= kPanelRows && w.size() == 20 &&
                     w[16].dim() == 3 && w[17].dim() == 3 && w[18].dim() == 3 && w[19].dim() == 3;
  std::vector<int64_t> cuts{0};
  if (split) {
    auto tables = block_tables.to(torch::kInt64).contiguous();
    const int64_t mb = tables.size(1);
    const int64_t* tp = tables.data_ptr<int64_t>();
    auto same_seq = [&](int64_t r) {     // rows r-1 and r read one sequence's blocks
      return std::equal(tp + (r - 1) * mb, tp + r * mb, tp + r * mb);
    };
    for (int64_t i = 1; i < threads; ++i) {
      int64_t r = std::max(cuts.back() + 1, T * i / threads);
      while (r < T && same_seq(r)) ++r;
      if (r < T) cuts.push_back(r);
    }
  }
  cuts.push_back(T);
  if (cuts.size() <= 2)
    return layer_rows(x, w, cos, sin, k_cache, v_cache, slots, block_tables, ctx_lens, block_size,
                      H, KVH, D, scale, eps, qk_eps);
  auto out = torch::empty_like(x);
  const int64_t parts = static_cast<int64_t>(cuts.size()) - 1;
  const at::ThreadLocalState state;     // inference mode etc. for the worker threads
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r0 = cuts[p], n = cuts[p + 1] - cuts[p];
      out.narrow(0, r0, n).copy_(layer_rows(
          x.narrow(0, r0, n), w, cos.narrow(0, r0, n), sin.narrow(0, r0, n), k_cache, v_cache,
          slots.narrow(0, r0, n), block_tables.narrow(0, r0, n), ctx_lens.narrow(0, r0, n),
          block_size, H, KVH, D, scale, eps, qk_eps));
    }
  });
  return out;
}

// A two-stream block-diffusion layer (models/mask_stream.py): rows [0, num_own) run the model's
// own weights, the rest the mask stream's (`w_mask`, the same layout), over one shared cache.
// Every row's key and value is written before any row attends, so a row reads the step's keys
// of both streams; the rows come regrouped by stream, each with its own context length.
torch::Tensor two_stream_layer(torch::Tensor x, std::vector<torch::Tensor> w_own,
                               std::vector<torch::Tensor> w_mask, int64_t num_own, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slots, torch::Tensor block_tables, torch::Tensor ctx_lens,
                               int64_t block_size, int64_t H, int64_t KVH, int64_t D, double scale,
                               double eps, double qk_eps) {
  const int64_t T = x.size(0), k = num_own;
  TORCH_CHECK(0 <= k && k <= T, "two_stream_layer: num_own out of range");
  std::vector<torch::Tensor> parts;
  if (k > 0)
    parts.push_back(qkv_rope(x.narrow(0, 0, k), w_own, cos.narrow(0, 0, k), sin.narrow(0, 0, k),
                             H, KVH, D, eps, qk_eps));
  if (k < T)
    parts.push_back(qkv_rope(x.narrow(0, k, T - k), w_mask, cos.narrow(0, k, T - k),
                             sin.narrow(0, k, T - k), H, KVH, D, eps, qk_eps));
  auto qkv = parts.size() == 1 ? parts[0] : torch::cat(parts);
  auto o = attend_rows(qkv, k_cache, v_cache, slots, block_tables, ctx_lens, block_size, H, KVH, D,
                       scale).reshape({T, -1});
  std::vector<torch::Tensor> out;
  if (k > 0) out.push_back(out_mlp(x.narrow(0, 0, k), o.narrow(0, 0, k), w_own, eps));
  if (k < T) out.push_back(out_mlp(x.narrow(0, k, T - k), o.narrow(0, k, T - k), w_mask, eps));
  return out.size() == 1 ? out[0] : torch::cat(out);
}

// A DFlash/DSpark drafter layer for one sequence: its T block rows attend, without a causal
// mask, to the n context keys/values (ctx_k, ctx_v: [n, KVH, D] float32) and to the block's
// own keys; no cache is written.
torch::Tensor draft_layer(torch::Tensor x, std::vector<torch::Tensor> w, torch::Tensor cos,
                          torch::Tensor sin, torch::Tensor ctx_k, torch::Tensor ctx_v, int64_t H,
                          int64_t KVH, int64_t D, double scale, double eps, double qk_eps) {
  auto qkv = qkv_rope(x, w, cos, sin, H, KVH, D, eps, qk_eps);
  const int64_t T = x.size(0), n = ctx_k.size(0);
  auto keys = torch::cat({ctx_k.to(torch::kFloat32), qkv.narrow(1, H * D, KVH * D).view({T, KVH, D})});
  auto values = torch::cat({ctx_v.to(torch::kFloat32), qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D})});
  auto tables = torch::zeros({T, 1}, torch::kInt64);
  auto lens = torch::full({T}, n + T, torch::kInt64);
  auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
  return out_mlp(x, paged_decode_attention(q, keys, values, tables, lens, n + T, scale, 0), w, eps);
}

// The context keys/values of a DFlash/DSpark drafter for T committed positions (§2.1 Eq. 2-3):
// h = RMSNorm(fc(features)), then for each draft layer k = RoPE(k_norm(h Wk)), v = h Wv. The
// q rows of each packed qkv weight are skipped (context positions are keys only). feats:
// [T, m*d] float32 (T <= kSkinnyRows); qkv_w: each layer's packed [(H + 2 KVH) D, d] weight
// (float32 or its exact float16 copy); qkv_b: its bias or empty; k_norms: [D] or empty.
// Returns {k_0, v_0, k_1, v_1, ...}, each [T, KVH, D] float32.
std::vector<torch::Tensor> context_kv(torch::Tensor feats, torch::Tensor fc_w, torch::Tensor fc_b,
                                      torch::Tensor norm_w, double eps, std::vector<torch::Tensor> qkv_w,
                                      std::vector<torch::Tensor> qkv_b, std::vector<torch::Tensor> k_norms,
                                      torch::Tensor cos, torch::Tensor sin, int64_t H, int64_t KVH,
                                      int64_t D, double qk_eps) {
  TORCH_CHECK(feats.dim() == 2 && feats.scalar_type() == torch::kFloat32, "context_kv: feats must be [T, m*d] float32");
  TORCH_CHECK(qkv_w.size() == qkv_b.size() && qkv_w.size() == k_norms.size(), "context_kv: one weight, bias and k norm per layer");
  const int64_t T = feats.size(0), kvw = KVH * D;
  auto h = rms_norm(skinny_linear(feats, fc_w, fc_b), norm_w, eps);
  auto cs = cos.to(torch::kFloat32).contiguous(), sn = sin.to(torch::kFloat32).contiguous();
  TORCH_CHECK(cs.dim() == 2 && cs.size(0) == T && sn.sizes() == cs.sizes(), "context_kv: cos, sin must be [T, rot]");
  const int64_t rot = cs.size(1), half = rot / 2;
  std::vector<torch::Tensor> out;
  for (size_t l = 0; l < qkv_w.size(); ++l) {
    auto w = qkv_w[l].narrow(0, H * D, 2 * kvw);
    auto b = qkv_b[l].numel() ? qkv_b[l].narrow(0, H * D, 2 * kvw) : qkv_b[l];
    auto kv = skinny_linear(h, w, b);                     // [T, 2 KVH D]: k then v
    float* p = kv.data_ptr<float>();
    const bool norm = k_norms[l].numel() == D;
    auto kn = norm ? k_norms[l].to(torch::kFloat32).contiguous() : k_norms[l];
    for (int64_t t = 0; t < T; ++t) {
      const float* c = cs.data_ptr<float>() + t * rot;
      const float* si = sn.data_ptr<float>() + t * rot;
      for (int64_t hd = 0; hd < KVH; ++hd) {
        float* v = p + t * 2 * kvw + hd * D;
        if (norm) rms_inplace(v, kn.data_ptr<float>(), D, static_cast<float>(qk_eps));
        rope_head(v, c, si, half);
      }
    }
    out.push_back(kv.narrow(1, 0, kvw).contiguous().view({T, KVH, D}));
    out.push_back(kv.narrow(1, kvw, kvw).contiguous().view({T, KVH, D}));
  }
  return out;
}

// DSpark's sequential stage with the vanilla Markov head, argmax drafts (§2.2): for k = 0..G-1,
// logits[:, k] += W1[x_{k-1}] W2^T and x_k = argmax, x_{-1} = the anchor. One call instead of
// ~6 small torch ops per position. logits: [B, G, V] float32, corrected in place (they are q);
// w1: [V, r] float32; w2t: [r, V] float32 or its exact float16 copy (W2 transposed: a thread's
// slice of a row is contiguous); anchor: [B] int64. Returns the drafts [B, G] int64. Each
// bias element is summed over r in order in registers (64 columns at a time), and the argmax
// keeps the lowest index among ties with NaN winning (torch.argmax's rule). threads: how many
// slices of V run in parallel (0: all threads when the work is large enough).
template <typename wt>
static void markov_slice(float* row, const float* e, const wt* w2, int64_t R, int64_t V,
                         int64_t v0, int64_t v1, float& best, int64_t& arg) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t am = v0;
  bool nan = false;
  int64_t v = v0;
#if defined(LEAPFROG_AVX2)
  constexpr bool kSimd = kSimdWeight<wt>;
  if constexpr (kSimd) {
    for (; v + 64 <= v1; v += 64) {       // 8 independent accumulator chains: both FMA ports busy
      __m256 b[8];
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) b[u] = _mm256_setzero_ps();
      for (int64_t j = 0; j < R; ++j) {
        const __m256 ej = _mm256_set1_ps(e[j]);
        const wt* wj = w2 + j * V + v;
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) b[u] = _mm256_fmadd_ps(ej, load8(wj + 8 * u), b[u]);
      }
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u)
        _mm256_storeu_ps(row + v + 8 * u, _mm256_add_ps(_mm256_loadu_ps(row + v + 8 * u), b[u]));
    }
    for (; v + 8 <= v1; v += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < R; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(e[j]), load8(w2 + j * V + v), acc);
      _mm256_storeu_ps(row + v, _mm256_add_ps(_mm256_loadu_ps(row + v), acc));
    }
  }
#endif
  for (; v < v1; ++v) {
    float acc = 0.f;
    for (int64_t j = 0; j < R; ++j) acc += e[j] * static_cast<float>(w2[j * V + v]);
    row[v] += acc;
  }
  for (int64_t i = v0; i < v1 && !nan; ++i) {
    const float x = row[i];
    if (x > m || std::isnan(x)) { m = x; am = i; nan = std::isnan(x); }
  }
  best = nan ? std::numeric_limits<float>::quiet_NaN() : m;
  arg = am;
}

template <typename wt>
static void markov_argmax_impl(float* lp, const float* e1, const wt* w2, int64_t* pp, int64_t* ip,
                               int64_t B, int64_t G, int64_t V, int64_t R, int64_t vocab, int64_t parts) {
  std::vector<float> best(parts * B);
  std::vector<int64_t> arg(parts * B);
  // Slices of V on multiples of 64 columns (the vector loop's width).
  auto cut = [&](int64_t c) { return c == parts ? V : std::min(V, (V * c / parts) / 64 * 64); };
  for (int64_t k = 0; k < G; ++k) {
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(pp[b] >= 0 && pp[b] < vocab, "markov_argmax: token id out of range");
    at::parallel_for(0, parts, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t b = 0; b < B; ++b)
          markov_slice<wt>(lp + (b * G + k) * V, e1 + pp[b] * R, w2, R, V, cut(c), cut(c + 1),
                           best[c * B + b], arg[c * B + b]);
    });
    for (int64_t b = 0; b < B; ++b) {
      float m = best[b];
      int64_t am = arg[b];
      for (int64_t c = 1; c < parts && !std::isnan(m); ++c)
        if (cut(c) < cut(c + 1) && (best[c * B + b] > m || std::isnan(best[c * B + b]))) {
          m = best[c * B + b];
          am = arg[c * B + b];
        }
      pp[b] = am;
      ip[b * G + k] = am;
    }
  }
}

torch::Tensor markov_argmax(torch::Tensor logits, torch::Tensor w1, torch::Tensor w2t, torch::Tensor anchor,
                            int64_t threads) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "markov_argmax: logits must be contiguous [B, G, V] float32");
  TORCH_CHECK(w1.scalar_type() == torch::kFloat32 && w1.dim() == 2 && w2t.dim() == 2 &&
              (w2t.scalar_type() == torch::kFloat32 || w2t.scalar_type() == torch::kHalf) &&
              w2t.size(0) == w1.size(1) && w2t.size(1) == logits.size(2),
              "markov_argmax: w1 [V, r] float32, w2t [r, V] float32 or float16");
  const int64_t B = logits.size(0), G = logits.size(1), V = logits.size(2), R = w1.size(1);
  auto w1c = w1.contiguous(), w2c = w2t.contiguous();
  auto prev = anchor.to(torch::kInt64).contiguous().clone();
  auto ids = torch::empty({B, G}, torch::kInt64);
  // One parallel region per position: worth its wake-up only for a batch's worth of work.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(V / 64,
      threads > 0 ? threads : (B * V * R >= kMinParallelWork ? at::get_num_threads() : 1)));
  if (w2c.scalar_type() == torch::kHalf)
    markov_argmax_impl<at::Half>(logits.data_ptr<float>(), w1c.data_ptr<float>(), w2c.data_ptr<at::Half>(),
                                 prev.data_ptr<int64_t>(), ids.data_ptr<int64_t>(), B, G, V, R, w1c.size(0), parts);
  else
    markov_argmax_impl<float>(logits.data_ptr<float>(), w1c.data_ptr<float>(), w2c.data_ptr<float>(),
                              prev.data_ptr<int64_t>(), ids.data_ptr<int64_t>(), B, G, V, R, w1c.size(0), parts);
  return ids;
}

void register_decode_loop(pybind11::module& m);   // decode_loop.cpp

// Every kernel runs without the GIL: the server's event loop (another thread) keeps streaming
// while the engine thread computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("ctx_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("window") = 0, nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (CPU, float32)", nogil);
  m.def("decode_layer", &decode_layer, "a Llama-family decoder layer over the paged cache (CPU, float32)", nogil);
  m.def("attention_partial", &attention_partial,
        "a tensor-parallel rank's attention and output-projection partial sum (CPU, float32)", nogil);
  m.def("mlp_partial", &mlp_partial, "a tensor-parallel rank's SwiGLU partial sum (CPU, float32)", nogil);
  m.def("two_stream_layer", &two_stream_layer,
        "a two-stream diffusion layer: the model's rows and the mask stream's over one cache (CPU, float32)", nogil);
  m.def("draft_layer", &draft_layer, "a DFlash/DSpark drafter layer for one sequence (CPU, float32)", nogil);
  m.def("context_kv", &context_kv, "a drafter's context keys/values from target features (CPU, float32)", nogil);
  m.def("markov_argmax", &markov_argmax, "DSpark's vanilla Markov stage with argmax drafts (CPU, float32)", nogil);
  m.def("skinny_linear", &skinny_linear, "x @ w.T for few rows of x (CPU, float32)", nogil);
  m.def("bf16_dot_available", []() {
#if defined(LEAPFROG_BF16_SIMD)
    return true;
#else
    return false;
#endif
  }, "whether bfloat16 panel products run on AVX512-BF16 here (else a scalar loop)");
  m.def("pack_panels", &pack_panels,
        "w [N, K] -> column panels [ceil(N/16), K, 16] (bf16: [ceil(N/16), ceil(K/2), 32] bfloat16)",
        py::arg("w"), py::arg("bf16") = false, nogil);
  m.def("int8_dot_available", &int8_products_available,
        "whether int8 panel products run on AVX512-VNNI or AVX2 on this CPU (else a slow scalar loop)");
  m.def("amx_available", []() {
#if defined(LEAPFROG_AMX)
    return amx_available();
#else
    return false;
#endif
  }, "whether int8 products of several rows run on AMX tiles here (AMX-INT8, tile state granted by the OS)");
  m.def("set_amx_products", [](bool on) {
#if defined(LEAPFROG_AMX)
    amx_products_on().store(on);
#else
    (void)on;
#endif
  }, "use the AMX tiles where available (True, the default) or the VNNI tile (False)");
  m.def("panel_rows_gather", &panel_rows_gather, "rows of a weight held in quantized panels, dequantized (CPU)");
  m.def("panel_linear", &panel_linear, "x @ w.T from packed panels, medium row counts (CPU, float32)", nogil);
  register_decode_loop(m);
}
