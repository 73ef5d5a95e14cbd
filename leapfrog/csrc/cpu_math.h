// Row-level arithmetic shared by the CPU kernels (cpu_kernels.cpp) and the multi-step decode
// loop (decode_loop.cpp).
//
// Every value a decode step computes for one row of a batch (a norm, a projection output, an
// attention head, a sampled token) is computed by one of the functions below, in an order that
// does not depend on how many rows the step has or on which thread runs it. The layer-by-layer
// kernels and the decode loop both call them, so a sequence's logits are the same bits whether
// it is decoded one step per call, several steps per call, alone or in a batch. The build uses
// -ffp-contract=off, so the compiler never fuses a multiply and an add differently in one
// caller than in another.
#pragma once

#include <torch/extension.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LEAPFROG_AVX2 1
#endif

namespace lf {

#if defined(LEAPFROG_AVX2)
static inline float hsum256(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Eight consecutive values widened to float32: plain loads for float32, F16C conversion for
// float16 (exact: every float16 is a float32). Used for KV rows and for weights.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#if defined(__F16C__)
static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#define LEAPFROG_HAVE_F16_SIMD 1
#endif
#endif

// Weight and KV types the vector loops widen with load8: float32, and float16 where F16C is.
template <typename wt>
static constexpr bool kSimdWeight = std::is_same<wt, float>::value
#if defined(LEAPFROG_HAVE_F16_SIMD)
                                    || std::is_same<wt, at::Half>::value
#endif
    ;

#if defined(LEAPFROG_AVX2)
// exp(x) within ~2 ulp of std::exp for x in [-87.3, 88.3] (inputs are clamped to it):
// x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for an exact r), exp(r) by its degree-6
// Taylor polynomial (error < 2e-8 relative), scaled by 2^n through the exponent bits.
// Inputs below -87.3 (where exp underflows to ~0) are flushed to 0.
static inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.f / 720.f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 120.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 24.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 6.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(under, y);
}
#endif

// One row of x against one weight row, read front to back. Every few-row product is made of
// these: the rows of a weight are read one after another (a sequential run the hardware
// prefetcher follows; four weight rows read side by side reached about half the memory
// bandwidth, see docs/decisions.md), each row once from memory for all rows of x (the later
// ones find it in L1), and every output element is summed the same way whatever the number of
// rows. Four 8-lane accumulators (k mod 32) keep two FMA units busy; the tail is explicit fused
// multiply-adds.
#if defined(LEAPFROG_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__)
#define LEAPFROG_AVX512 1
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#if defined(LEAPFROG_HAVE_F16_SIMD)
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
#endif

// The end of dot_row once its four 8-lane accumulators (lane j of a_i sums k = 8i + j mod 32)
// hold the 32-wide body: the 8-wide tail into a0, the lanes summed, the scalar tail.
template <typename wt>
static inline float dot_finish(const float* x, const wt* w, int64_t k, int64_t K, __m256 a0, __m256 a1,
                               __m256 a2, __m256 a3) {
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w + k), a0);
  float s = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) s = std::fma(x[k], static_cast<float>(w[k]), s);
  return s;
}

// With AVX-512 the same four accumulators are two 16-lane registers (z0 = a0|a1, z1 = a2|a3):
// the same multiply-adds in the same lanes, so both builds give the same bits, in half the
// instructions.
template <typename wt>
static inline float dot_row(const float* x, const wt* w, int64_t K) {
  if constexpr (kSimdWeight<wt>) {
#if defined(LEAPFROG_AVX512)
    __m512 z0 = _mm512_setzero_ps(), z1 = z0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      z0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(w + k), z0);
      z1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), load16(w + k + 16), z1);
    }
    return dot_finish(x, w, k, K, _mm512_castps512_ps256(z0), _mm512_extractf32x8_ps(z0, 1),
                      _mm512_castps512_ps256(z1), _mm512_extractf32x8_ps(z1, 1));
#elif defined(LEAPFROG_AVX2)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), load8(w + k + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), load8(w + k + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), load8(w + k + 24), a3);
    }
    return dot_finish(x, w, k, K, a0, a1, a2, a3);
#endif
  }
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s = std::fma(x[k], static_cast<float>(w[k]), s);
  return s;
}

// Two weight rows against one row of x: each output summed exactly as dot_row sums it, with
// the loads of x shared.
template <typename wt>
static inline void dot_row2(const float* x, const wt* w0, const wt* w1, int64_t K, float& s0, float& s1) {
#if defined(LEAPFROG_AVX512)
  if constexpr (kSimdWeight<wt>) {
    __m512 p0 = _mm512_setzero_ps(), p1 = p0, q0 = p0, q1 = p0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512 xa = _mm512_loadu_ps(x + k), xb = _mm512_loadu_ps(x + k + 16);
      p0 = _mm512_fmadd_ps(xa, load16(w0 + k), p0);
      p1 = _mm512_fmadd_ps(xb, load16(w0 + k + 16), p1);
      q0 = _mm512_fmadd_ps(xa, load16(w1 + k), q0);
      q1 = _mm512_fmadd_ps(xb, load16(w1 + k + 16), q1);
    }
    s0 = dot_finish(x, w0, k, K, _mm512_castps512_ps256(p0), _mm512_extractf32x8_ps(p0, 1),
                    _mm512_castps512_ps256(p1), _mm512_extractf32x8_ps(p1, 1));
    s1 = dot_finish(x, w1, k, K, _mm512_castps512_ps256(q0), _mm512_extractf32x8_ps(q0, 1),
                    _mm512_castps512_ps256(q1), _mm512_extractf32x8_ps(q1, 1));
    return;
  }
#endif
  s0 = dot_row(x, w0, K);
  s1 = dot_row(x, w1, K);
}

#if defined(LEAPFROG_AVX512)
// R rows of x (row stride ldx) against one weight row: the weight is loaded and widened once
// per 32 columns for all R rows, and each row's sum is dot_row's exactly (the same two 16-lane
// accumulators, filled in the same order, finished by dot_finish). A verify step's 9 rows cost
// one widening of the weights instead of nine.
template <int R, typename wt>
static inline void dot_block(const float* x, int64_t ldx, const wt* w, int64_t K, float* out) {
  __m512 z0[R], z1[R];
  for (int r = 0; r < R; ++r) z0[r] = z1[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 w0 = load16(w + k), w1 = load16(w + k + 16);
    for (int r = 0; r < R; ++r) {
      z0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + k), w0, z0[r]);
      z1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + k + 16), w1, z1[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = dot_finish(x + r * ldx, w, k, K, _mm512_castps512_ps256(z0[r]), _mm512_extractf32x8_ps(z0[r], 1),
                        _mm512_castps512_ps256(z1[r]), _mm512_extractf32x8_ps(z1[r], 1));
}

// At most this many rows per block: more accumulators than registers, or rows of x that no
// longer stay in L1, made bigger blocks slower (one-off timings of skinny_linear at K = 1024).
static constexpr int64_t kBlockRows = 5;

// R rows of x against two weight rows at once: per 32 columns the two weight rows are widened
// once and each row of x loaded once for both, so the loads per multiply-add drop by a third
// against dot_block; the accumulators (4R registers) are dot_row's, filled in its order.
template <int R, typename wt>
static inline void dot_tile2(const float* x, int64_t ldx, const wt* w0, const wt* w1, int64_t K,
                             float* out0, float* out1) {
  __m512 a0[R], a1[R], b0[R], b1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = b0[r] = b1[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 u0 = load16(w0 + k), u1 = load16(w0 + k + 16), v0 = load16(w1 + k), v1 = load16(w1 + k + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xa = _mm512_loadu_ps(x + r * ldx + k), xb = _mm512_loadu_ps(x + r * ldx + k + 16);
      a0[r] = _mm512_fmadd_ps(xa, u0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xb, u1, a1[r]);
      b0[r] = _mm512_fmadd_ps(xa, v0, b0[r]);
      b1[r] = _mm512_fmadd_ps(xb, v1, b1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out0[r] = dot_finish(x + r * ldx, w0, k, K, _mm512_castps512_ps256(a0[r]), _mm512_extractf32x8_ps(a0[r], 1),
                         _mm512_castps512_ps256(a1[r]), _mm512_extractf32x8_ps(a1[r], 1));
    out1[r] = dot_finish(x + r * ldx, w1, k, K, _mm512_castps512_ps256(b0[r]), _mm512_extractf32x8_ps(b0[r], 1),
                         _mm512_castps512_ps256(b1[r]), _mm512_extractf32x8_ps(b1[r], 1));
  }
}
static constexpr int64_t kTileRows = 4;

template <typename wt>
static inline void dot_tile2_any(const float* x, int64_t ldx, int64_t rows, const wt* w0, const wt* w1, int64_t K,
                                 float* out0, float* out1) {
  switch (rows) {
    case 4: dot_tile2<4>(x, ldx, w0, w1, K, out0, out1); break;
    case 3: dot_tile2<3>(x, ldx, w0, w1, K, out0, out1); break;
    case 2: dot_tile2<2>(x, ldx, w0, w1, K, out0, out1); break;
    default: dot_tile2<1>(x, ldx, w0, w1, K, out0, out1); break;
  }
}

template <typename wt>
static inline void dot_block_any(const float* x, int64_t ldx, int64_t rows, const wt* w, int64_t K, float* out) {
  switch (rows) {
    case 8: dot_block<8>(x, ldx, w, K, out); break;
    case 7: dot_block<7>(x, ldx, w, K, out); break;
    case 6: dot_block<6>(x, ldx, w, K, out); break;
    case 5: dot_block<5>(x, ldx, w, K, out); break;
    case 4: dot_block<4>(x, ldx, w, K, out); break;
    case 3: dot_block<3>(x, ldx, w, K, out); break;
    case 2: dot_block<2>(x, ldx, w, K, out); break;
    default: dot_block<1>(x, ldx, w, K, out); break;
  }
}
#endif

// y[m, n0:n1] = x[m] . w[n]^T (+ bias) for rows m < M of x (row stride K) and of y (row stride
// ldy): each weight row read once for all rows of x. pair_rows (one row of x): two weight rows
// side by side, sharing the loads of x. That pays only while the weights come from the caches
// (streamed from memory, one row at a time reads faster; docs/benchmarks.md). Either way each
// output is summed the same way.
static constexpr int64_t kPairRowsMaxBytes = 2 << 20;      // one product's weight, layer path
static constexpr int64_t kPairRowsModelBytes = 24 << 20;   // a model's, in the decode loop (L3: 32 MB)

template <typename wt>
static inline void dot_rows(const float* x, int64_t M, const wt* w, const float* bias, float* y,
                            int64_t ldy, int64_t n0, int64_t n1, int64_t K, bool pair_rows = false) {
  if (M == 1 && pair_rows) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
      float s0, s1;
      dot_row2(x, w + n * K, w + (n + 1) * K, K, s0, s1);
      y[n] = s0 + (bias ? bias[n] : 0.f);
      y[n + 1] = s1 + (bias ? bias[n + 1] : 0.f);
    }
    if (n < n1) y[n] = dot_row(x, w + n * K, K) + (bias ? bias[n] : 0.f);
    return;
  }
#if defined(LEAPFROG_AVX512)
  // Two or more rows of x: blocks of rows per weight row, and two weight rows at a time where
  // they come from the caches (pair_rows); one row of x keeps dot_row (above).
  if constexpr (kSimdWeight<wt>) if (M > 1) {
    float sums[8], sums1[8];
    const int64_t tiles = (M + kTileRows - 1) / kTileRows, tile = (M + tiles - 1) / tiles;
    int64_t n2 = n0;
    for (; pair_rows && n2 + 2 <= n1; n2 += 2) {
      const wt* wa = w + n2 * K;
      const float ba = bias ? bias[n2] : 0.f, bb = bias ? bias[n2 + 1] : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += tile) {
        const int64_t rows = std::min<int64_t>(tile, M - m0);
        dot_tile2_any(x + m0 * K, K, rows, wa, wa + K, K, sums, sums1);
        for (int64_t r = 0; r < rows; ++r) {
          y[(m0 + r) * ldy + n2] = sums[r] + ba;
          y[(m0 + r) * ldy + n2 + 1] = sums1[r] + bb;
        }
      }
    }
    n0 = n2;
    const int64_t blocks = (M + kBlockRows - 1) / kBlockRows, block = (M + blocks - 1) / blocks;
    for (int64_t n = n0; n < n1; ++n) {
      const wt* wn = w + n * K;
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += block) {
        const int64_t rows = std::min<int64_t>(block, M - m0);
        dot_block_any(x + m0 * K, K, rows, wn, K, sums);
        for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * ldy + n] = sums[r] + b;
      }
    }
    return;
  }
#endif
  for (int64_t n = n0; n < n1; ++n) {
    const wt* wn = w + n * K;
    const float b = bias ? bias[n] : 0.f;
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = dot_row(x + m * K, wn, K) + b;
  }
}

// RMSNorm of one row: sum of squares in two 8-lane accumulators, then x * inv * w per element.
static inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(LEAPFROG_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), a0);
  s = hsum256(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) s = std::fma(x[i], x[i], s);
  return s;
}

static inline void rms_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// Rotary embedding of one head in place (the first 2 * half dimensions; the rest pass).
static inline void rope_head(float* v, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * c[i] - x2 * s[i];
    v[i + half] = x2 * c[i + half] + x1 * s[i + half];
  }
}

// The first key a query row at context length n sees under a sliding window of `window` keys
// (0: no window, every key).
static inline int64_t window_start(int64_t n, int64_t window) {
  return window > 0 && n > window ? n - window : 0;
}

// GeGLU's gelu(g) * u with GELU's tanh form (Gemma's gelu_pytorch_tanh) over n elements:
// 0.5 g (1 + tanh(z)) = g / (1 + exp(-2z)), z = sqrt(2 / pi) (g + 0.044715 g^3).
static inline void gelu_tanh_mul(const float* g, const float* u, float* out, int64_t n) {
  constexpr float kC = 0.7978845608028654f, kA = 0.044715f;
  int64_t i = 0;
#if defined(LEAPFROG_AVX2)
  const __m256 one = _mm256_set1_ps(1.f), m2c = _mm256_set1_ps(-2.f * kC), a = _mm256_set1_ps(kA);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(a, gv), _mm256_mul_ps(gv, gv), gv);
    const __m256 den = _mm256_add_ps(one, exp256(_mm256_mul_ps(m2c, inner)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-2.f * kC * (g[i] + kA * g[i] * g[i] * g[i]))) * u[i];
}

// SwiGLU's silu(g) * u = g / (1 + exp(-g)) * u over n elements.
static inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
#if defined(LEAPFROG_AVX2)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 den = _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

#if defined(LEAPFROG_AVX2)
// [sum of v0's lanes, ..., sum of v7's lanes].
static inline __m256 hsum8x8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6,
                             __m256 v7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Decode attention of one query row's heads that share KV head g (heads g*group ..
// (g+1)*group - 1) over keys 0..n-1 of its sequence, read slot by slot through its block table:
// scores (an FMA chain over D, lanes summed eight positions at a time, times scale), a
// softmax, and the weighted sum of values, each head's in the same order whichever thread runs
// it and however many rows the step has. D is a multiple of 8. qb / ob: the row's [H, D] query
// and output; scores: room for group * n floats; acc: group * D.
static constexpr int64_t kPrefetchSlots = 16;

template <typename kv_t>
struct KVRows {
  const kv_t* base;
  const int64_t* table;
  int64_t block_size, KVH, D, g;
  int shift = -1;            // log2(block_size) when it is a power of two: no division per key
  int64_t offset = 0;        // added to every position asked for (a chunk's first position)
  // Prefetch every KV head's values of a slot, not only head g's: a task that walks the heads of
  // a chunk one after another then finds the later heads' rows in cache, and memory sees one
  // sequential run per block instead of a strided one per head.
  bool whole_slot = false;
  KVRows(const kv_t* base_, const int64_t* table_, int64_t block_size_, int64_t KVH_, int64_t D_, int64_t g_)
      : base(base_), table(table_), block_size(block_size_), KVH(KVH_), D(D_), g(g_) {
    if (block_size > 0 && (block_size & (block_size - 1)) == 0)
      while ((int64_t{1} << (shift + 1)) <= block_size) ++shift;
  }
  // Forced inline: called once a position in the attention loops, where an out-of-line call
  // makes the compiler spill every accumulator around it.
  __attribute__((always_inline)) inline const kv_t* operator()(int64_t p) const {
    p += offset;
    const int64_t slot = shift >= 0 ? table[p >> shift] * block_size + (p & (block_size - 1))
                                     : table[p / block_size] * block_size + p % block_size;
    return base + (slot * KVH + g) * D;
  }
  __attribute__((always_inline)) inline void prefetch(int64_t p, int64_t n) const {
    if (p >= n) return;
    const kv_t* row = (*this)(p);
    const char* r = reinterpret_cast<const char*>(whole_slot ? row - g * D : row);
    const int64_t bytes = (whole_slot ? KVH : 1) * D * static_cast<int64_t>(sizeof(kv_t));
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(r + off, _MM_HINT_T0);
  }
};

// acc[j] = sum over p in order of scores[j, p] * v_p, the G x ND accumulators in registers.
template <int G, int ND, typename kv_t>
static inline void weighted_values(const KVRows<kv_t>& rows, const float* scores, int64_t n, float* acc) {
  __m256 a[G][ND];
  for (int j = 0; j < G; ++j)
    for (int d = 0; d < ND; ++d) a[j][d] = _mm256_setzero_ps();
  for (int64_t p = 0; p < kPrefetchSlots; ++p) rows.prefetch(p, n);
  for (int64_t p = 0; p < n; ++p) {
    rows.prefetch(p + kPrefetchSlots, n);
    const kv_t* vv = rows(p);
    for (int j = 0; j < G; ++j) {
      const __m256 w = _mm256_set1_ps(scores[j * n + p]);
      for (int d = 0; d < ND; ++d) a[j][d] = _mm256_fmadd_ps(w, load8(vv + 8 * d), a[j][d]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int d = 0; d < ND; ++d) _mm256_storeu_ps(acc + (j * ND + d) * 8, a[j][d]);
}

template <typename kv_t>
static inline void weighted_values_any(const KVRows<kv_t>& rows, const float* scores, int64_t n, int64_t group,
                                       int64_t nd, float* acc) {
  std::fill(acc, acc + group * nd * 8, 0.f);
  for (int64_t p = 0; p < kPrefetchSlots; ++p) rows.prefetch(p, n);
  for (int64_t p = 0; p < n; ++p) {
    rows.prefetch(p + kPrefetchSlots, n);
    const kv_t* vv = rows(p);
    for (int64_t j = 0; j < group; ++j) {
      const __m256 w = _mm256_set1_ps(scores[j * n + p]);
      float* a = acc + j * nd * 8;
      for (int64_t d = 0; d < nd; ++d)
        _mm256_storeu_ps(a + 8 * d, _mm256_fmadd_ps(w, load8(vv + 8 * d), _mm256_loadu_ps(a + 8 * d)));
    }
  }
}

// The context is attended in chunks of kAttnChunk positions, each giving its own maximum score,
// sum of exponentials and unnormalized weighted values per head (a partial), which
// attend_combine then merges in chunk order. The chunks depend on the context length alone, so
// a row's output is the same bits whether one thread walks all its chunks (attend_group) or the
// decode loop spreads them over threads (a single request's few KV heads over two cores); a
// context of one chunk is the plain softmax.
static constexpr int64_t kAttnChunk = 128;
static inline int64_t attn_chunks(int64_t n) { return (n + kAttnChunk - 1) / kAttnChunk; }
// floats of one partial: m[group], s[group], acc[group][D]
static inline int64_t attn_part_floats(int64_t group, int64_t D) { return group * (D + 2); }
// floats of scratch attend_group needs for a context of n: one chunk's scores, a partial a chunk
static inline int64_t attn_scratch_floats(int64_t n, int64_t group, int64_t D) {
  return group * kAttnChunk + attn_chunks(std::max<int64_t>(n, 1)) * attn_part_floats(group, D);
}

// Chunk c of the context 0..n-1 (positions c*kAttnChunk .. at most n) for the query heads of KV
// head g: scores (group x len, in `scores`), then the partial `part`. With `start`, the context
// is the sequence's keys start..start+n-1 (a sliding window's).
template <typename kv_t>
static void attend_chunk(const float* qb, const kv_t* k, const kv_t* v, const int64_t* table,
                         int64_t n, int64_t c, int64_t block_size, int64_t KVH, int64_t D, int64_t g,
                         int64_t group, float scale, float* scores, float* part, bool whole_slot = false,
                         int64_t start = 0) {
  const int64_t nd = D / 8, h0 = g * group;
  const int64_t c0 = c * kAttnChunk, c1 = std::min(n, c0 + kAttnChunk), len = c1 - c0;
  KVRows<kv_t> krows(k, table, block_size, KVH, D, g), vrows(v, table, block_size, KVH, D, g);
  krows.whole_slot = vrows.whole_slot = whole_slot;
  krows.offset = start;
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t p0 = c0;
  for (; p0 + 8 <= c1; p0 += 8) {
    const kv_t* kr[8];
    for (int i = 0; i < 8; ++i) kr[i] = krows(p0 + i);
    for (int i = 0; i < 8; ++i) krows.prefetch(p0 + kPrefetchSlots + i, n);
    for (int64_t j = 0; j < group; ++j) {
      const float* qv = qb + (h0 + j) * D;
      __m256 a[8];
      const __m256 q0 = _mm256_loadu_ps(qv);
      for (int i = 0; i < 8; ++i) a[i] = _mm256_mul_ps(q0, load8(kr[i]));
      for (int64_t d = 1; d < nd; ++d) {
        const __m256 qd = _mm256_loadu_ps(qv + 8 * d);
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qd, load8(kr[i] + 8 * d), a[i]);
      }
      _mm256_storeu_ps(scores + j * len + (p0 - c0),
                       _mm256_mul_ps(hsum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]), vscale));
    }
  }
  for (; p0 < c1; ++p0) {
    const kv_t* kv = krows(p0);
    for (int64_t j = 0; j < group; ++j) {
      const float* qv = qb + (h0 + j) * D;
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qv), load8(kv));
      for (int64_t d = 1; d < nd; ++d) a = _mm256_fmadd_ps(_mm256_loadu_ps(qv + 8 * d), load8(kv + 8 * d), a);
      scores[j * len + (p0 - c0)] = hsum256(a) * scale;
    }
  }
  float* pm = part;
  float* ps = part + group;
  float* acc = part + 2 * group;
  for (int64_t j = 0; j < group; ++j) {
    float* sc = scores + j * len;
    // the maximum (exact whatever the order): eight lanes at a time, then the tail
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t p = 0;
    for (; p + 8 <= len; p += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(sc + p), m8);   // a NaN score is skipped, as below
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m8);
    float mx = -INFINITY;
    for (int i = 0; i < 8; ++i) mx = lanes[i] > mx ? lanes[i] : mx;
    for (; p < len; ++p) mx = sc[p] > mx ? sc[p] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    p = 0;
    for (; p + 8 <= len; p += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + p), vmx));
      _mm256_storeu_ps(sc + p, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float denom = hsum256(vsum);
    for (; p < len; ++p) {
      sc[p] = std::exp(sc[p] - mx);
      denom += sc[p];
    }
    pm[j] = mx;
    ps[j] = denom;
  }
  vrows.offset = start + c0;
  if (nd == 8 && group == 1) weighted_values<1, 8>(vrows, scores, len, acc);
  else if (nd == 8 && group == 2) weighted_values<2, 8>(vrows, scores, len, acc);
#if defined(LEAPFROG_AVX512)      // 24 or 32 accumulators: the 32 vector registers of AVX-512
  else if (nd == 8 && group == 3) weighted_values<3, 8>(vrows, scores, len, acc);
  else if (nd == 8 && group == 4) weighted_values<4, 8>(vrows, scores, len, acc);
#endif
  else if (nd == 16 && group == 1) weighted_values<1, 16>(vrows, scores, len, acc);
  else if (nd == 4 && group <= 4) {
    if (group == 1) weighted_values<1, 4>(vrows, scores, len, acc);
    else if (group == 2) weighted_values<2, 4>(vrows, scores, len, acc);
    else if (group == 3) weighted_values<3, 4>(vrows, scores, len, acc);
    else weighted_values<4, 4>(vrows, scores, len, acc);
  } else weighted_values_any(vrows, scores, len, group, nd, acc);
}

// The heads of KV head g from the partials of its `chunks` chunks (consecutive, attn_part_floats
// apart), merged in chunk order: weights exp(m_c - max m), out = sum w_c acc_c / sum w_c s_c.
// With one chunk the weight is exactly 1: out = acc / s, the single-pass softmax.
static inline void attend_combine(const float* parts, int64_t chunks, int64_t D, int64_t g, int64_t group,
                                  float* ob) {
  const int64_t nd = D / 8, stride = attn_part_floats(group, D), h0 = g * group;
  for (int64_t j = 0; j < group; ++j) {
    float mx = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, parts[c * stride + j]);
    float* o = ob + (h0 + j) * D;
    __m256 out[16];
    const int64_t blocks = std::min<int64_t>(nd, 16);
    float denom = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float* part = parts + c * stride;
      const float w = chunks == 1 ? 1.f : std::exp(part[j] - mx);
      denom += w * part[group + j];
      const float* acc = part + 2 * group + j * D;
      const __m256 vw = _mm256_set1_ps(w);
      if (c == 0)
        for (int64_t d = 0; d < blocks; ++d) out[d] = _mm256_mul_ps(vw, _mm256_loadu_ps(acc + 8 * d));
      else
        for (int64_t d = 0; d < blocks; ++d) out[d] = _mm256_fmadd_ps(vw, _mm256_loadu_ps(acc + 8 * d), out[d]);
      for (int64_t d = blocks; d < nd; ++d)       // heads wider than 128: through memory
        _mm256_storeu_ps(o + 8 * d, c == 0 ? _mm256_mul_ps(vw, _mm256_loadu_ps(acc + 8 * d))
                                            : _mm256_fmadd_ps(vw, _mm256_loadu_ps(acc + 8 * d), _mm256_loadu_ps(o + 8 * d)));
    }
    const __m256 s = _mm256_set1_ps(1.f / denom);
    for (int64_t d = 0; d < blocks; ++d) _mm256_storeu_ps(o + 8 * d, _mm256_mul_ps(out[d], s));
    for (int64_t d = blocks; d < nd; ++d) _mm256_storeu_ps(o + 8 * d, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * d), s));
  }
}

// Decode attention of one query row's heads that share KV head g (heads g*group ..
// (g+1)*group - 1) over keys start..start+n-1 of its sequence: every chunk in turn, then their
// merge. scratch: attn_scratch_floats(n, group, D) floats.
template <typename kv_t>
static void attend_group(const float* qb, const kv_t* k, const kv_t* v, const int64_t* table,
                         int64_t n, int64_t block_size, int64_t KVH, int64_t D, int64_t g,
                         int64_t group, float scale, float* ob, float* scratch, int64_t start = 0) {
  const int64_t chunks = attn_chunks(n), pf = attn_part_floats(group, D);
  float* parts = scratch + group * kAttnChunk;
  for (int64_t c = 0; c < chunks; ++c)
    attend_chunk(qb, k, v, table, n, c, block_size, KVH, D, g, group, scale, scratch, parts + c * pf,
                 false, start);
  attend_combine(parts, chunks, D, g, group, ob);
}
#endif

// ---------------------------------------------------------------------------------------------
// Products from a weight packed in column panels (pack_panels), for any row count up to a
// batch's: panel p holds output columns 16p..16p+15 as [K][16] values of the weight's type
// (float32, or float16 widened exactly as it is read), so one panel is one sequential run of
// memory. A micro-kernel keeps an R x 16 tile of y in registers and, per k, widens one panel
// row and broadcasts R values of x: 2R multiply-adds per two loads of weights. Every output
// element is one chain of fused multiply-adds over k in order, from zero, whatever rows share
// its tile, whichever kernel below computes it and whatever the weight's type: a row's result
// does not depend on the batch it is in, and a verify step's rows are the bits a one-row decode
// step gives.
//
// Row-major weights read a weight row per output (dot_row above): one row of x then streams
// about as fast, but R rows of x cost R widenings of every weight element and R horizontal sums
// per output; from panels every weight element is widened once for all the rows.
static constexpr int64_t kPanel = 16;

// How far ahead the panel kernels prefetch (bytes of the panel being read).
static constexpr int64_t kPanelPrefetch = 1024;

template <typename wt>
static inline const wt* panel_at(const wt* panels, int64_t K, int64_t p) { return panels + p * K * kPanel; }

// out[r][c] = sum over k of x[r * ldx + k] * pw[k][c], r < R (R <= 6: 2R accumulators, two
// weight registers and one broadcast in the 16 registers of AVX2).
// With resume, the sums continue from out (a previous call's over the k before these).
template <int R, typename wt>
__attribute__((noinline)) static void panel_block(const float* __restrict x, int64_t ldx, int64_t K,
                                                  const wt* __restrict pw, float* __restrict out,
                                                  bool resume = false) {
  if constexpr (kSimdWeight<wt>) {
#if defined(LEAPFROG_AVX2)
    // The loops over rows are unrolled by the pragmas: without them GCC kept a copy of every
    // accumulator in memory and stored all of them on every k, at half the speed.
    __m256 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r][0] = resume ? _mm256_loadu_ps(out + r * kPanel) : _mm256_setzero_ps();
      acc[r][1] = resume ? _mm256_loadu_ps(out + r * kPanel + 8) : _mm256_setzero_ps();
    }
    // A software prefetch one cache line per two k, kPanelPrefetch bytes ahead: while a step of
    // several rows is busy multiplying, the hardware prefetcher alone let the panel stream stall.
    constexpr int64_t ahead = kPanelPrefetch / (kPanel * static_cast<int64_t>(sizeof(wt)));
    for (int64_t k = 0; k < K; ++k) {
      if (R > 1 && (k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(pw + (k + ahead) * kPanel), _MM_HINT_T0);
      const __m256 w0 = load8(pw + k * kPanel), w1 = load8(pw + k * kPanel + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * kPanel, acc[r][0]);
      _mm256_storeu_ps(out + r * kPanel + 8, acc[r][1]);
    }
    return;
#endif
  }
  for (int r = 0; r < R; ++r) {
    float* o = out + r * kPanel;
    if (!resume)
      for (int64_t c = 0; c < kPanel; ++c) o[c] = 0.f;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < kPanel; ++c) o[c] = std::fma(x[r * ldx + k], static_cast<float>(pw[k * kPanel + c]), o[c]);
  }
}

// One row of x against two panels at once (32 columns): four accumulator chains instead of
// two, so a one-row step is not held up by the latency of its multiply-adds; each output is
// summed exactly as panel_block sums it.
template <typename wt>
__attribute__((noinline)) static void panel_pair(const float* __restrict x, int64_t K, const wt* __restrict pa,
                                                 const wt* __restrict pb, float* __restrict out) {
  if constexpr (kSimdWeight<wt>) {
#if defined(LEAPFROG_AVX2)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    constexpr int64_t ahead = kPanelPrefetch / (kPanel * static_cast<int64_t>(sizeof(wt)));
    for (int64_t k = 0; k < K; ++k) {
      if ((k & 1) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(pa + (k + ahead) * kPanel), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(pb + (k + ahead) * kPanel), _MM_HINT_T0);
      }
      const __m256 xb = _mm256_broadcast_ss(x + k);
      a0 = _mm256_fmadd_ps(xb, load8(pa + k * kPanel), a0);
      a1 = _mm256_fmadd_ps(xb, load8(pa + k * kPanel + 8), a1);
      b0 = _mm256_fmadd_ps(xb, load8(pb + k * kPanel), b0);
      b1 = _mm256_fmadd_ps(xb, load8(pb + k * kPanel + 8), b1);
    }
    _mm256_storeu_ps(out, a0);
    _mm256_storeu_ps(out + 8, a1);
    _mm256_storeu_ps(out + 16, b0);
    _mm256_storeu_ps(out + 24, b1);
    return;
#endif
  }
  panel_block<1>(x, K, K, pa, out);
  panel_block<1>(x, K, K, pb, out + kPanel);
}

// y[r, 16p + c] = out[r][c] + bias for the panel's columns below N.
static inline void panel_store(const float* out, int64_t rows, const float* bias, float* y, int64_t ldy,
                               int64_t N, int64_t p) {
  const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * ldy + n0;
    const float* o = out + r * kPanel;
    for (int64_t c = 0; c < cols; ++c) yr[c] = o[c] + (bias ? bias[n0 + c] : 0.f);
  }
}

static constexpr int64_t kPanelTileRows = 6;

template <typename wt>
static inline void panel_tile(const float* x, int64_t ldx, int64_t rows, int64_t K, const wt* pw, float* out,
                              bool resume = false) {
  switch (rows) {
    case 6: panel_block<6>(x, ldx, K, pw, out, resume); break;
    case 5: panel_block<5>(x, ldx, K, pw, out, resume); break;
    case 4: panel_block<4>(x, ldx, K, pw, out, resume); break;
    case 3: panel_block<3>(x, ldx, K, pw, out, resume); break;
    case 2: panel_block<2>(x, ldx, K, pw, out, resume); break;
    default: panel_block<1>(x, ldx, K, pw, out, resume); break;
  }
}

// k per slice when several groups of rows share a panel: all groups take a slice before the
// next is read, so the panel streams from memory once, without the pause a second whole pass
// over it (from the caches, with no demand on memory to keep the prefetcher going) costs.
static constexpr int64_t kPanelSliceK = 128;

// y[m, :] = x[m] W^T + bias over panels p0..p1-1, for M rows of x (row stride K) and of y (row
// stride ldy). Rows go in balanced groups of at most six per pass over a panel (9 rows: 5 + 4);
// a panel is read from memory by the first group and from the caches by the others.
template <typename wt>
static inline void panel_rows(const float* x, int64_t M, int64_t K, const wt* panels, int64_t p0, int64_t p1,
                              const float* bias, float* y, int64_t ldy, int64_t N) {
  alignas(64) float out[kPanelTileRows * kPanel];
  int64_t p = p0;
  if (M == 1)
    for (; p + 2 <= p1; p += 2) {
      panel_pair(x, K, panel_at(panels, K, p), panel_at(panels, K, p + 1), out);
      panel_store(out, 1, bias, y, ldy, N, p);
      panel_store(out + kPanel, 1, bias, y, ldy, N, p + 1);
    }
  const int64_t groups = (M + kPanelTileRows - 1) / kPanelTileRows, per = (M + groups - 1) / groups;
  if (groups == 1) {
    for (; p < p1; ++p) {
      panel_tile(x, K, M, K, panel_at(panels, K, p), out);
      panel_store(out, M, bias, y, ldy, N, p);
    }
    return;
  }
  std::vector<float> sums(groups * kPanelTileRows * kPanel);
  for (; p < p1; ++p) {
    const wt* pw = panel_at(panels, K, p);
    for (int64_t k0 = 0; k0 < K; k0 += kPanelSliceK) {
      const int64_t kn = std::min(kPanelSliceK, K - k0);
      for (int64_t g = 0, m0 = 0; m0 < M; ++g, m0 += per)
        panel_tile(x + m0 * K + k0, K, std::min<int64_t>(per, M - m0), kn, pw + k0 * kPanel,
                   sums.data() + g * kPanelTileRows * kPanel, k0 > 0);
    }
    for (int64_t g = 0, m0 = 0; m0 < M; ++g, m0 += per)
      panel_store(sums.data() + g * kPanelTileRows * kPanel, std::min<int64_t>(per, M - m0), bias, y + m0 * ldy, ldy, N, p);
  }
}

// ---------------------------------------------------------------------------------------------
// bfloat16 panels (matmul_precision="bfloat16"): the same column panels, with each weight and
// each activation rounded to bfloat16 and products summed in float32 by AVX512-BF16 dot products
// (vdpbf16ps: one instruction multiplies 16 pairs of bfloat16 per 512 bits and adds both
// products to a float32 lane). A panel holds columns 16p..16p+15 as [ceil(K/2)][16][2]: for each
// pair of k, the 16 columns' two weights side by side, so one 64-byte load feeds 16 outputs for
// two k. An activation row is the matching [ceil(K/2)] pairs (bf16_pairs).
//
// Twice the multiply-adds per instruction of the float32 kernels: while a one-row step streams
// the weights at memory speed either way, a 9-row product (a verify step, a diffusion canvas,
// a batch) no longer waits on arithmetic. Every output is one chain of pair dot products over k
// in order, whatever the kernel and row count, so rows keep the bits of a one-row step; the
// results differ from the float32 kernels' by the rounding of both operands to 8 significant
// bits. Without AVX512-BF16 a scalar loop computes the same products (exact in float32) and
// adds them in the instruction's order.
static constexpr int64_t kBf16TileRows = 16;   // 16 accumulators + weight + broadcast of 32 registers
static constexpr int64_t kBf16SliceK2 = 64;    // pairs of k per slice when several groups share a panel

// float32 -> bfloat16, round to nearest even (NaN stays NaN); the vector form below gives the same bits.
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

static inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// out[m * K2 + j] = the bfloat16 pair (x[m][2j], x[m][2j + 1]) (low half first; a zero pads an
// odd K), for M rows of x with row stride ldx.
static inline void bf16_pairs(const float* x, int64_t ldx, int64_t M, int64_t K, uint32_t* out) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    uint16_t* o = reinterpret_cast<uint16_t*>(out + m * K2);
    int64_t k = 0;
#if defined(LEAPFROG_AVX512)
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (; k + 16 <= K; k += 16) {
      const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(xr + k));
      const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
      const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs_mask), inf);
      const __m512i h = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), nan,
                                              _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), _mm512_cvtepi32_epi16(h));
    }
#endif
    for (; k < K; ++k) o[k] = to_bf16(xr[k]);
    if (K & 1) o[K] = 0;
  }
}

#if defined(LEAPFROG_AVX512) && defined(__AVX512BF16__)
#define LEAPFROG_BF16_SIMD 1
#endif

// out[r][c] = sum over pairs j < K2 of the pair dot product of x row r's pair j and the
// panel's column c pair j, r < R; with resume the sums continue from out.
template <int R>
__attribute__((noinline)) static void bf16_block(const uint32_t* __restrict xp, int64_t ldx, int64_t K2,
                                                 const uint16_t* __restrict pw, float* __restrict out,
                                                 bool resume = false) {
#if defined(LEAPFROG_BF16_SIMD)
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = resume ? _mm512_loadu_ps(out + r * kPanel) : _mm512_setzero_ps();
  constexpr int64_t ahead = kPanelPrefetch / (2 * kPanel * 2);
  for (int64_t j = 0; j < K2; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(pw + (j + ahead) * 2 * kPanel), _MM_HINT_T0);
    const __m512bh w = (__m512bh)_mm512_loadu_si512(pw + j * 2 * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * ldx + j])), w);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    float* o = out + r * kPanel;
    if (!resume)
      for (int64_t c = 0; c < kPanel; ++c) o[c] = 0.f;
    for (int64_t j = 0; j < K2; ++j) {
      const uint32_t xv = xp[r * ldx + j];
      const float x0 = from_bf16(static_cast<uint16_t>(xv & 0xffffu)), x1 = from_bf16(static_cast<uint16_t>(xv >> 16));
      for (int64_t c = 0; c < kPanel; ++c) {
        const uint16_t* w = pw + j * 2 * kPanel + 2 * c;
        o[c] = o[c] + x1 * from_bf16(w[1]);     // products of two bfloat16 are exact in float32
        o[c] = o[c] + x0 * from_bf16(w[0]);
      }
    }
  }
#endif
}

// One row against two panels (32 columns): two accumulator chains instead of one, so a
// one-row step is not held up by the dot products' latency; each output summed as bf16_block.
__attribute__((noinline)) static void bf16_pair(const uint32_t* __restrict xp, int64_t K2, const uint16_t* __restrict pa,
                                                const uint16_t* __restrict pb, float* __restrict out) {
#if defined(LEAPFROG_BF16_SIMD)
  __m512 a = _mm512_setzero_ps(), b = a;
  constexpr int64_t ahead = kPanelPrefetch / (2 * kPanel * 2);
  for (int64_t j = 0; j < K2; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(pa + (j + ahead) * 2 * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pb + (j + ahead) * 2 * kPanel), _MM_HINT_T0);
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[j]));
    a = _mm512_dpbf16_ps(a, xb, (__m512bh)_mm512_loadu_si512(pa + j * 2 * kPanel));
    b = _mm512_dpbf16_ps(b, xb, (__m512bh)_mm512_loadu_si512(pb + j * 2 * kPanel));
  }
  _mm512_storeu_ps(out, a);
  _mm512_storeu_ps(out + kPanel, b);
#else
  bf16_block<1>(xp, K2, K2, pa, out);
  bf16_block<1>(xp, K2, K2, pb, out + kPanel);
#endif
}

static inline void bf16_tile(const uint32_t* xp, int64_t ldx, int64_t rows, int64_t K2, const uint16_t* pw,
                             float* out, bool resume = false) {
  switch (rows) {
    case 16: bf16_block<16>(xp, ldx, K2, pw, out, resume); break;
    case 15: bf16_block<15>(xp, ldx, K2, pw, out, resume); break;
    case 14: bf16_block<14>(xp, ldx, K2, pw, out, resume); break;
    case 13: bf16_block<13>(xp, ldx, K2, pw, out, resume); break;
    case 12: bf16_block<12>(xp, ldx, K2, pw, out, resume); break;
    case 11: bf16_block<11>(xp, ldx, K2, pw, out, resume); break;
    case 10: bf16_block<10>(xp, ldx, K2, pw, out, resume); break;
    case 9: bf16_block<9>(xp, ldx, K2, pw, out, resume); break;
    case 8: bf16_block<8>(xp, ldx, K2, pw, out, resume); break;
    case 7: bf16_block<7>(xp, ldx, K2, pw, out, resume); break;
    case 6: bf16_block<6>(xp, ldx, K2, pw, out, resume); break;
    case 5: bf16_block<5>(xp, ldx, K2, pw, out, resume); break;
    case 4: bf16_block<4>(xp, ldx, K2, pw, out, resume); break;
    case 3: bf16_block<3>(xp, ldx, K2, pw, out, resume); break;
    case 2: bf16_block<2>(xp, ldx, K2, pw, out, resume); break;
    default: bf16_block<1>(xp, ldx, K2, pw, out, resume); break;
  }
}

// y[m, :] = x[m] W^T + bias over bfloat16 panels p0..p1-1, for M rows given as bf16_pairs (row
// stride K2 pairs) and of y (row stride ldy): panel_rows' schedule with bf16_block's tiles.
static inline void panel_rows_bf16(const uint32_t* xp, int64_t M, int64_t K2, const uint16_t* panels, int64_t p0,
                                   int64_t p1, const float* bias, float* y, int64_t ldy, int64_t N) {
  alignas(64) float out[kBf16TileRows * kPanel];
  const int64_t stride = K2 * 2 * kPanel;     // uint16 per panel
  int64_t p = p0;
  if (M == 1)
    for (; p + 2 <= p1; p += 2) {
      bf16_pair(xp, K2, panels + p * stride, panels + (p + 1) * stride, out);
      panel_store(out, 1, bias, y, ldy, N, p);
      panel_store(out + kPanel, 1, bias, y, ldy, N, p + 1);
    }
  const int64_t groups = (M + kBf16TileRows - 1) / kBf16TileRows, per = (M + groups - 1) / groups;
  if (groups == 1) {
    for (; p < p1; ++p) {
      bf16_tile(xp, K2, M, K2, panels + p * stride, out);
      panel_store(out, M, bias, y, ldy, N, p);
    }
    return;
  }
  std::vector<float> sums(groups * kBf16TileRows * kPanel);
  for (; p < p1; ++p) {
    const uint16_t* pw = panels + p * stride;
    for (int64_t j0 = 0; j0 < K2; j0 += kBf16SliceK2) {
      const int64_t jn = std::min(kBf16SliceK2, K2 - j0);
      for (int64_t g = 0, m0 = 0; m0 < M; ++g, m0 += per)
        bf16_tile(xp + m0 * K2 + j0, K2, std::min<int64_t>(per, M - m0), jn, pw + j0 * 2 * kPanel,
                  sums.data() + g * kBf16TileRows * kPanel, j0 > 0);
    }
    for (int64_t g = 0, m0 = 0; m0 < M; ++g, m0 += per)
      panel_store(sums.data() + g * kBf16TileRows * kPanel, std::min<int64_t>(per, M - m0), bias, y + m0 * ldy, ldy, N, p);
  }
}

// ---------------------------------------------------------------------------------------------
// Quantized panels: GGUF weights kept in 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), read at
// 4.5-9 bits a weight instead of 32. Every block type is held as w = d * q + m with an unsigned
// q (Q4_0's d * (q - 8) becomes m = -8 d, Q8_0's signed q is shifted by 128 with m = -128 d;
// both exact), d and m float16 as the file stores them. A panel (16 output columns) holds, for
// each block b of 32 k: the 16 columns' d, then their m (float16, 64 bytes), then the 32 k's
// values of the 16 columns: 4-bit (byte j of a k holds column j in its low nibble and j + 8 in
// its high one, 8 bytes a k) or 8-bit (16 bytes a k).
//
// Per row and block, the 16 sums of x[k] q[k][c] over the block's k in order (one fused
// multiply-add chain from zero), then acc = fma(d, sum, acc) and acc = fma(m, xs, acc), xs being
// the block's sum of x (a plain left-to-right sum). Each output's chain is the same whatever the
// rows sharing its tile or the vector width (AVX-512, AVX2 or none), so a row's result does not
// depend on its batch.
static constexpr int64_t kQBlock = 32;
static constexpr int64_t kQ4PanelBytes = 64 + kQBlock * kPanel / 2;
static constexpr int64_t kQ8PanelBytes = 64 + kQBlock * kPanel;
// Blocks ahead that a quantized tile asks the memory for, every cache line of the block: with
// several rows the products run long enough per block that the hardware prefetcher alone
// leaves the next blocks' lines late.
static constexpr int64_t kQPrefetchBlocks = 8;
// Rows a tile decodes each weight vector for: as many as the accumulators (2 per row) and the
// decoded weights fit the vector registers (32 with AVX-512, 16 with AVX2).
#if defined(LEAPFROG_AVX512)
static constexpr int kQTileRows = 8;
#else
static constexpr int kQTileRows = 4;
#endif

// f(std::integral_constant<int, R>) for the tile's row count R in [1, kQTileRows].
template <typename F>
static inline void with_tile_rows(int64_t rows, F&& f) {
  switch (rows) {
#if defined(LEAPFROG_AVX512)
    case 8: return f(std::integral_constant<int, 8>());
    case 7: return f(std::integral_constant<int, 7>());
    case 6: return f(std::integral_constant<int, 6>());
    case 5: return f(std::integral_constant<int, 5>());
#endif
    case 4: return f(std::integral_constant<int, 4>());
    case 3: return f(std::integral_constant<int, 3>());
    case 2: return f(std::integral_constant<int, 2>());
    default: return f(std::integral_constant<int, 1>());
  }
}

#if defined(LEAPFROG_AVX512)
// A quantized panel block's 16 scales d and 16 offsets m, widened from float16.
static inline void q_block_scales(const uint8_t* blk, __m512& d, __m512& m) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
}
#endif

// Asks the memory for every cache line of the block kQPrefetchBlocks ahead of blk (BB bytes a block).
static inline void q_prefetch_block(const uint8_t* blk, int64_t BB) {
  for (int64_t line = 0; line < BB; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + kQPrefetchBlocks * BB + line), _MM_HINT_T0);
}

#if defined(LEAPFROG_AVX2) && defined(__F16C__)
// A quantized panel block's scales d and offsets m as two 8-lane halves (columns 0-7, 8-15).
static inline void q_block_scales8(const uint8_t* blk, __m256& d0, __m256& d1, __m256& m0, __m256& m1) {
  d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
  m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32)));
  m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 48)));
}
#endif

// The block sums of x: xs[r * NB + b] = x[r][32 b] + ... + x[r][32 b + 31], left to right.
static inline void q_block_sums(const float* x, int64_t ldx, int64_t M, int64_t NB, float* xs) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < NB; ++b) {
      const float* v = x + r * ldx + b * kQBlock;
      float s = 0.f;
      for (int64_t k = 0; k < kQBlock; ++k) s += v[k];
      xs[r * NB + b] = s;
    }
}

static inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// One tile of R rows against panel pw (NB blocks of BB bytes): out[r][0..15].
template <int R, int BITS>
static inline void q_panel_tile(const float* x, int64_t ldx, const float* xs, int64_t NB, const uint8_t* pw,
                                float* out) {
  constexpr int64_t BB = BITS == 4 ? kQ4PanelBytes : kQ8PanelBytes;
#if defined(LEAPFROG_AVX512)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* blk = pw + b * BB;
    q_prefetch_block(blk, BB);
    __m512 d, m;
    q_block_scales(blk, d, m);
    const uint8_t* q = blk + 64;
    __m512 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t k = 0; k < kQBlock; ++k) {
      __m128i bytes;
      if (BITS == 4) {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 8));
        bytes = _mm_unpacklo_epi64(_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low));
      } else {
        bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16));
      }
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
      for (int r = 0; r < R; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + b * kQBlock + k]), w, s[r]);
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(d, s[r], acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * NB + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
#elif defined(LEAPFROG_AVX2) && defined(__F16C__)
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* blk = pw + b * BB;
    __m256 d0, d1, m0, m1;
    q_block_scales8(blk, d0, d1, m0, m1);
    const uint8_t* q = blk + 64;
    __m256 s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kQBlock; ++k) {
      __m128i lo8, hi8;
      if (BITS == 4) {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 8));
        lo8 = _mm_and_si128(v, low);
        hi8 = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      } else {
        lo8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 16));
        hi8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 16 + 8));
      }
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo8));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi8));
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(x[r * ldx + b * kQBlock + k]);
        s[r][0] = _mm256_fmadd_ps(xv, w0, s[r][0]);
        s[r][1] = _mm256_fmadd_ps(xv, w1, s[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xsv = _mm256_set1_ps(xs[r * NB + b]);
      acc[r][0] = _mm256_fmadd_ps(m0, xsv, _mm256_fmadd_ps(d0, s[r][0], acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(m1, xsv, _mm256_fmadd_ps(d1, s[r][1], acc[r][1]));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(out + r * kPanel + 8, acc[r][1]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < kPanel; ++c) out[r * kPanel + c] = 0.f;
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* blk = pw + b * BB;
    uint16_t dh[kPanel], mh[kPanel];
    std::memcpy(dh, blk, sizeof(dh));
    std::memcpy(mh, blk + 32, sizeof(mh));
    const uint8_t* q = blk + 64;
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kPanel; ++c) {
        float s = 0.f;
        for (int64_t k = 0; k < kQBlock; ++k) {
          const int v = BITS == 4 ? (c < 8 ? q[k * 8 + c] & 0x0F : q[k * 8 + c - 8] >> 4) : q[k * 16 + c];
          s = std::fma(x[r * ldx + b * kQBlock + k], static_cast<float>(v), s);
        }
        float& o = out[r * kPanel + c];
        o = std::fma(half_to_float(dh[c]), s, o);
        o = std::fma(half_to_float(mh[c]), xs[r * NB + b], o);
      }
  }
#endif
}

template <int BITS>
static inline void q_panel_rows_bits(const float* x, int64_t M, int64_t K, const uint8_t* panels, int64_t p0,
                                     int64_t p1, const float* bias, float* y, int64_t ldy, int64_t N) {
  constexpr int64_t BB = BITS == 4 ? kQ4PanelBytes : kQ8PanelBytes;
  const int64_t NB = K / kQBlock;
  thread_local std::vector<float> xs;
  if (static_cast<int64_t>(xs.size()) < M * NB) xs.resize(M * NB);
  q_block_sums(x, K, M, NB, xs.data());
  alignas(64) float out[kQTileRows * kPanel];
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* pw = panels + p * NB * BB;
    for (int64_t r0 = 0; r0 < M; r0 += kQTileRows) {
      const int64_t R = std::min<int64_t>(kQTileRows, M - r0);
      const float* xr = x + r0 * K;
      const float* sr = xs.data() + r0 * NB;
      with_tile_rows(R, [&](auto rows) { q_panel_tile<rows(), BITS>(xr, K, sr, NB, pw, out); });
      panel_store(out, R, bias, y + r0 * ldy, ldy, N, p);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Quantized panels with integer products (matmul_precision="int8", AVX512-VNNI): llama.cpp's
// scheme. Each row of x is quantized per block of 32 to int8 (scale a = max |x| / 127, round to
// nearest), and vpdpbusd multiplies 4 unsigned weight bytes by 4 signed activation bytes and adds
// them to an int32 lane: 64 multiply-adds an instruction. Per block: s = sum q xq (exact, int32),
// then acc = fma(d, float(s) * a, acc) and acc = fma(m, a * sum xq, acc). The panel's value bytes
// are laid out for it: 8 groups of 4 k, each [16 columns][4 k] (64 bytes); 4-bit values pair
// groups 2i and 2i + 1 in the low and high nibbles of one 64-byte run.
struct QRows {             // x quantized per block: values, scales, and sums of the values
  std::vector<int8_t> q;
  std::vector<float> a;
  std::vector<int32_t> sum;
  std::vector<float> am;   // a * float(sum): the offsets' factor, rounded once per row and block
};

static inline void q8_rows(const float* x, int64_t ldx, int64_t M, int64_t K, QRows& out) {
  const int64_t NB = K / kQBlock;
  out.q.resize(M * K);
  out.a.resize(M * NB);
  out.sum.resize(M * NB);
  out.am.resize(M * NB);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < NB; ++b) {
      const float* v = x + r * ldx + b * kQBlock;
      int8_t* q = out.q.data() + r * K + b * kQBlock;
#if defined(LEAPFROG_AVX512)
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float a = amax / 127.f, inv = a > 0.f ? 1.f / a : 0.f;
      const __m512 iv = _mm512_set1_ps(inv);
      // rounded to nearest even, as lrintf under the default rounding mode
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
      const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(LEAPFROG_AVX2)
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 v8[4];
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v8[i] = _mm256_loadu_ps(v + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v8[i]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float amax = _mm_cvtss_f32(m4);
      const float a = amax / 127.f, inv = a > 0.f ? 1.f / a : 0.f;
      const __m256 iv = _mm256_set1_ps(inv);
      __m256i qi[4];
      for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v8[i], iv));   // nearest even
      const __m256i w16 = _mm256_permute4x64_epi64(
          _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_shuffle_epi32(w16, 0xD8));
      const __m256i t = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
      const int32_t s = _mm_cvtsi128_si32(t4);
#else
      float amax = 0.f;
      for (int64_t k = 0; k < kQBlock; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float a = amax / 127.f, inv = a > 0.f ? 1.f / a : 0.f;
      int32_t s = 0;
      for (int64_t k = 0; k < kQBlock; ++k) {
        q[k] = static_cast<int8_t>(std::lrintf(v[k] * inv));
        s += q[k];
      }
#endif
      out.a[r * NB + b] = a;
      out.sum[r * NB + b] = s;
      out.am[r * NB + b] = a * static_cast<float>(s);
    }
}

#if defined(LEAPFROG_AVX512) && defined(__AVX512VNNI__)
#define LEAPFROG_VNNI 1
// s + w (16 lanes of 4 unsigned bytes) . the 4 signed bytes at x, repeated in every lane: one
// instruction, the 4 bytes read by its own broadcast (compilers load them apart otherwise).
static inline __m512i dpbusd_broadcast(__m512i s, __m512i w, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return s;
}
template <int R, int BITS>
static inline void q_panel_tile_int8(const QRows& xq, int64_t r0, int64_t K, int64_t NB, const uint8_t* pw,
                                     float* out) {
  constexpr int64_t BB = BITS == 4 ? kQ4PanelBytes : kQ8PanelBytes;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* blk = pw + b * BB;
    q_prefetch_block(blk, BB);
    __m512 d, m;
    q_block_scales(blk, d, m);
    const uint8_t* q = blk + 64;
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      __m512i w;
      if (BITS == 4) {
        const __m512i v = _mm512_loadu_si512(q + (g / 2) * 64);
        w = (g & 1) ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low) : _mm512_and_si512(v, low);
      } else {
        w = _mm512_loadu_si512(q + g * 64);
      }
      for (int r = 0; r < R; ++r) s[r] = dpbusd_broadcast(s[r], w, xq.q.data() + (r0 + r) * K + b * kQBlock + 4 * g);
    }
    for (int r = 0; r < R; ++r) {
      const float a = xq.a[(r0 + r) * NB + b];
      acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(s[r]), _mm512_set1_ps(a)), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq.am[(r0 + r) * NB + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
}
#endif

#if !defined(LEAPFROG_VNNI) && defined(LEAPFROG_AVX2) && defined(__F16C__)
#define LEAPFROG_INT8_AVX2 1
// The same tile with AVX2 (llama.cpp's route there): vpmaddubsw multiplies unsigned weight bytes
// by signed activation bytes and adds neighbouring pairs into 16 bits, vpmaddwd adds those pairs
// into 32-bit lanes: per lane the sum over 4 k, as one vpdpbusd. A pair of 4-bit values times
// activations (|xq| <= 127) cannot overflow 16 bits; 8-bit values (0..255) could, so they are
// taken as signed (q - 128) with their sign moved onto the activation, and 128 times the block's
// activation sum is added back. Integer sums are exact, and the float steps are the VNNI tile's,
// so both give the same bits. Two 8-column halves per 16-column panel.
//
// Sixteen vector registers hold the block's integer sums (2 a row) and the decoded weights; the
// float accumulators live in `out` (read and written once a block). Each integer sum is pinned
// to its register after every add: left free, the compiler reorders the additions (integer sums
// are associative) into all the products first, spilled to the stack, then the sums.
template <int R, int BITS>
static inline void q_panel_tile_int8(const QRows& xq, int64_t r0, int64_t K, int64_t NB, const uint8_t* pw,
                                     float* out) {
  constexpr int64_t BB = BITS == 4 ? kQ4PanelBytes : kQ8PanelBytes;
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanel, _mm256_setzero_ps());
    _mm256_storeu_ps(out + r * kPanel + 8, _mm256_setzero_ps());
  }
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* blk = pw + b * BB;
    q_prefetch_block(blk, BB);
    const uint8_t* q = blk + 64;
    __m256i s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      __m256i w[2], wabs[2];
      for (int h = 0; h < 2; ++h) {
        if (BITS == 4) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (g / 2) * 64 + h * 32));
          w[h] = (g & 1) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low) : _mm256_and_si256(v, low);
        } else {
          w[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * 64 + h * 32)), flip);
          wabs[h] = _mm256_abs_epi8(w[h]);
        }
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq.q.data() + (r0 + r) * K + b * kQBlock + 4 * g, 4);
        const __m256i xv = _mm256_set1_epi32(four);
        for (int h = 0; h < 2; ++h) {
          if (BITS == 4) {            // 8 groups of pair sums (each |.| <= 2 * 15 * 127) fit 16 bits
            s[r][h] = _mm256_add_epi16(s[r][h], _mm256_maddubs_epi16(w[h], xv));
          } else {
            const __m256i pairs = _mm256_maddubs_epi16(wabs[h], _mm256_sign_epi8(xv, w[h]));
            s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(pairs, ones));
          }
          asm("" : "+v"(s[r][h]));
        }
      }
    }
    __m256 d0, d1, m0, m1;
    q_block_scales8(blk, d0, d1, m0, m1);
    for (int r = 0; r < R; ++r) {
      const float a = xq.a[(r0 + r) * NB + b];
      const int32_t xs = xq.sum[(r0 + r) * NB + b];
      const __m256 av = _mm256_set1_ps(a), mv = _mm256_set1_ps(xq.am[(r0 + r) * NB + b]);
      const __m256i back = _mm256_set1_epi32(BITS == 4 ? 0 : 128 * xs);
      for (int h = 0; h < 2; ++h) {
        const __m256i s32 = BITS == 4 ? _mm256_madd_epi16(s[r][h], ones) : s[r][h];
        const __m256 sf = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s32, back)), av);
        __m256 acc = _mm256_loadu_ps(out + r * kPanel + 8 * h);
        acc = _mm256_fmadd_ps(h ? d1 : d0, sf, acc);
        acc = _mm256_fmadd_ps(h ? m1 : m0, mv, acc);
        _mm256_storeu_ps(out + r * kPanel + 8 * h, acc);
      }
    }
  }
}
#endif

static inline bool int8_products_available() {
#if defined(LEAPFROG_VNNI) || defined(LEAPFROG_INT8_AVX2)
  return true;
#else
  return false;
#endif
}

#if defined(LEAPFROG_VNNI) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__) && __GNUC__ >= 11
#define LEAPFROG_AMX 1
// AMX (Intel Sapphire Rapids and later), chosen at run time. TDPBSUD multiplies a tile of signed
// activation bytes [rows][32 k] by a tile of unsigned weight bytes [8 groups of 4 k][16 columns x
// 4 k] (the int8 panel layout, 4-bit values widened to bytes) into int32 [rows][16 columns]: a
// block of a panel for up to 16 rows in one instruction, where the VNNI tile issues 8 vpdpbusd a
// row. The integer sums are exact and the float steps after them are the VNNI tile's, in the
// same order, so both give the same bits. Linux hands a process the tile state only when asked
// (arch_prctl(ARCH_REQ_XCOMP_PERM)); refused or absent, the VNNI tile runs.
static constexpr int64_t kAmxRows = 16;
// Below this many rows the VNNI tile runs: one row reads the weights at memory speed either way.
static constexpr int64_t kAmxMinRows = 4;

static bool amx_granted() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0));
  if (a < 7) return false;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;             // AMX-TILE, AMX-INT8
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
  if (!((c >> 27) & 1)) return false;                                   // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;                    // XTILECFG, XTILEDATA
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtileData) == 0;
}

// Whether the CPU has AMX-INT8 and the OS granted its tile state (asked once per process;
// LEAPFROG_AMX=0 never asks).
static inline bool amx_available() {
  static const bool granted = [] {
    const char* env = std::getenv("LEAPFROG_AMX");
    return !(env && env[0] == '0') && amx_granted();
  }();
  return granted;
}

// Whether products of kAmxMinRows rows or more use the AMX tile (tests turn it off to compare).
inline std::atomic<bool>& amx_products_on() {
  static std::atomic<bool> on{true};
  return on;
}

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-2 hold one block's sums, activations and weights, 3-5 the next block's, R rows each.
__attribute__((target("amx-tile,amx-int8")))
static inline void amx_configure(int64_t R) {
  AmxTileConfig cfg;
  for (int t = 0; t < 6; t += 3) {
    cfg.rows[t] = static_cast<uint8_t>(R);
    cfg.colsb[t] = kPanel * 4;
    cfg.rows[t + 1] = static_cast<uint8_t>(R);
    cfg.colsb[t + 1] = kQBlock;
    cfg.rows[t + 2] = kQBlock / 4;
    cfg.colsb[t + 2] = kPanel * 4;
  }
  _tile_loadconfig(&cfg);
}

// A block's weight bytes in the tile's layout: 8-bit panels already are; 4-bit ones widen run i
// (64 bytes) into groups 2i (low nibbles) and 2i + 1 (high nibbles).
template <int BITS>
static inline const uint8_t* amx_weights(const uint8_t* q, uint8_t* buf) {
  if (BITS == 8) return q;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i v = _mm512_loadu_si512(q + i * 64);
    _mm512_store_si512(buf + 2 * i * 64, _mm512_and_si512(v, low));
    _mm512_store_si512(buf + (2 * i + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
  return buf;
}

template <int BITS>
__attribute__((target("amx-tile,amx-int8")))
static void q_panel_rows_amx(const QRows& xq, int64_t m0, int64_t M, int64_t K, const uint8_t* panels,
                             int64_t p0, int64_t p1, const float* bias, float* y, int64_t ldy, int64_t N) {
  constexpr int64_t BB = BITS == 4 ? kQ4PanelBytes : kQ8PanelBytes;
  const int64_t NB = K / kQBlock;
  alignas(64) uint8_t wbuf[2][8 * 64];
  alignas(64) int32_t sums[2][kAmxRows * kPanel];
  alignas(64) float out[kAmxRows * kPanel];
  __m512 acc[kAmxRows];
  int64_t configured = 0;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* pw = panels + p * NB * BB;
    for (int64_t r0 = m0; r0 < m0 + M; r0 += kAmxRows) {
      const int64_t R = std::min<int64_t>(kAmxRows, m0 + M - r0);
      if (R != configured) {
        amx_configure(R);
        configured = R;
      }
      for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      const int8_t* xr = xq.q.data() + r0 * K;
      for (int64_t b = 0; b < NB; b += 2) {
        const bool two = b + 1 < NB;
        const uint8_t* blk0 = pw + b * BB;
        q_prefetch_block(blk0, BB);
        _tile_zero(0);
        _tile_loadd(1, xr + b * kQBlock, K);
        _tile_loadd(2, amx_weights<BITS>(blk0 + 64, wbuf[0]), 64);
        if (two) {
          const uint8_t* blk1 = blk0 + BB;
          q_prefetch_block(blk1, BB);
          _tile_zero(3);
          _tile_loadd(4, xr + (b + 1) * kQBlock, K);
          _tile_loadd(5, amx_weights<BITS>(blk1 + 64, wbuf[1]), 64);
        }
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, sums[0], kPanel * 4);
        if (two) {
          _tile_dpbsud(3, 4, 5);
          _tile_stored(3, sums[1], kPanel * 4);
        }
        for (int64_t j = 0; j < (two ? 2 : 1); ++j) {
          __m512 d, m;
          q_block_scales(blk0 + j * BB, d, m);
          for (int64_t r = 0; r < R; ++r) {
            const int64_t i = (r0 + r) * NB + b + j;
            const float a = xq.a[i];
            const __m512i s = _mm512_load_si512(sums[j] + r * kPanel);
            acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(a)), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq.am[i]), acc[r]);
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) _mm512_store_ps(out + r * kPanel, acc[r]);
      panel_store(out, R, bias, y + (r0 - m0) * ldy, ldy, N, p);
    }
  }
  _tile_release();
}
#endif

// q_panel_rows for int8 panels (see above); without AVX512-VNNI or AVX2, the same integer
// products one at a time (the same bits, slowly: the engine does not choose int8 there).
// Rows m0 .. m0 + M - 1 of x, quantized in xq (q8_rows over all rows, once per product).
template <int BITS>
static inline void q_panel_rows_int8_bits(const QRows& xq, int64_t m0, int64_t M, int64_t K, const uint8_t* panels,
                                          int64_t p0, int64_t p1, const float* bias, float* y, int64_t ldy, int64_t N) {
  constexpr int64_t BB = BITS == 4 ? kQ4PanelBytes : kQ8PanelBytes;
  const int64_t NB = K / kQBlock;
#if defined(LEAPFROG_AMX)
  if (M >= kAmxMinRows && amx_available() && amx_products_on().load(std::memory_order_relaxed))
    return q_panel_rows_amx<BITS>(xq, m0, M, K, panels, p0, p1, bias, y, ldy, N);
#endif
  alignas(64) float out[kQTileRows * kPanel];
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* pw = panels + p * NB * BB;
    for (int64_t r0 = m0; r0 < m0 + M; r0 += kQTileRows) {
      const int64_t R = std::min<int64_t>(kQTileRows, m0 + M - r0);
#if defined(LEAPFROG_VNNI) || defined(LEAPFROG_INT8_AVX2)
      with_tile_rows(R, [&](auto rows) { q_panel_tile_int8<rows(), BITS>(xq, r0, K, NB, pw, out); });
#else
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < kPanel; ++c) {
          float o = 0.f;
          for (int64_t b = 0; b < NB; ++b) {
            const uint8_t* blk = pw + b * BB;
            uint16_t dh, mh;
            std::memcpy(&dh, blk + 2 * c, 2);
            std::memcpy(&mh, blk + 32 + 2 * c, 2);
            int32_t s = 0;
            for (int g = 0; g < 8; ++g)
              for (int j = 0; j < 4; ++j) {
                const uint8_t* q = blk + 64;
                const int v = BITS == 4 ? ((q[(g / 2) * 64 + c * 4 + j] >> ((g & 1) * 4)) & 0x0F) : q[g * 64 + c * 4 + j];
                s += v * xq.q[(r0 + r) * K + b * kQBlock + 4 * g + j];
              }
            const float a = xq.a[(r0 + r) * NB + b];
            o = std::fma(half_to_float(dh), static_cast<float>(s) * a, o);
            o = std::fma(half_to_float(mh), a * static_cast<float>(xq.sum[(r0 + r) * NB + b]), o);
          }
          out[r * kPanel + c] = o;
        }
#endif
      panel_store(out, R, bias, y + (r0 - m0) * ldy, ldy, N, p);
    }
  }
}

// Bytes a quantized panel holds per block (kQ4PanelBytes or kQ8PanelBytes): its bit width.
static inline int q_panel_bits(int64_t bytes_per_block) {
  return bytes_per_block == kQ4PanelBytes ? 4 : bytes_per_block == kQ8PanelBytes ? 8 : 0;
}

// y[m, :] = x[m] W^T + bias over quantized panels p0..p1-1 ([P, K / 32, bytes per block] uint8),
// for M rows of x (row stride K) and of y (row stride ldy).
static inline void q_panel_rows(const float* x, int64_t M, int64_t K, const uint8_t* panels, int64_t bytes_per_block,
                                int64_t p0, int64_t p1, const float* bias, float* y, int64_t ldy, int64_t N) {
  if (q_panel_bits(bytes_per_block) == 4) q_panel_rows_bits<4>(x, M, K, panels, p0, p1, bias, y, ldy, N);
  else q_panel_rows_bits<8>(x, M, K, panels, p0, p1, bias, y, ldy, N);
}

// The same over int8 panels (held as torch int8: their value bytes in the integer layout), for
// rows m0 .. m0 + M - 1 of the rows quantized in xq; y points at row m0's output.
static inline void q_panel_rows_int8(const QRows& xq, int64_t m0, int64_t M, int64_t K, const uint8_t* panels,
                                     int64_t bytes_per_block, int64_t p0, int64_t p1, const float* bias, float* y,
                                     int64_t ldy, int64_t N) {
  if (q_panel_bits(bytes_per_block) == 4) q_panel_rows_int8_bits<4>(xq, m0, M, K, panels, p0, p1, bias, y, ldy, N);
  else q_panel_rows_int8_bits<8>(xq, m0, M, K, panels, p0, p1, bias, y, ldy, N);
}

// Row v of the weight held in quantized panels, dequantized (w = d * q + m, the product and the
// sum rounded apart, as the gguf package's float32 dequantization): out[0..32 NB - 1]. int8:
// the panels are in the integer layout (q_panel_rows_int8), else in the plain one.
static inline void q_panel_row(const uint8_t* panels, int64_t bytes_per_block, bool int8, int64_t NB, int64_t v,
                               float* out) {
  const int bits = q_panel_bits(bytes_per_block);
  const int64_t c = v % kPanel;
  const uint8_t* pw = panels + (v / kPanel) * NB * bytes_per_block;
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* blk = pw + b * bytes_per_block;
    uint16_t dh, mh;
    std::memcpy(&dh, blk + 2 * c, 2);
    std::memcpy(&mh, blk + 32 + 2 * c, 2);
    const float d = half_to_float(dh), m = half_to_float(mh);
    const uint8_t* q = blk + 64;
    for (int64_t k = 0; k < kQBlock; ++k) {
      int v8;
      if (int8) {
        const int64_t g = k / 4, j = k % 4;
        v8 = bits == 4 ? (q[(g / 2) * 64 + c * 4 + j] >> ((g & 1) * 4)) & 0x0F : q[g * 64 + c * 4 + j];
      } else {
        v8 = bits == 4 ? (c < 8 ? q[k * 8 + c] & 0x0F : q[k * 8 + c - 8] >> 4) : q[k * 16 + c];
      }
      const float w = d * static_cast<float>(v8);
      out[b * kQBlock + k] = w + m;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sampling one token from a row of logits (CPU): greedy (argmax, lowest index among ties, NaN
// wins as in torch.argmax), or temperature with top-k, top-p and min-p (applied in that order,
// with the semantics of leapfrog/sample/sampler.py's filter_logits), drawn by inverting the CDF at one
// uniform number. The uniform comes from a counter-based generator, SplitMix64 of (key,
// counter): a request's key is its seed (or one drawn from the engine's seed) and the counter
// is its number of draws so far, so a request's draws depend on nothing else in the batch and
// on no step boundary.
struct RowSampling {
  float temperature = 0.f;   // below kGreedyBelow: greedy
  int64_t top_k = 0;         // 0: off
  float top_p = 1.f;
  float min_p = 0.f;
  uint64_t key = 0;
  uint64_t counter = 0;
};
static constexpr float kGreedyBelow = 1e-5f;   // SamplingParams.GREEDY_BELOW_TEMPERATURE

static inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline double uniform01(uint64_t key, uint64_t counter) {
  return static_cast<double>(splitmix64(splitmix64(key) ^ counter) >> 11) * 0x1.0p-53;
}

static inline int64_t argmax_row(const float* x, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t am = 0;
  for (int64_t i = 0; i < V; ++i) {
    const float v = x[i];
    if (std::isnan(v)) return i;
    if (v > m) { m = v; am = i; }
  }
  return am;
}

// softmax(x)[t] over a row of V logits.
static inline float row_prob(const float* x, int64_t V, int64_t t) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) m = x[i] > m ? x[i] : m;
  if (!std::isfinite(m)) return 0.f;
  double z = 0.0;
  int64_t i = 0;
#if defined(LEAPFROG_AVX2)
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) acc = _mm256_add_ps(acc, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) z += v;
#endif
  for (; i < V; ++i) z += std::exp(x[i] - m);
  return static_cast<float>(std::exp(x[t] - m) / z);
}

struct SampleScratch {
  std::vector<float> p;
  std::vector<float> tmp;
  std::vector<int32_t> idx;
  std::vector<double> blocks;
};

// Tokens per block of the draw's search.
static constexpr int64_t kDrawBlock = 512;

// p[0] + ... + p[n - 1] in double, in vector lanes.
static inline double sum_double(const float* p, int64_t n) {
  int64_t j = 0;
  double z = 0.0;
#if defined(LEAPFROG_AVX512)
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(p + j);
    a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  z = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#elif defined(LEAPFROG_AVX2)
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(p + j);
    a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a0, a1));
  z = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; j < n; ++j) z += p[j];
  return z;
}

// The mass of p strictly above theta, summed in float lanes (an estimate: top_p_threshold
// allows for its rounding).
static inline float mass_above(const float* p, int64_t V, float theta) {
  int64_t j = 0;
  float m = 0.f;
#if defined(LEAPFROG_AVX512)
  const __m512 t = _mm512_set1_ps(theta);
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= V; j += 16) {
    const __m512 v = _mm512_loadu_ps(p + j);
    acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ), acc, v);
  }
  m = _mm512_reduce_add_ps(acc);
#elif defined(LEAPFROG_AVX2)
  const __m256 t = _mm256_set1_ps(theta);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(p + j);
    acc = _mm256_add_ps(acc, _mm256_and_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ), v));
  }
  m = hsum256(acc);
#endif
  for (; j < V; ++j)
    if (p[j] > theta) m += p[j];
  return m;
}

// For top-p over unnormalised probabilities p (at most 1: the largest is exp(0)) whose kept
// mass is `limit`: the largest of the thresholds 2^-1 .. 2^-24 with more than `limit` of the mass
// strictly above it, or 0 where none has. No token at or below it is kept: every token ranked
// above such a token is above the threshold too, and they alone hold more than the limit. The
// float sums are trusted only with a margin well beyond their rounding, so a threshold too close
// to call is passed over for a lower one, which only leaves more candidates to sort.
static inline float top_p_threshold(const float* p, int64_t V, double limit) {
  const double need = limit * 1.01;
  const auto passes = [&](int k) { return static_cast<double>(mass_above(p, V, std::ldexp(1.f, -k))) > need; };
  // mass_above(2^-k) grows with k: the smallest k that passes, tried at 1, 2, 4, 8, 16, 24 (a
  // peaked row, as low temperatures give, passes at once), then halved between.
  int lo = 1, hi = 0, best = 0;
  for (int k = 1;; k = std::min(2 * k, 24)) {
    if (passes(k)) {
      best = k;
      hi = k - 1;
      break;
    }
    lo = k + 1;
    if (k == 24) return 0.f;
  }
  while (lo <= hi) {
    const int k = (lo + hi) / 2;
    if (passes(k)) {
      best = k;
      hi = k - 1;
    } else {
      lo = k + 1;
    }
  }
  return best ? std::ldexp(1.f, -best) : 0.f;
}

// The indices of p strictly above theta, in order, into idx; the other entries of p set to 0.
static inline void top_p_candidates(float* p, int64_t V, float theta, std::vector<int32_t>& idx) {
  idx.resize(V);
  int64_t n = 0, j = 0;
#if defined(LEAPFROG_AVX512)
  const __m512 t = _mm512_set1_ps(theta), zero = _mm512_setzero_ps();
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (; j + 16 <= V; j += 16, ids = _mm512_add_epi32(ids, step)) {
    const __m512 v = _mm512_loadu_ps(p + j);
    const __mmask16 keep = _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ);
    _mm512_mask_compressstoreu_epi32(idx.data() + n, keep, ids);
    n += __builtin_popcount(static_cast<unsigned>(keep));
    _mm512_storeu_ps(p + j, _mm512_mask_blend_ps(keep, zero, v));
  }
#endif
  for (; j < V; ++j) {
    if (p[j] > theta) idx[n++] = static_cast<int32_t>(j);
    else p[j] = 0.f;
  }
  idx.resize(n);
}

// Candidates of a top-p filter sorted whole; more are first narrowed down by selection.
static constexpr size_t kTopPSortRanks = 1024;

static inline int64_t sample_row(const float* logits, int64_t V, const RowSampling& s, SampleScratch& sc) {
  if (!(s.temperature >= kGreedyBelow)) return argmax_row(logits, V);
  sc.p.resize(V);
  float* p = sc.p.data();
  float m = -std::numeric_limits<float>::infinity();
  {
    int64_t i = 0;
    bool nan = false;
#if defined(LEAPFROG_AVX512)
    const __m512 vt = _mm512_set1_ps(s.temperature);
    __m512 vmax = _mm512_set1_ps(m);
    __mmask16 bad = 0;
    for (; i + 16 <= V; i += 16) {
      const __m512 q = _mm512_div_ps(_mm512_loadu_ps(logits + i), vt);
      _mm512_storeu_ps(p + i, q);
      bad |= _mm512_cmp_ps_mask(q, q, _CMP_UNORD_Q);
      vmax = _mm512_max_ps(vmax, q);
    }
    nan = bad != 0;
    m = _mm512_reduce_max_ps(vmax);
#elif defined(LEAPFROG_AVX2)
    const __m256 vt = _mm256_set1_ps(s.temperature);
    __m256 vmax = _mm256_set1_ps(m), bad = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
      const __m256 q = _mm256_div_ps(_mm256_loadu_ps(logits + i), vt);
      _mm256_storeu_ps(p + i, q);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(q, q, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(vmax, q);
    }
    nan = _mm256_movemask_ps(bad) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (const float v : lanes) m = v > m ? v : m;
#endif
    for (; i < V; ++i) {
      p[i] = logits[i] / s.temperature;
      nan = nan || std::isnan(p[i]);
      m = p[i] > m ? p[i] : m;
    }
    if (nan) return argmax_row(logits, V);
  }
  if (m == -std::numeric_limits<float>::infinity()) return argmax_row(logits, V);
  float kth = -std::numeric_limits<float>::infinity();     // top-k: keep values >= the k-th largest
  if (s.top_k > 0 && s.top_k < V) {
    sc.tmp.assign(p, p + V);
    std::nth_element(sc.tmp.begin(), sc.tmp.begin() + (s.top_k - 1), sc.tmp.end(), std::greater<float>());
    kth = sc.tmp[s.top_k - 1];
  }
  // Unnormalised probabilities exp(l - max), zero outside the top k.
  int64_t i = 0;
#if defined(LEAPFROG_AVX2)
  const __m256 vm = _mm256_set1_ps(m), vk = _mm256_set1_ps(kth);
  for (; i + 8 <= V; i += 8) {
    const __m256 l = _mm256_loadu_ps(p + i);
    const __m256 keep = _mm256_cmp_ps(l, vk, _CMP_GE_OQ);
    _mm256_storeu_ps(p + i, _mm256_and_ps(keep, exp256(_mm256_sub_ps(l, vm))));
  }
#endif
  for (; i < V; ++i) p[i] = p[i] >= kth ? std::exp(p[i] - m) : 0.f;
  double z = sum_double(p, V);
  if (s.top_p < 1.f) {
    // Keep the tokens whose mass strictly above them (sorted by probability, then index) is at
    // most top_p. Only candidates that could be kept are sorted: where more than top_p of the
    // mass lies strictly above a threshold, no token at or below it is kept (top_p_threshold);
    // else, a token below (1 - top_p) / V of the mass always has more than top_p above it.
    const double limit = static_cast<double>(s.top_p) * z;
    const float theta = top_p_threshold(p, V, limit);
    sc.idx.clear();
    if (theta > 0.f) {
      top_p_candidates(p, V, theta, sc.idx);
    } else {
      const double floor = (1.0 - s.top_p) * z / static_cast<double>(V);
      for (int64_t j = 0; j < V; ++j) {
        if (p[j] > 0.f && p[j] >= floor) sc.idx.push_back(static_cast<int32_t>(j));
        else p[j] = 0.f;
      }
    }
    const auto before = [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
    // Many candidates (a flat distribution): halve the unresolved ranks [lo, hi) by selection
    // while the mass of the upper half settles which side the last kept token is on, then sort
    // only what is left. Ranks before lo are kept (mass `above`); from hi on, dropped.
    int32_t* idx = sc.idx.data();
    size_t lo = 0, hi = sc.idx.size();
    double above = 0.0;
    while (hi - lo > kTopPSortRanks) {
      const size_t mid = lo + (hi - lo) / 2;
      std::nth_element(idx + lo, idx + mid, idx + hi, before);
      double m = 0.0;
      for (size_t j = lo; j < mid; ++j) m += p[idx[j]];
      if (above + m < limit * (1.0 - 1e-9)) {          // rank mid is kept too: so is all above it
        above += m;
        lo = mid;
      } else if (above + m > limit * (1.0 + 1e-9)) {   // rank mid and below: more than top_p above
        for (size_t j = mid; j < hi; ++j) p[idx[j]] = 0.f;
        hi = mid;
      } else {
        break;                                         // too close to call apart from the sort
      }
    }
    std::sort(idx + lo, idx + hi, before);
    for (size_t j = lo; j < hi; ++j) {
      const int32_t t = idx[j];
      if (above > limit) p[t] = 0.f;
      else above += p[t];
    }
  }
  if (s.min_p > 0.f)          // the largest kept probability is exp(0) = 1
    for (int64_t j = 0; j < V; ++j)
      if (p[j] < s.min_p) p[j] = 0.f;
  // The draw: the first token whose running mass passes u z, found block by block (each block's
  // mass summed apart, z their sum), then token by token inside the block that passes.
  const int64_t nb = (V + kDrawBlock - 1) / kDrawBlock;
  sc.blocks.resize(nb);
  z = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    sc.blocks[b] = sum_double(p + b * kDrawBlock, std::min(kDrawBlock, V - b * kDrawBlock));
    z += sc.blocks[b];
  }
  const double target = uniform01(s.key, s.counter) * z;
  double acc = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    if (acc + sc.blocks[b] <= target) {
      acc += sc.blocks[b];
      continue;
    }
    for (int64_t j = b * kDrawBlock, e = std::min(V, j + kDrawBlock); j < e; ++j) {
      if (p[j] <= 0.f) continue;
      acc += p[j];
      if (acc > target) return j;
    }
  }
  for (int64_t j = V - 1; j >= 0; --j)     // u z rounded past the last token's running mass
    if (p[j] > 0.f) return j;
  return argmax_row(logits, V);
}

}  // namespace lf
