// Decode attention straight from the paged KV cache, for CPUs.
//
// One query token per sequence attends to its whole context, reading keys and values slot
// by slot through the block table. This avoids materialising a gathered [B, L, KVH, D] copy
// of the cache per layer and the poor efficiency of SDPA on [B, H, 1, D] queries, which
// together dominate batched decoding on a CPU. CUDA uses SDPA / flash-attn instead.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// One task per (sequence, query head); online over the context: scores, softmax, weighted sum.
template <typename scalar_t>
static void decode_kernel(const float* q, const scalar_t* k, const scalar_t* v,
                          const int64_t* tables, const int64_t* ctx_lens, float* out,
                          int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t max_blocks,
                          int64_t block_size, float scale) {
  const int64_t group = H / KVH;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, g = h / group;
      const int64_t n = ctx_lens[b];
      const float* qv = q + (b * H + h) * D;
      const int64_t* table = tables + b * max_blocks;
      scores.resize(n);
      float mx = -INFINITY;
      for (int64_t p = 0; p < n; ++p) {
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
      for (int64_t p = 0; p < n; ++p) {
        scores[p] = std::exp(scores[p] - mx);
        denom += scores[p];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < n; ++p) {
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

// q: [B, H, D] float32; k_cache, v_cache: [S, KVH, D]; block_tables: [B, MB] int64;
// ctx_lens: [B] int64 (>= 1). Returns [B, H, D] float32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens,
                                     int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3, "q must be [B,H,D], caches [S,KVH,D]");
  auto qf = q.to(torch::kFloat32).contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = ctx_lens.to(torch::kInt64).contiguous();
  const int64_t B = qf.size(0), H = qf.size(1), D = qf.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D, "head layout mismatch");
  auto out = torch::empty({B, H, D}, qf.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(qf.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                            B, H, KVH, D, tables.size(1), block_size, static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
