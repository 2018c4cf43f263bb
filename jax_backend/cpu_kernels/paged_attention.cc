// The cached-prefix part of `jax_backend.paged_attention` as one XLA:CPU custom call.
//
// XLA:CPU has no fused paged-attention kernel: its gathers copy each page chunk into the dots'
// layout first, so a decode step reads every K/V byte about three times (docs/performance.md
// section 27). This kernel reads each cached K and V row once, where it lies in the pool, and
// returns the same online-softmax state as `_attend_pages`: m, l [S, Hkv, G, Q] and
// acc [S, Hkv, G, Q, D] (float32), so the JAX code around it (the new tokens' block, the final
// division) is unchanged.
//
// Inputs: q [S, Q, Hkv, G, D] f32 (each sequence's dense query block), pool [N, page, 2*Hkv, D]
// f32 (K on even, V on odd heads), page_indices [S, W] s32, limit [S, Q] s32 (query j of sequence
// s sees cache positions < limit[s, j]), num_seqs [1] s32. Sequences at or past num_seqs, and
// rows that see nothing, get the empty state (m = mask_value, l = 0, acc = 0).
//
// Work is split over (sequence, kv head) pairs, shared with XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kKeyBlock = 128;  // keys scored at a time (bounded scratch, online softmax)

struct Problem {
  const float* q;
  const float* pool;
  const int32_t* pages;
  const int32_t* limit;
  float* m;
  float* l;
  float* acc;
  int64_t num_seqs, max_q, num_kv, group, dim, page_size, width;
  float scale, mask_value;
};

// exp(x) for a float array, in vector lanes (glibc's expf is scalar without -ffast-math):
// 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (relative error
// < 3e-7, about 2 ulp). x below -87 (masked scores, exp(mask_value - m)) gives exactly 0.
inline void exp_inplace(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.0f), k = std::nearbyint(v * 1.44269504f);
    const float r = (v - k * 0.693145752f) - k * 1.42860677e-6f;
    float poly = 1.0f / 720;
    poly = poly * r + 1.0f / 120;
    poly = poly * r + 1.0f / 24;
    poly = poly * r + 1.0f / 6;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    x[i] = x[i] < -87.0f ? 0.0f : poly * scale;
  }
}

// Scratch of one worker thread: the scores of a key block [rows, kKeyBlock] and its K/V rows.
struct Scratch {
  std::vector<float> scores;
  std::vector<const float*> kv;
};

// One (sequence, kv head): its G * Q query rows (r = g * Q + j, the output layout [.., G, Q])
// against the sequence's cached keys, a block of keys at a time with an online softmax.
void attend_one(const Problem& p, int64_t s, int64_t h, Scratch& w) {
  const int64_t rows = p.group * p.max_q, dim = p.dim, combined = 2 * p.num_kv;
  const int64_t first = (s * p.num_kv + h) * rows;
  float* m = p.m + first;
  float* l = p.l + first;
  float* acc = p.acc + first * dim;
  std::fill(m, m + rows, p.mask_value);
  std::fill(l, l + rows, 0.0f);
  std::fill(acc, acc + rows * dim, 0.0f);
  if (s >= p.num_seqs) return;
  const int32_t* limit = p.limit + s * p.max_q;
  int64_t longest = 0;
  for (int64_t j = 0; j < p.max_q; ++j) longest = std::max<int64_t>(longest, limit[j]);
  longest = std::min(longest, p.width * p.page_size);

  w.scores.resize(rows * kKeyBlock);
  w.kv.resize(kKeyBlock);
  for (int64_t start = 0; start < longest; start += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, longest - start);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = start + t;
      const int64_t page = p.pages[s * p.width + pos / p.page_size];
      w.kv[t] = p.pool + ((page * p.page_size + pos % p.page_size) * combined + 2 * h) * dim;  // V at +dim
    }
    for (int64_t g = 0; g < p.group; ++g)
      for (int64_t j = 0; j < p.max_q; ++j) {
        const int64_t r = g * p.max_q + j, visible = std::min<int64_t>(n, limit[j] - start);
        if (visible <= 0) continue;
        const float* q = p.q + (((s * p.max_q + j) * p.num_kv + h) * p.group + g) * dim;
        float* sr = w.scores.data() + r * kKeyBlock;
        float block_max = p.mask_value;
        for (int64_t t = 0; t < visible; ++t) {
          const float* k = w.kv[t];
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += q[d] * k[d];
          sr[t] = dot * p.scale;
          block_max = std::max(block_max, sr[t]);
        }
        const float m_new = std::max(m[r], block_max);
        float alpha = m[r] - m_new;
        exp_inplace(&alpha, 1);
        for (int64_t t = 0; t < visible; ++t) sr[t] -= m_new;
        exp_inplace(sr, visible);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < visible; ++t) sum += sr[t];
        m[r] = m_new;
        l[r] = alpha * l[r] + sum;
        float* a = acc + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] *= alpha;
        for (int64_t t = 0; t < visible; ++t) {
          const float weight = sr[t];
          const float* v = w.kv[t] + dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += weight * v[d];
        }
      }
  }
}

struct Shared {
  Problem problem;
  int64_t units;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
};

void work(Shared& shared) {
  Scratch scratch;
  const Problem& p = shared.problem;
  for (int64_t u; (u = shared.next.fetch_add(1)) < shared.units;) attend_one(p, u / p.num_kv, u % p.num_kv, scratch);
}

ffi::Error PagedPrefixAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv_pool,
                                ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> limit,
                                ffi::Buffer<ffi::S32> num_seqs, float sm_scale, float mask_value,
                                ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l,
                                ffi::ResultBuffer<ffi::F32> acc) {
  auto qd = q.dimensions();
  auto pd = kv_pool.dimensions();
  if (qd.size() != 5 || pd.size() != 4 || page_indices.dimensions().size() != 2 || pd[2] != 2 * qd[2] ||
      pd[3] != qd[4])
    return ffi::Error::InvalidArgument("paged_prefix_attention: incompatible shapes");
  auto shared = std::make_shared<Shared>();
  shared->problem = Problem{q.typed_data(), kv_pool.typed_data(), page_indices.typed_data(), limit.typed_data(),
                            m->typed_data(), l->typed_data(), acc->typed_data(),
                            std::min<int64_t>(num_seqs.typed_data()[0], qd[0]), qd[1], qd[2], qd[3], qd[4],
                            pd[1], page_indices.dimensions()[1], sm_scale, mask_value};
  shared->units = qd[0] * qd[2];
  // Helpers join through XLA's pool; the calling thread works too and then waits only for the
  // helpers that started (a helper that starts late finds no unit left and touches nothing).
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), shared->units) - 1;
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([shared] {
      shared->active.fetch_add(1);
      work(*shared);
      shared->active.fetch_sub(1);
    });
  work(*shared);
  while (shared->active.load() > 0) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgl_dflash_paged_prefix_attention, PagedPrefixAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("mask_value")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
