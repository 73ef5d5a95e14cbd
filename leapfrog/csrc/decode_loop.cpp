// Several decode steps of a dense Llama-family model in one call, for CPUs.
//
// A decode step of a small model on a CPU costs a few hundred microseconds of arithmetic, and
// running it from Python (one call per layer, the sampler, the scheduler's bookkeeping) costs
// about as much again. While no request needs Python between tokens (no stop string to match
// mid-step is a reason to return, see leapfrog/engine/decode_loop.py), this loop runs up to `steps`
// whole steps: embedding, every layer, the final norm, the LM head, sampling, and each row's
// stop checks, inside one OpenMP parallel region whose threads meet at barriers between
// dependent phases instead of being woken for every product (the multi-step scheduling of
// vLLM and the graph-at-once execution of llama.cpp, on this engine's paged cache).
//
// Every value is computed by the row-level functions of cpu_math.h that the layer kernels use,
// split across threads by output columns (or by (row, KV head) for attention), so a row's
// logits and tokens are the bits the one-step path gives: the test suite decodes both ways
// and compares token for token.
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <vector>

#include "cpu_math.h"

using namespace lf;

namespace {

// Few-row products read the weight row by row up to this many rows (decode_layer's
// kSkinnyRows); more rows use the packed panels.
constexpr int64_t kSkinnyRows = 32;
constexpr int64_t kPanelRows = 256;

struct LayerWeights {
  torch::Tensor in_norm, qkv, qkv_b, q_norm, k_norm, o, o_b, post_norm, gu, gu_b, down, down_b;
  torch::Tensor p_qkv, p_o, p_gu, p_down;     // packed panels; undefined when absent
  torch::Tensor k_cache, v_cache;
  // Gemma (set_gemma): norms of the attention's and the MLP's outputs before each residual add
  // (undefined: none), a sliding window (0: none) and whether the layer rotates with the local table
  torch::Tensor attn_out_norm, mlp_out_norm;
  int64_t window = 0;
  bool local_rope = false;
};

inline const float* fptr(const torch::Tensor& t) { return t.defined() && t.numel() ? t.data_ptr<float>() : nullptr; }

inline void span(int64_t n, int tid, int nt, int64_t& a, int64_t& b) {
  a = n * tid / nt;
  b = n * (tid + 1) / nt;
}

// Column ranges for SwiGLU: cut on multiples of 8, so that silu_mul over a thread's range
// evaluates every element exactly as over the whole row (vector body, scalar tail).
inline void span8(int64_t n, int tid, int nt, int64_t& a, int64_t& b) {
  a = tid == 0 ? 0 : (n * tid / nt) / 8 * 8;
  b = tid == nt - 1 ? n : (n * (tid + 1) / nt) / 8 * 8;
}

// The barrier between the loop's phases: a counter and a phase number on their own cache lines.
// A decode step of a small model has ~30 phases of a few microseconds, so what a barrier costs
// matters: this one is an atomic increment and a spin on one line. A thread that waits long (its
// partner was descheduled on a busy machine) yields the CPU instead of spinning on.
struct SpinBarrier {
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<int> phase{0};
  int n = 1;
  void wait() {
    if (n <= 1) return;
    const int ph = phase.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      arrived.store(0, std::memory_order_relaxed);
      phase.store(ph + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase.load(std::memory_order_acquire) == ph; ++spins) {
#if defined(LEAPFROG_AVX2)
      if (spins < (1 << 10)) { _mm_pause(); continue; }
#endif
      std::this_thread::yield();
    }
  }
};

// A caller's interrupt flag (an int32 tensor of one element, or empty for none), written by
// another thread: non-zero asks an interruptible call to stop at its next layer boundary.
const int32_t* interrupt_flag(const torch::Tensor& flag) {
  if (!flag.defined() || flag.numel() == 0) return nullptr;
  TORCH_CHECK(flag.numel() == 1 && flag.scalar_type() == torch::kInt32 && flag.is_contiguous(),
              "DecodeLoop: the interrupt flag is an int32 tensor of one element");
  return flag.data_ptr<int32_t>();
}

bool interrupted(const int32_t* flag) { return flag && __atomic_load_n(flag, __ATOMIC_RELAXED) != 0; }

constexpr int kHeadParts = 16;

// An interrupt flag as every thread of a region sees it: at a barrier, thread 0 samples the flag
// before waiting and every thread reads that sample after, so all leave at the same barrier. The
// samples alternate between two slots (each thread counts its own checks in `parity`): a slot is
// written again only two checks later, after every thread has passed the barrier between and so
// has read it. A null flag makes check() a plain barrier.
struct Halt {
  const int32_t* flag = nullptr;
  bool seen[2] = {false, false};
  bool check(SpinBarrier& bar, int tid, int& parity) {
    if (flag && tid == 0) seen[parity] = interrupted(flag);
    bar.wait();
    const bool stop = flag && seen[parity];
    parity ^= 1;
    return stop;
  }
};

// Runs body(tid, nt, bar) on every thread of one OpenMP region of torch's thread count; the
// barrier is sized to the threads the region really got.
template <typename Body>
void in_region(Body body) {
  const int nt_req = std::max(1, at::get_num_threads());
  SpinBarrier bar;
#pragma omp parallel num_threads(nt_req)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    if (tid == 0) bar.n = nt;
#pragma omp barrier
    body(tid, nt, bar);
  }
}

}  // namespace

class DecodeLoop {
 public:
  DecodeLoop(std::vector<std::vector<torch::Tensor>> layers, std::vector<torch::Tensor> k_caches,
             std::vector<torch::Tensor> v_caches, torch::Tensor embed, torch::Tensor final_norm,
             torch::Tensor lm_head, torch::Tensor lm_head_bias, torch::Tensor lm_head_panels,
             torch::Tensor cos, torch::Tensor sin, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
             double scale, double eps, double qk_eps, double final_eps, int64_t lm_skinny_rows)
      : H_(H), KVH_(KVH), D_(D), block_size_(block_size), scale_(static_cast<float>(scale)),
        eps_(static_cast<float>(eps)), qk_eps_(static_cast<float>(qk_eps)),
        final_eps_(static_cast<float>(final_eps)), lm_skinny_rows_(lm_skinny_rows) {
    TORCH_CHECK(layers.size() == k_caches.size() && layers.size() == v_caches.size() && !layers.empty(),
                "DecodeLoop: one weight list and one K and V cache per layer");
    TORCH_CHECK(D % 8 == 0 && H % KVH == 0 && H / KVH <= 64, "DecodeLoop: head layout not supported");
    half_ = layers[0][1].scalar_type() == torch::kHalf;
    lm_half_ = lm_head.scalar_type() == torch::kHalf;
    TORCH_CHECK(lm_head.scalar_type() == torch::kHalf || lm_head.scalar_type() == torch::kFloat32,
                "DecodeLoop: the LM head must be float16 or float32");
    TORCH_CHECK(embed.scalar_type() == torch::kFloat32 && final_norm.scalar_type() == torch::kFloat32 &&
                cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
                "DecodeLoop: float32 embedding, norm and rotary tables");
    for (size_t l = 0; l < layers.size(); ++l) {
      auto& w = layers[l];
      TORCH_CHECK(w.size() == 12 || w.size() == 16 || w.size() == 20, "DecodeLoop: 12, 16 or 20 tensors per layer");
      LayerWeights L;
      L.in_norm = w[0]; L.qkv = w[1]; L.qkv_b = w[2]; L.q_norm = w[3]; L.k_norm = w[4]; L.o = w[5];
      L.o_b = w[6]; L.post_norm = w[7]; L.gu = w[8]; L.gu_b = w[9]; L.down = w[10]; L.down_b = w[11];
      if (w.size() == 20) {
        L.p_qkv = w[16].dim() == 3 ? w[16] : torch::Tensor();
        L.p_o = w[17].dim() == 3 ? w[17] : torch::Tensor();
        L.p_gu = w[18].dim() == 3 ? w[18] : torch::Tensor();
        L.p_down = w[19].dim() == 3 ? w[19] : torch::Tensor();
      }
      const torch::Tensor* packed[] = {&L.p_qkv, &L.p_o, &L.p_gu, &L.p_down};
      int j = 0;
      for (auto* t : {&L.qkv, &L.o, &L.gu, &L.down}) {
        // a projection read from quantized panels keeps only a placeholder of its weight's shape
        const auto* pk = packed[j++];
        const bool quantized = pk->defined() && (pk->scalar_type() == torch::kUInt8 || pk->scalar_type() == torch::kChar);
        TORCH_CHECK((t->is_contiguous() || quantized) && (t->scalar_type() == torch::kHalf) == half_ &&
                    (t->scalar_type() == torch::kHalf || t->scalar_type() == torch::kFloat32),
                    "DecodeLoop: every projection must be float16 or every one float32, contiguous");
      }
      L.k_cache = k_caches[l];
      L.v_cache = v_caches[l];
      TORCH_CHECK(L.k_cache.is_contiguous() && L.v_cache.is_contiguous() &&
                  L.k_cache.scalar_type() == k_caches[0].scalar_type() &&
                  (L.k_cache.scalar_type() == torch::kFloat32 || L.k_cache.scalar_type() == torch::kHalf),
                  "DecodeLoop: float32 or float16 contiguous KV caches");
      layers_.push_back(L);
    }
    kv_half_ = k_caches[0].scalar_type() == torch::kHalf;
    // a table held as quantized panels leaves a placeholder of its shape (set_embed_panels)
    embed_ = embed.stride(0) == 0 ? embed : embed.contiguous();
    final_norm_ = final_norm.contiguous();
    lm_head_ = lm_panels_quantized(lm_head_panels) ? lm_head : lm_head.contiguous();
    lm_head_b_ = lm_head_bias;
    lm_panels_ = lm_head_panels.dim() == 3 ? lm_head_panels : torch::Tensor();
    cos_ = cos.contiguous();
    sin_ = sin.contiguous();
    d_ = embed_.size(1);
    V_ = lm_head_.size(0);
    I_ = layers_[0].gu.size(0) / 2;
    rot_ = cos_.size(1);
    int64_t bytes = lm_head_.numel() * lm_head_.element_size();
    for (const auto& L : layers_)
      for (const auto* t : {&L.qkv, &L.o, &L.gu, &L.down}) bytes += t->numel() * t->element_size();
    pair_rows_ = bytes <= kPairRowsModelBytes;
  }

  // Whether a step of `rows` rows can run here bit for bit as the one-step path runs it.
  bool supports_rows(int64_t rows) const {
    if (rows < 1 || rows > kPanelRows) return false;
    if (rows > kSkinnyRows)
      for (const auto& L : layers_)
        if (!L.p_qkv.defined() || !L.p_o.defined() || !L.p_gu.defined() || !L.p_down.defined()) return false;
    return rows <= lm_skinny_rows_ || lm_panels_.defined();
  }

  // tokens [B]: each row's last token (not yet in the cache); positions [B]: its position;
  // tables [B, MB]: block tables covering positions + budgets; budgets [B] >= 1: most tokens
  // to produce; sampling per row (temps, top_k, top_p, min_p, keys, counters); stop_ids
  // [B, S] and ban_ids [B, S2] (-1 padded): tokens that end a row, and tokens banned while
  // fewer than min_left[b] tokens have been produced in this call. return_logits (steps == 1):
  // no sampling, the logits are returned. anchors [B] or empty: for a model trained with
  // coupled positions (set_anchor_token), the index of each row's first anchor token, -1 when
  // it has none yet; past it the rotary position counts from it, and a row that produces the
  // anchor in this call anchors there. Returns {tokens [B, steps], counts [B], logits,
  // captured}; with set_pick_probs(true) and no return_logits, the third is [B, steps]: the
  // probability (softmax at temperature 1, after bans) of each produced token. Structured
  // outputs: mask_fn (or None) is called before each step's sampling, with the GIL, as
  // mask_fn(tokens so far [B, steps], produced [B]); it writes the allowed tokens of the rows
  // whose mask_rows [B] is set into mask_bits [B, words] (int32, bit t % 32 of word t / 32),
  // and those rows then sample only among them. interrupt (an int32 flag or empty): when another
  // thread sets it (new work arrived), the call stops before its next step, or with mid_step at
  // its next layer boundary, and keeps the steps it finished (counts say how many; its first
  // step always runs, unless mid_step; logits calls ignore the flag).
  std::vector<torch::Tensor> run(torch::Tensor tokens, torch::Tensor positions, torch::Tensor tables,
                                 torch::Tensor budgets, int64_t steps, torch::Tensor temps,
                                 torch::Tensor top_k, torch::Tensor top_p, torch::Tensor min_p,
                                 torch::Tensor keys, torch::Tensor counters, torch::Tensor stop_ids,
                                 torch::Tensor ban_ids, torch::Tensor min_left, bool return_logits,
                                 std::vector<int64_t> capture_layers, torch::Tensor anchors,
                                 torch::Tensor mask_bits, torch::Tensor mask_rows,
                                 const pybind11::object& mask_fn, torch::Tensor interrupt, bool mid_step) {
    const int64_t B = tokens.size(0);
    TORCH_CHECK(anchors.numel() == 0 || (anchors.numel() == B && anchor_tok_ >= 0),
                "DecodeLoop.run: anchors need one index per row and an anchor token (set_anchor_token)");
    std::vector<int64_t> anchor(anchors.numel() ? B : 0);
    if (anchors.numel()) {
      auto a = anchors.to(torch::kInt64).contiguous();
      std::copy(a.data_ptr<int64_t>(), a.data_ptr<int64_t>() + B, anchor.begin());
    }
    TORCH_CHECK(steps >= 1 && (!return_logits || steps == 1), "DecodeLoop.run: steps >= 1 (1 with return_logits)");
    TORCH_CHECK(supports_rows(B), "DecodeLoop.run: this many rows need packed panels");
    auto tok = tokens.to(torch::kInt64).contiguous();
    auto pos = positions.to(torch::kInt64).contiguous();
    auto tab = tables.to(torch::kInt64).contiguous();
    auto bud = budgets.to(torch::kInt64).contiguous();
    auto stops = stop_ids.to(torch::kInt64).contiguous();
    auto bans = ban_ids.to(torch::kInt64).contiguous();
    auto minl = min_left.to(torch::kInt64).contiguous();
    TORCH_CHECK(tab.dim() == 2 && tab.size(0) == B && pos.size(0) == B && bud.size(0) == B &&
                stops.dim() == 2 && stops.size(0) == B && bans.dim() == 2 && bans.size(0) == B,
                "DecodeLoop.run: one row per sequence in every argument");
    std::vector<RowSampling> samp(B);
    {
      auto t = temps.to(torch::kFloat32).contiguous(), tp = top_p.to(torch::kFloat32).contiguous();
      auto mp = min_p.to(torch::kFloat32).contiguous();
      auto tk = top_k.to(torch::kInt64).contiguous(), ky = keys.to(torch::kInt64).contiguous();
      auto ct = counters.to(torch::kInt64).contiguous();
      for (int64_t b = 0; b < B; ++b) {
        samp[b].temperature = t.data_ptr<float>()[b];
        samp[b].top_k = std::min<int64_t>(std::max<int64_t>(tk.data_ptr<int64_t>()[b], 0), V_);
        samp[b].top_p = tp.data_ptr<float>()[b];
        samp[b].min_p = mp.data_ptr<float>()[b];
        samp[b].key = static_cast<uint64_t>(ky.data_ptr<int64_t>()[b]);
        samp[b].counter = static_cast<uint64_t>(ct.data_ptr<int64_t>()[b]);
      }
    }
    const int64_t MB = tab.size(1);
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = pos.data_ptr<int64_t>()[b], n = bud.data_ptr<int64_t>()[b];
      TORCH_CHECK(n >= 1 && p >= 0 && p + std::min(n, steps) <= MB * block_size_ && p + std::min(n, steps) <= cos_.size(0),
                  "DecodeLoop.run: a row's positions run past its block table or the rotary table");
      max_ctx = std::max(max_ctx, p + std::min(n, steps));
    }
    auto out = torch::full({B, steps}, -1, torch::kInt64);
    auto counts = torch::zeros({B}, torch::kInt64);
    auto logits_out = return_logits ? torch::empty({B, V_}, torch::kFloat32) : torch::Tensor();
    auto probs_out = pick_probs_ && !return_logits ? torch::zeros({B, steps}, torch::kFloat32) : torch::Tensor();
    for (const int64_t l : capture_layers)
      TORCH_CHECK(l >= 0 && l < static_cast<int64_t>(layers_.size()), "DecodeLoop.run: capture layer out of range");
    const int64_t C = static_cast<int64_t>(capture_layers.size());
    auto captured = C ? torch::zeros({B, steps, C, d_}, torch::kFloat32) : torch::empty({0});

    State st;
    st.B = B; st.steps = steps; st.MB = MB; st.max_ctx = max_ctx; st.return_logits = return_logits;
    st.tok = tok.data_ptr<int64_t>(); st.pos = pos.data_ptr<int64_t>(); st.tab = tab.data_ptr<int64_t>();
    st.bud = bud.data_ptr<int64_t>(); st.stops = stops.data_ptr<int64_t>(); st.nstop = stops.size(1);
    st.bans = bans.data_ptr<int64_t>(); st.nban = bans.size(1); st.minl = minl.data_ptr<int64_t>();
    st.samp = samp.data(); st.out = out.data_ptr<int64_t>(); st.counts = counts.data_ptr<int64_t>();
    st.logits_out = return_logits ? logits_out.data_ptr<float>() : nullptr;
    st.probs = probs_out.defined() ? probs_out.data_ptr<float>() : nullptr;
    st.capture.assign(layers_.size(), -1);
    for (int64_t c = 0; c < C; ++c) st.capture[capture_layers[c]] = c;
    st.C = C;
    st.anchor = anchor.empty() ? nullptr : anchor.data();
    st.captured = C ? captured.data_ptr<float>() : nullptr;
    torch::Tensor bits, rows;
    if (!mask_fn.is_none()) {
      TORCH_CHECK(!return_logits && mask_bits.dim() == 2 && mask_bits.size(0) == B &&
                  mask_bits.scalar_type() == torch::kInt32 && mask_bits.is_contiguous() &&
                  mask_rows.numel() == B && mask_rows.scalar_type() == torch::kUInt8,
                  "DecodeLoop.run: mask_bits [B, words] int32 and mask_rows [B] uint8 with a mask_fn");
      bits = mask_bits; rows = mask_rows.contiguous();
      st.mask_bits = bits.data_ptr<int32_t>(); st.mask_words = bits.size(1);
      st.mask_rows = rows.data_ptr<uint8_t>(); st.mask_fn = &mask_fn; st.out_t = out;
    }
    st.interrupt = return_logits ? nullptr : interrupt_flag(interrupt);
    st.mid_step = mid_step;
    if (half_) {
      if (kv_half_) loop<at::Half, at::Half>(st); else loop<at::Half, float>(st);
    } else {
      if (kv_half_) loop<float, at::Half>(st); else loop<float, float>(st);
    }
    if (st.mask_error) std::rethrow_exception(st.mask_error);
    return {out, counts, return_logits ? logits_out : probs_out.defined() ? probs_out : torch::empty({0}), captured};
  }

  // The token after whose first occurrence a model trained with coupled positions restarts
  // its rotary positions (-1: none).
  void set_anchor_token(int64_t id) { anchor_tok_ = id; }

  // Whether run() also returns the probability of each token it produces (a draft model's
  // confidence in its drafts).
  void set_pick_probs(bool on) { pick_probs_ = on; }

  // The embedding read from quantized panels (the table's own, or the tied LM head's) instead of
  // the float32 table, which is then a placeholder of its shape.
  void set_embed_panels(torch::Tensor panels) {
    TORCH_CHECK(lm_panels_quantized(panels) && panels.size(1) * kQBlock == d_ && panels.size(0) * kPanel >= embed_.size(0),
                "DecodeLoop: embedding panels must be quantized panels of the table's shape");
    embed_panels_ = panels.contiguous();
  }

  // Gemma 3's layer (models/gemma3.py): per layer, the norms applied to the attention's and the
  // MLP's outputs before their residual adds, the sliding window (0: a global layer) and whether
  // it rotates with the local table (local_cos/local_sin, the layers' own base); GeGLU (tanh
  // GELU) instead of SwiGLU; embeddings times embed_scale.
  void set_gemma(std::vector<torch::Tensor> attn_out_norms, std::vector<torch::Tensor> mlp_out_norms,
                 std::vector<int64_t> windows, std::vector<bool> local_rope, torch::Tensor local_cos,
                 torch::Tensor local_sin, double embed_scale) {
    const size_t n = layers_.size();
    TORCH_CHECK(attn_out_norms.size() == n && mlp_out_norms.size() == n && windows.size() == n && local_rope.size() == n,
                "DecodeLoop.set_gemma: one entry per layer in every list");
    TORCH_CHECK(local_cos.sizes() == cos_.sizes() && local_sin.sizes() == sin_.sizes() &&
                local_cos.scalar_type() == torch::kFloat32 && local_sin.scalar_type() == torch::kFloat32,
                "DecodeLoop.set_gemma: the local rotary tables must be float32 of the global ones' shape");
    for (size_t l = 0; l < n; ++l) {
      TORCH_CHECK(attn_out_norms[l].numel() == d_ && mlp_out_norms[l].numel() == d_ && windows[l] >= 0 &&
                  attn_out_norms[l].scalar_type() == torch::kFloat32 && mlp_out_norms[l].scalar_type() == torch::kFloat32,
                  "DecodeLoop.set_gemma: float32 norms of the hidden size and windows >= 0");
      layers_[l].attn_out_norm = attn_out_norms[l].contiguous();
      layers_[l].mlp_out_norm = mlp_out_norms[l].contiguous();
      layers_[l].window = windows[l];
      layers_[l].local_rope = local_rope[l];
    }
    lcos_ = local_cos.contiguous();
    lsin_ = local_sin.contiguous();
    embed_scale_ = static_cast<float>(embed_scale);
    gelu_ = true;
  }

  // Whether a forward of `rows` rows runs here with the arithmetic decode_layer gives them:
  // with every projection packed, up to kPanelRows rows; without, the few rows the row-major
  // kernel takes (decode_layer hands more to BLAS).
  bool forward_supports(int64_t rows) const {
    if (rows < 1 || rows > kPanelRows) return false;
    if (rows > kSkinnyRows)
      for (const auto& L : layers_)
        if (!L.p_qkv.defined() || !L.p_o.defined() || !L.p_gu.defined() || !L.p_down.defined()) return false;
    return true;
  }

  // One forward of T query rows through every layer in one parallel region, for the steps the
  // engine runs outside the loop: draft verification, diffusion canvases, mixed batches. The
  // layer-by-layer path (decode_layer per layer) gives the same bits in ~5 parallel regions a
  // layer, each waking the workers again. tokens [T]; positions [T] (rotary); slots [T] (the
  // cache slot each row's keys and values go to); tables [T, MB] (each row's block table);
  // ctx_lens [T] (how many positions each row attends to: its own prefix, or up to the end of
  // its block for block-causal rows). Every row's keys are written before any row attends.
  // Returns {final-normed hidden [T, d], the residual stream after each capture layer [T, C, d]};
  // with `interrupt` (as run's) set meanwhile, both with no rows: the forward was abandoned.
  std::vector<torch::Tensor> forward(torch::Tensor tokens, torch::Tensor positions, torch::Tensor slots,
                                     torch::Tensor tables, torch::Tensor ctx_lens,
                                     std::vector<int64_t> capture_layers, torch::Tensor interrupt) {
    const int64_t T = tokens.numel();
    const int32_t* flag = interrupt_flag(interrupt);
    TORCH_CHECK(forward_supports(T), "DecodeLoop.forward: this many rows need packed panels");
    auto tok = tokens.to(torch::kInt64).contiguous().view({T});
    auto pos = positions.to(torch::kInt64).contiguous().view({T});
    auto sl = slots.to(torch::kInt64).contiguous().view({T});
    auto tab = tables.to(torch::kInt64).contiguous();
    auto cl = ctx_lens.to(torch::kInt64).contiguous().view({T});
    TORCH_CHECK(tab.dim() == 2 && tab.size(0) == T, "DecodeLoop.forward: one block table row per query row");
    const int64_t MB = tab.size(1), slots_total = layers_[0].k_cache.size(0);
    const int64_t blocks = slots_total / block_size_, vocab = embed_.size(0);
    int64_t max_ctx = 1;
    for (int64_t r = 0; r < T; ++r) {
      const int64_t t = tok.data_ptr<int64_t>()[r], p = pos.data_ptr<int64_t>()[r];
      const int64_t n = cl.data_ptr<int64_t>()[r], slot = sl.data_ptr<int64_t>()[r];
      TORCH_CHECK(t >= 0 && t < vocab && p >= 0 && p < cos_.size(0) && slot >= 0 && slot < slots_total &&
                  n >= 1 && n <= MB * block_size_, "DecodeLoop.forward: a row's token, position, slot or context is out of range");
      for (int64_t j = 0; j < (n + block_size_ - 1) / block_size_; ++j) {
        const int64_t blk = tab.data_ptr<int64_t>()[r * MB + j];
        TORCH_CHECK(blk >= 0 && blk < blocks, "DecodeLoop.forward: a block table entry is out of range");
      }
      max_ctx = std::max(max_ctx, n);
    }
    for (const int64_t l : capture_layers)
      TORCH_CHECK(l >= 0 && l < static_cast<int64_t>(layers_.size()), "DecodeLoop.forward: capture layer out of range");
    const int64_t C = static_cast<int64_t>(capture_layers.size());
    std::vector<int64_t> capture(layers_.size(), -1);
    for (int64_t c = 0; c < C; ++c) capture[capture_layers[c]] = c;
    auto hidden = torch::empty({T, d_}, torch::kFloat32);
    auto captured = torch::empty({T, C, d_}, torch::kFloat32);
    bool done;
    if (half_) {
      if (kv_half_) done = forward_rows<at::Half, at::Half>(T, tok, pos, sl, tab, cl, max_ctx, capture, hidden, captured, flag);
      else done = forward_rows<at::Half, float>(T, tok, pos, sl, tab, cl, max_ctx, capture, hidden, captured, flag);
    } else {
      if (kv_half_) done = forward_rows<float, at::Half>(T, tok, pos, sl, tab, cl, max_ctx, capture, hidden, captured, flag);
      else done = forward_rows<float, float>(T, tok, pos, sl, tab, cl, max_ctx, capture, hidden, captured, flag);
    }
    if (!done) return {torch::empty({0, d_}, torch::kFloat32), torch::empty({0, C, d_}, torch::kFloat32)};
    return {hidden, captured};
  }

 private:
  struct State {
    int64_t B, steps, MB, max_ctx;
    bool return_logits;
    const int64_t *tok, *pos, *tab, *bud, *stops, *bans, *minl;
    int64_t nstop, nban;
    const RowSampling* samp;
    int64_t *out, *counts;
    float* logits_out;
    float* probs = nullptr;
    std::vector<int64_t> capture;      // per layer: its index among the captured layers, or -1
    int64_t C = 0;
    float* captured = nullptr;         // [B, steps, C, d]: the residual stream after those layers
    int64_t* anchor = nullptr;         // [B] or null: each row's first anchor token (coupled positions)
    int32_t* mask_bits = nullptr;      // structured outputs (run): allowed tokens per masked row
    int64_t mask_words = 0;
    const uint8_t* mask_rows = nullptr;
    const pybind11::object* mask_fn = nullptr;
    torch::Tensor out_t;
    std::exception_ptr mask_error;
    const int32_t* interrupt = nullptr;  // the caller's interrupt flag (run), or null
    bool mid_step = false;               // whether it also stops a step at a barrier inside it
  };

  static bool lm_panels_quantized(const torch::Tensor& p) {
    return p.defined() && p.dim() == 3 && (p.scalar_type() == torch::kUInt8 || p.scalar_type() == torch::kChar);
  }

  // Token tok's embedding row into out[0..d - 1] (times embed_scale_, Gemma's).
  void embed_row(int64_t tok, float* out) const {
    if (embed_panels_.defined()) {
      q_panel_row(reinterpret_cast<const uint8_t*>(embed_panels_.data_ptr()), embed_panels_.size(2),
                  embed_panels_.scalar_type() == torch::kChar, embed_panels_.size(1), tok, out);
    } else {
      const float* e = embed_.data_ptr<float>() + tok * d_;
      std::copy(e, e + d_, out);
    }
    if (embed_scale_ != 1.f)
      for (int64_t i = 0; i < d_; ++i) out[i] *= embed_scale_;
  }

  template <typename wt>
  static const wt* wp(const torch::Tensor& t) { return reinterpret_cast<const wt*>(t.data_ptr()); }

  // y[r, :] = x[r] W^T + bias for T rows, this thread's share of the output columns: from
  // the weight's packed panels when it has them (as decode_layer), else row by row from the
  // weight (T <= skinny rows). Panels p0..p1-1 (columns 16 p0 .. 16 p1 - 1) or columns n0..n1-1.
  template <typename wt>
  void product_range(const float* x, int64_t T, int64_t K, const torch::Tensor& w, const torch::Tensor& panels,
                     const float* b, float* y, int64_t N, int64_t a, int64_t c) const {
    if (panels.defined()) {
      if (panels.scalar_type() == torch::kUInt8) {
        q_panel_rows(x, T, K, panels.data_ptr<uint8_t>(), panels.size(2), a, c, b, y, N, N);
      } else if (panels.scalar_type() == torch::kChar) {
        thread_local QRows xq;       // each thread quantizes the step's rows itself: no barrier
        q8_rows(x, K, T, K, xq);
        q_panel_rows_int8(xq, 0, T, K, reinterpret_cast<const uint8_t*>(panels.data_ptr()), panels.size(2), a, c, b,
                          y, N, N);
      } else if (panels.scalar_type() == torch::kBFloat16) {
        // each thread rounds the rows itself (a few microseconds): no barrier to share them
        thread_local std::vector<uint32_t> pairs;
        const int64_t K2 = (K + 1) / 2;
        if (static_cast<int64_t>(pairs.size()) < T * K2) pairs.resize(T * K2);
        bf16_pairs(x, K, T, K, pairs.data());
        panel_rows_bf16(pairs.data(), T, K2, reinterpret_cast<const uint16_t*>(panels.data_ptr()), a, c, b, y, N, N);
      } else if (panels.scalar_type() == torch::kHalf) {
        panel_rows(x, T, K, panels.data_ptr<at::Half>(), a, c, b, y, N, N);
      } else {
        panel_rows(x, T, K, panels.data_ptr<float>(), a, c, b, y, N, N);
      }
      return;
    }
    dot_rows(x, T, wp<wt>(w), b, y, N, a, c, K, pair_rows_);
  }

  // This thread's share of a product's N columns: [n0, n1), on panel boundaries with panels.
  static void columns(int64_t N, bool panels, int tid, int nt, int64_t& n0, int64_t& n1) {
    if (!panels) return span(N, tid, nt, n0, n1);
    span((N + kPanel - 1) / kPanel, tid, nt, n0, n1);
    n0 *= kPanel;
    n1 = std::min(N, n1 * kPanel);
  }

  template <typename wt>
  void product(const float* x, int64_t T, int64_t K, const torch::Tensor& w, const torch::Tensor& panels,
               const torch::Tensor& bias, float* y, int64_t N, int tid, int nt) const {
    int64_t n0, n1;
    if (panels.defined()) {
      span((N + kPanel - 1) / kPanel, tid, nt, n0, n1);
    } else {
      span(N, tid, nt, n0, n1);
    }
    product_range<wt>(x, T, K, w, panels, fptr(bias), y, N, n0, n1);
  }

  // x[r, :] += (a[r] W^T + bias) for this thread's share of the d output columns (the residual
  // after the output and down projections): tmp holds the product, the sum is x + y as torch's.
  // With out_norm (Gemma), the product's rows are normed before the sum: every column of them
  // first (a barrier), then this thread's rows.
  template <typename wt>
  bool add_product(float* x, const float* a, int64_t T, int64_t K, const torch::Tensor& w, const torch::Tensor& panels,
                   const torch::Tensor& bias, float* tmp, int64_t d, int tid, int nt,
                   const torch::Tensor& out_norm, SpinBarrier& bar, Halt& halt, int& parity) const {
    product<wt>(a, T, K, w, panels, bias, tmp, d, tid, nt);
    if (out_norm.defined()) {
      if (halt.check(bar, tid, parity)) return false;
      for (int64_t r = tid; r < T; r += nt) {
        rms_row(tmp + r * d, out_norm.data_ptr<float>(), tmp + r * d, d, eps_);
        for (int64_t n = 0; n < d; ++n) x[r * d + n] = x[r * d + n] + tmp[r * d + n];
      }
      return true;
    }
    int64_t n0, n1;
    columns(d, panels.defined(), tid, nt, n0, n1);
    for (int64_t r = 0; r < T; ++r)
      for (int64_t n = n0; n < n1; ++n) x[r * d + n] = x[r * d + n] + tmp[r * d + n];
    return true;
  }

  // The step's shared buffers (rows are the step's rows, in order).
  struct Bufs {
    float *x, *qkv, *attn, *gu, *act, *tmp;
    float* parts = nullptr;    // attention partials of every (row, KV head, chunk) when a step may split
  };

  // Whether a step of T rows spreads its rows' attention chunks over the threads: whenever a
  // context spans several chunks and the partials fit the buffer. Whole (row, KV head) tasks
  // leave a thread idle where their count does not divide (one request of a model with 3 KV
  // heads on 2 threads), and each walks its head's rows strided through the slots.
  bool split_attention(int64_t T, int64_t max_ctx, int nt) const {
    return nt > 1 && max_ctx > kAttnChunk && T * KVH_ * attn_chunks(max_ctx) * attn_part_floats(H_ / KVH_, D_) <= kMaxPartsFloats;
  }
  static constexpr int64_t kMaxPartsFloats = int64_t{1} << 20;
  // Floats of Bufs::parts for up to T rows of at most max_ctx positions (0: never split).
  int64_t parts_floats(int64_t T, int64_t max_ctx) const {
    const int64_t n = T * KVH_ * attn_chunks(std::max<int64_t>(max_ctx, 1)) * attn_part_floats(H_ / KVH_, D_);
    return n <= kMaxPartsFloats ? n : 0;
  }

  // Every layer over a step's T rows, this thread's share, between barriers; x (bufs.x) holds
  // the rows' residual stream in and out. Row r is at position rpos[r], writes its keys and
  // values to cache slot slot[r] and attends to the first ctx[r] positions of its sequence
  // through the block table rtab[r]. sync_kv: rows of one sequence may read each other's keys
  // (a verify block, a diffusion canvas), so every row's keys are written, behind a barrier,
  // before any row attends. after(li, r): the rows' stream after layer li (thread's rows).
  // halt: checked at every barrier (Halt); when it fires, every thread returns false there (the
  // rows' keys and values of this pass are partly written: the caller keeps nothing of it).
  template <typename wt, typename kv_t, typename After>
  bool layer_pass(const Bufs& bufs, int64_t T, const int64_t* slot, const int64_t* ctx,
                  const int64_t* rpos, const int64_t* const* rtab, bool sync_kv, float* h, float* scratch,
                  int tid, int nt, SpinBarrier& bar, Halt& halt, int& parity, After after) const {
    const int64_t d = d_, H = H_, KVH = KVH_, D = D_, I = I_, group = H / KVH;
    const int64_t width = (H + 2 * KVH) * D, half = rot_ / 2;
    float* x = bufs.x;
    float* qkv = bufs.qkv;
    float* attn = bufs.attn;
    float* gu = bufs.gu;
    float* act = bufs.act;
    for (size_t li = 0; li < layers_.size(); ++li) {
      const auto& L = layers_[li];
      const float* cosp = (L.local_rope ? lcos_ : cos_).data_ptr<float>();
      const float* sinp = (L.local_rope ? lsin_ : sin_).data_ptr<float>();
      // keys start(r)..ctx[r]-1 of row r's sequence: a sliding window's, or all of them
      const int64_t win = L.window;
      auto start = [&](int64_t r) { return window_start(ctx[r], win); };
      // 1. input norm (every thread, all rows) and this thread's q/k/v columns.
      for (int64_t r = 0; r < T; ++r) rms_row(x + r * d, L.in_norm.data_ptr<float>(), h + r * d, d, eps_);
      product<wt>(h, T, d, L.qkv, L.p_qkv, L.qkv_b, qkv, width, tid, nt);
      if (halt.check(bar, tid, parity)) return false;
      // 2. per (row, KV head): q/k norm and RoPE, the KV write, attention over the cache.
      {
        int64_t step_ctx = 0;
        for (int64_t r = 0; r < T; ++r) step_ctx = std::max(step_ctx, ctx[r] - start(r));
        const bool split = bufs.parts && split_attention(T, step_ctx, nt);
        int64_t t0, t1;
        span(T * KVH, tid, nt, t0, t1);
        kv_t* kc = reinterpret_cast<kv_t*>(L.k_cache.data_ptr());
        kv_t* vc = reinterpret_cast<kv_t*>(L.v_cache.data_ptr());
        const float* qn = L.q_norm.numel() == D ? L.q_norm.data_ptr<float>() : nullptr;
        const float* kn = L.k_norm.numel() == D ? L.k_norm.data_ptr<float>() : nullptr;
        for (int64_t task = t0; task < t1; ++task) {
          const int64_t r = task / KVH, g = task % KVH;
          float* row = qkv + r * width;
          const float* c = cosp + rpos[r] * rot_;
          const float* si = sinp + rpos[r] * rot_;
          for (int64_t j = 0; j < group; ++j) {
            float* qh = row + (g * group + j) * D;
            if (qn) rms_row(qh, qn, qh, D, qk_eps_);
            rope_head(qh, c, si, half);
          }
          float* kh = row + (H + g) * D;
          if (kn) rms_row(kh, kn, kh, D, qk_eps_);
          rope_head(kh, c, si, half);
          const float* vh = row + (H + KVH + g) * D;
          kv_t* kd = kc + (slot[r] * KVH + g) * D;
          kv_t* vd = vc + (slot[r] * KVH + g) * D;
          for (int64_t i = 0; i < D; ++i) {
            kd[i] = static_cast<kv_t>(kh[i]);
            vd[i] = static_cast<kv_t>(vh[i]);
          }
          if (!sync_kv && !split)
            attend_group(row, kc, vc, rtab[r], ctx[r] - start(r), block_size_, KVH, D, g, group, scale_,
                         attn + r * H * D, scratch, start(r));
        }
        if (split) {
          // every (row, KV head, chunk) as a task, behind the keys' writes; then each (row, KV
          // head) merges its chunks: the bits of attend_group, whichever thread ran a chunk.
          if (halt.check(bar, tid, parity)) return false;
          const int64_t pf = attn_part_floats(group, D);
          std::vector<int64_t> rbase(T + 1, 0);     // row r's partials start at rbase[r] (in partials)
          int64_t max_chunks = 0;
          for (int64_t r = 0; r < T; ++r) {
            rbase[r + 1] = rbase[r] + KVH * attn_chunks(ctx[r] - start(r));
            max_chunks = std::max(max_chunks, attn_chunks(ctx[r] - start(r)));
          }
          int64_t c0, c1;
          span(rbase[T], tid, nt, c0, c1);
          // tasks in (chunk, row, KV head) order: rows of one sequence (a verify block) read a
          // chunk's keys and values one after another, from cache after the first; a thread
          // takes a chunk's heads in turn, the first prefetching the whole slots for the others
          int64_t k = 0;
          for (int64_t c = 0; c < max_chunks && k < c1; ++c)
            for (int64_t r = 0; r < T && k < c1; ++r) {
              const int64_t s0 = start(r), chunks = attn_chunks(ctx[r] - s0);
              if (c >= chunks) continue;
              for (int64_t g = 0; g < KVH; ++g, ++k)
                if (k >= c0 && k < c1)
                  attend_chunk(qkv + r * width, kc, vc, rtab[r], ctx[r] - s0, c, block_size_, KVH, D, g, group,
                               scale_, scratch, bufs.parts + (rbase[r] + g * chunks + c) * pf, g == 0 || k == c0, s0);
            }
          if (halt.check(bar, tid, parity)) return false;
          for (int64_t rr = 0, task = 0; rr < T; ++rr) {
            const int64_t chunks = attn_chunks(ctx[rr] - start(rr));
            for (int64_t g = 0; g < KVH; ++g, ++task)
              if (task >= t0 && task < t1)
                attend_combine(bufs.parts + (rbase[rr] + g * chunks) * pf, chunks, D, g, group, attn + rr * H * D);
          }
        } else if (sync_kv) {
          if (halt.check(bar, tid, parity)) return false;
          // (row, KV head) tasks dealt round-robin, not in spans: a prompt's rows attend to ever
          // longer prefixes, so a span of the later rows would be most of the work.
          for (int64_t task = tid; task < T * KVH; task += nt) {
            const int64_t r = task / KVH, g = task % KVH;
            attend_group(qkv + r * width, kc, vc, rtab[r], ctx[r] - start(r), block_size_, KVH, D, g, group,
                         scale_, attn + r * H * D, scratch, start(r));
          }
        }
      }
      if (halt.check(bar, tid, parity)) return false;
      // 3. output projection and residual, this thread's columns.
      if (!add_product<wt>(x, attn, T, H * D, L.o, L.p_o, L.o_b, bufs.tmp, d, tid, nt, L.attn_out_norm, bar, halt,
                           parity))
        return false;
      if (halt.check(bar, tid, parity)) return false;
      // 4. post norm (every thread), gate/up and SwiGLU.
      for (int64_t r = 0; r < T; ++r) rms_row(x + r * d, L.post_norm.data_ptr<float>(), h + r * d, d, eps_);
      {
        // Gate and up columns of the same units on one thread, so SwiGLU needs no barrier:
        // matching panel ranges of both halves (when I is a whole number of panels) or
        // matching column ranges cut on multiples of 8 (row by row); otherwise all of
        // gate/up first, then SwiGLU.
        const float* bias = fptr(L.gu_b);
        int64_t a0, a1;
        if (L.p_gu.defined() && I % kPanel == 0) {
          span(I / kPanel, tid, nt, a0, a1);
          product_range<wt>(h, T, d, L.gu, L.p_gu, bias, gu, 2 * I, a0, a1);
          product_range<wt>(h, T, d, L.gu, L.p_gu, bias, gu, 2 * I, I / kPanel + a0, I / kPanel + a1);
          a0 *= kPanel;
          a1 *= kPanel;
        } else if (L.p_gu.defined()) {
          product<wt>(h, T, d, L.gu, L.p_gu, L.gu_b, gu, 2 * I, tid, nt);
          if (halt.check(bar, tid, parity)) return false;
          span8(I, tid, nt, a0, a1);
        } else {
          span8(I, tid, nt, a0, a1);
          product_range<wt>(h, T, d, L.gu, L.p_gu, bias, gu, 2 * I, a0, a1);
          product_range<wt>(h, T, d, L.gu, L.p_gu, bias, gu, 2 * I, I + a0, I + a1);
        }
        for (int64_t r = 0; r < T; ++r)
          if (a1 > a0) (gelu_ ? gelu_tanh_mul : silu_mul)(gu + r * 2 * I + a0, gu + r * 2 * I + I + a0, act + r * I + a0, a1 - a0);
      }
      if (halt.check(bar, tid, parity)) return false;
      // 5. down projection and residual.
      if (!add_product<wt>(x, act, T, I, L.down, L.p_down, L.down_b, bufs.tmp, d, tid, nt, L.mlp_out_norm, bar, halt,
                           parity))
        return false;
      if (halt.check(bar, tid, parity)) return false;
      for (int64_t r = tid; r < T; r += nt) after(li, r);
    }
    return true;
  }

  template <typename wt, typename kv_t>
  bool forward_rows(int64_t T, const torch::Tensor& tok, const torch::Tensor& pos, const torch::Tensor& sl,
                    const torch::Tensor& tab, const torch::Tensor& cl, int64_t max_ctx,
                    const std::vector<int64_t>& capture, torch::Tensor& hidden, torch::Tensor& captured,
                    const int32_t* interrupt) {
    const int64_t d = d_, H = H_, KVH = KVH_, D = D_, I = I_, group = H / KVH, width = (H + 2 * KVH) * D;
    const int64_t C = captured.size(1), MB = tab.size(1);
    std::vector<float> x(T * d), qkv(T * width), attn(T * H * D), gu(T * 2 * I), act(T * I), tmp(T * std::max(d, I));
    std::vector<float> parts(parts_floats(T, max_ctx));
    const Bufs bufs{x.data(), qkv.data(), attn.data(), gu.data(), act.data(), tmp.data(), parts.empty() ? nullptr : parts.data()};
    std::vector<const int64_t*> rtab(T);
    const int64_t* tp = tab.data_ptr<int64_t>();
    for (int64_t r = 0; r < T; ++r) rtab[r] = tp + r * MB;
    const int64_t* tk = tok.data_ptr<int64_t>();
    for (int64_t r = 0; r < T; ++r) embed_row(tk[r], x.data() + r * d);
    float* hid = hidden.data_ptr<float>();
    float* cap = captured.data_ptr<float>();
    Halt halt{interrupt};
    bool stopped = false;
    in_region([&](int tid, int nt, SpinBarrier& bar) {
      std::vector<float> h(T * std::max(d, I)), scratch(attn_scratch_floats(max_ctx, group, D));
      int parity = 0;
      if (!layer_pass<wt, kv_t>(bufs, T, sl.data_ptr<int64_t>(), cl.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
                                rtab.data(), T > 1, h.data(), scratch.data(), tid, nt, bar, halt, parity,
                                [&](size_t li, int64_t r) {
        if (capture[li] >= 0) std::copy(x.data() + r * d, x.data() + (r + 1) * d, cap + (r * C + capture[li]) * d);
      })) {
        if (tid == 0) stopped = true;
        return;
      }
      for (int64_t r = tid; r < T; r += nt) rms_row(x.data() + r * d, final_norm_.data_ptr<float>(), hid + r * d, d, final_eps_);
    });
    return !stopped;
  }

  template <typename wt, typename kv_t>
  void loop(State& st) {
    const int64_t B = st.B, d = d_, H = H_, KVH = KVH_, D = D_, I = I_, V = V_, group = H / KVH;
    const int64_t width = (H + 2 * KVH) * D;
    // Shared buffers (rows are the active rows of the current step, in order).
    std::vector<float> x(B * d), qkv(B * width), attn(B * H * D), gu(B * 2 * I), act(B * I),
        tmp(B * std::max(d, I)), logits(B * V), parts(parts_floats(B, st.max_ctx));
    std::vector<int64_t> active(B), slot(B), ctx(B), rpos(B), produced(B, 0), next(B);
    std::vector<const int64_t*> rtab(B);
    std::vector<char> done(B, 0);
    const Bufs bufs{x.data(), qkv.data(), attn.data(), gu.data(), act.data(), tmp.data(), parts.empty() ? nullptr : parts.data()};
    int64_t T = 0;
    for (int64_t b = 0; b < B; ++b) next[b] = st.tok[b];
    // Before each step but the first (before the first too, and at every barrier inside a step,
    // with mid_step): a request that arrived ends the call there.
    Halt step_halt{st.interrupt}, layer_halt{st.mid_step ? st.interrupt : nullptr}, no_halt;
    in_region([&](int tid, int nt, SpinBarrier& bar) {
      std::vector<float> h(B * std::max(d, I)), attn_scratch(attn_scratch_floats(st.max_ctx, group, D));
      SampleScratch scratch;
      int step_parity = 0, layer_parity = 0;
      for (int64_t s = 0; s < st.steps; ++s) {
        // Bookkeeping and embeddings of this step's rows (one thread), then everyone reads T.
        if (tid == 0) {
          T = 0;
          for (int64_t b = 0; b < B; ++b) {
            if (done[b]) continue;
            const int64_t p = st.pos[b] + produced[b];
            active[T] = b;
            slot[T] = st.tab[b * st.MB + p / block_size_] * block_size_ + p % block_size_;
            ctx[T] = p + 1;
            rpos[T] = p;
            if (st.anchor) {                 // coupled positions: count from the row's first anchor
              int64_t& a = st.anchor[b];
              if (a < 0 && next[b] == anchor_tok_) a = p;
              if (a >= 0 && a < p) rpos[T] = p - a;
            }
            rtab[T] = st.tab + b * st.MB;
            embed_row(next[b], x.data() + T * d);
            ++T;
          }
        }
        const bool stop = (s > 0 || st.mid_step ? step_halt : no_halt).check(bar, tid, step_parity);
        if (T == 0 || stop) break;
        if (!layer_pass<wt, kv_t>(bufs, T, slot.data(), ctx.data(), rpos.data(), rtab.data(), false, h.data(),
                                  attn_scratch.data(), tid, nt, bar, layer_halt, layer_parity,
                                  [&](size_t li, int64_t r) {
          if (st.capture[li] >= 0)           // a method's tapped layer: its rows for the drafter
            std::copy(bufs.x + r * d, bufs.x + (r + 1) * d,
                      st.captured + ((active[r] * st.steps + produced[active[r]]) * st.C + st.capture[li]) * d);
        }))
          break;                             // interrupted: the steps done so far stand
        // Final norm and the LM head.
        for (int64_t r = 0; r < T; ++r) rms_row(x.data() + r * d, final_norm_.data_ptr<float>(), h.data() + r * d, d, final_eps_);
        // The head in kHeadParts pieces with a check after each when the call stops mid-step (the
        // head of a big batch takes as long as a few layers), else whole.
        {
          int64_t n0, n1;
          span(lm_panels_.defined() ? (V + kPanel - 1) / kPanel : V, tid, nt, n0, n1);
          const int parts = layer_halt.flag ? kHeadParts : 1;
          bool stop = false;
          for (int j = 0; j < parts && !stop; ++j) {
            const int64_t a = n0 + (n1 - n0) * j / parts, c = n0 + (n1 - n0) * (j + 1) / parts;
            if (lm_half_) product_range<at::Half>(h.data(), T, d, lm_head_, lm_panels_, fptr(lm_head_b_), logits.data(), V, a, c);
            else product_range<float>(h.data(), T, d, lm_head_, lm_panels_, fptr(lm_head_b_), logits.data(), V, a, c);
            stop = layer_halt.check(bar, tid, layer_parity);                    // the last: before sampling
          }
          if (stop) break;
        }
        if (st.return_logits) {
          for (int64_t r = tid; r < T; r += nt)
            std::copy(logits.data() + r * V, logits.data() + (r + 1) * V, st.logits_out + active[r] * V);
          break;
        }
        if (st.mask_fn) {                    // the grammar masks of this step, from Python
          if (tid == 0) {
            try {
              pybind11::gil_scoped_acquire gil;
              (*st.mask_fn)(st.out_t, torch::from_blob(produced.data(), {B}, torch::kInt64));
            } catch (...) {
              st.mask_error = std::current_exception();
            }
          }
          bar.wait();
          if (st.mask_error) break;
        }
        // Sampling and stop checks, rows spread over the threads.
        for (int64_t r = tid; r < T; r += nt) {
          const int64_t b = active[r];
          float* lr = logits.data() + r * V;
          if (produced[b] < st.minl[b])
            for (int64_t j = 0; j < st.nban; ++j) {
              const int64_t t = st.bans[b * st.nban + j];
              if (t >= 0 && t < V) lr[t] = -std::numeric_limits<float>::infinity();
            }
          if (st.mask_rows && st.mask_rows[b]) {
            const int32_t* mb = st.mask_bits + b * st.mask_words;
            const int64_t covered = std::min(V, st.mask_words * 32);
            for (int64_t t = 0; t < covered; ++t)
              if (!((static_cast<uint32_t>(mb[t >> 5]) >> (t & 31)) & 1u)) lr[t] = -std::numeric_limits<float>::infinity();
            for (int64_t t = covered; t < V; ++t) lr[t] = -std::numeric_limits<float>::infinity();
          }
          RowSampling rs = st.samp[b];
          rs.counter += static_cast<uint64_t>(produced[b]);
          const int64_t t = sample_row(lr, V, rs, scratch);
          if (st.probs) st.probs[b * st.steps + produced[b]] = row_prob(lr, V, t);
          st.out[b * st.steps + produced[b]] = t;
          ++produced[b];
          bool stop = produced[b] >= std::min(st.bud[b], st.steps);
          for (int64_t j = 0; j < st.nstop && !stop; ++j) stop = st.stops[b * st.nstop + j] == t;
          done[b] = stop;
          next[b] = t;
        }
        bar.wait();
      }
    });
    for (int64_t b = 0; b < B; ++b) st.counts[b] = produced[b];
  }

  std::vector<LayerWeights> layers_;
  int64_t anchor_tok_ = -1;
  bool pick_probs_ = false;
  torch::Tensor embed_, embed_panels_, final_norm_, lm_head_, lm_head_b_, lm_panels_, cos_, sin_;
  torch::Tensor lcos_, lsin_;            // Gemma's local layers' rotary tables (set_gemma)
  float embed_scale_ = 1.f;
  bool gelu_ = false;                    // GeGLU with tanh GELU instead of SwiGLU (set_gemma)
  int64_t H_, KVH_, D_, block_size_;
  float scale_, eps_, qk_eps_, final_eps_;
  int64_t lm_skinny_rows_;
  int64_t d_ = 0, V_ = 0, I_ = 0, rot_ = 0;
  bool half_ = false, lm_half_ = false, kv_half_ = false;
  bool pair_rows_ = false;     // the model's weights fit in L3: two weight rows at a time (cpu_math.h)
};

// The sampler of the decode loop for a step's logits computed elsewhere ([N, V] float32, one
// row per draw): the one-step path samples with it, so both paths draw the same tokens.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temps, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor min_p, torch::Tensor keys, torch::Tensor counters) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32, "sample_rows: logits must be [N, V] float32");
  auto lg = logits.contiguous();
  const int64_t N = lg.size(0), V = lg.size(1);
  auto t = temps.to(torch::kFloat32).contiguous(), tp = top_p.to(torch::kFloat32).contiguous();
  auto mp = min_p.to(torch::kFloat32).contiguous();
  auto tk = top_k.to(torch::kInt64).contiguous(), ky = keys.to(torch::kInt64).contiguous();
  auto ct = counters.to(torch::kInt64).contiguous();
  TORCH_CHECK(t.numel() == N && tp.numel() == N && mp.numel() == N && tk.numel() == N && ky.numel() == N &&
              ct.numel() == N, "sample_rows: one sampling setting per row");
  auto out = torch::empty({N}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  const float* lp = lg.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, V)), [&](int64_t n0, int64_t n1) {
    SampleScratch scratch;
    for (int64_t n = n0; n < n1; ++n) {
      RowSampling rs;
      rs.temperature = t.data_ptr<float>()[n];
      rs.top_k = std::min<int64_t>(std::max<int64_t>(tk.data_ptr<int64_t>()[n], 0), V);
      rs.top_p = tp.data_ptr<float>()[n];
      rs.min_p = mp.data_ptr<float>()[n];
      rs.key = static_cast<uint64_t>(ky.data_ptr<int64_t>()[n]);
      rs.counter = static_cast<uint64_t>(ct.data_ptr<int64_t>()[n]);
      o[n] = sample_row(lp + n * V, V, rs, scratch);
    }
  });
  return out;
}

void register_decode_loop(pybind11::module& m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  pybind11::class_<DecodeLoop>(m, "DecodeLoop")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                          int64_t, int64_t, double, double, double, double, int64_t>())
      .def("supports_rows", &DecodeLoop::supports_rows)
      .def("set_anchor_token", &DecodeLoop::set_anchor_token)
      .def("set_pick_probs", &DecodeLoop::set_pick_probs)
      .def("set_embed_panels", &DecodeLoop::set_embed_panels)
      .def("set_gemma", &DecodeLoop::set_gemma)
      .def("forward_supports", &DecodeLoop::forward_supports)
      .def("forward", &DecodeLoop::forward, "one forward of query rows through every layer (CPU, float32)", nogil)
      .def("run", &DecodeLoop::run, "up to `steps` decode steps of a batch (CPU, float32)", nogil);
  m.def("sample_rows", &sample_rows, "one token per row: greedy or temperature/top-k/top-p/min-p (CPU)", nogil);
}
