// y = x @ w.T for the few-row products of decode and verify steps, as one XLA:CPU custom call.
//
// XLA:CPU runs a 1-row product as its GEMV (~20 GB/s of weights here) and 2-64 rows through
// YNNPACK's kernels, which read weights from memory at 4-10 GB/s: every decode and verify step's
// dots were bound by them (docs/performance.md sections 23-24, 29). This kernel streams each weight
// row once from memory (prefetching the next tile while it computes this one) and keeps a tile of
// 3 rows x 8 outputs in vector registers, so the rows it reuses come from L1.
//
// Inputs: x [R, K] f32, w [L, N, K] f32 (out-major weights, a layer stack or one layer as L = 1),
// layer s32 [] (which of the L to use). Output y [R, N] f32.
//
// Every output is the same sum in the same order whatever R, its row or its tile: 16 lanes each
// accumulate k = lane, lane + 16, ... in order, then lanes fold pairwise (i + 8, + 4, + 2, + 1).
// So a verify block's rows and a decode step's single row get bit-identical products.
//
// Work is split over chunks of outputs, shared with XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // 16 lanes (AVX-512, or 2 x AVX2)
typedef int32_t i16 __attribute__((vector_size(64)));

constexpr int kRows = 3;     // rows of a register tile
constexpr int kOutputs = 8;  // outputs of a register tile (3 x 8 accumulators + 8 weight vectors)

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Two vectors' lanes folded one level: level 1 adds lane i and i + 8 of each, level 2 i and i + 4
// of each half's partial sums, and so on; after four levels 16 accumulators give 16 sums in order.
inline v16 fold(v16 a, v16 b, int level) {
  static const i16 lo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                            {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                            {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                            {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
  static const i16 hi[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                            {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
                            {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
                            {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
  return __builtin_shuffle(a, b, lo[level]) + __builtin_shuffle(a, b, hi[level]);
}

inline v16 sums16(const v16* acc) {
  v16 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i) t[i] = fold(acc[2 * i], acc[2 * i + 1], 0);
  for (int i = 0; i < 4; ++i) u[i] = fold(t[2 * i], t[2 * i + 1], 1);
  for (int i = 0; i < 2; ++i) v[i] = fold(u[2 * i], u[2 * i + 1], 2);
  return fold(v[0], v[1], 3);
}

// y[r, n] = x[r, :] . w[n, :] for RB rows and NB outputs; `next` (the next tile's weights, or
// null) is prefetched a cache line per weight row per step, so it arrives while this one computes.
template <int RB, int NB>
void tile(const float* x, const float* w, int64_t k_dim, float* y, int64_t ldy, const float* next) {
  constexpr int kAcc = (RB * NB + 15) / 16 * 16;
  v16 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = v16{};
  const int64_t k16 = k_dim & ~int64_t{15};
  for (int64_t k = 0; k < k16; k += 16) {
    v16 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = load(w + n * k_dim + k);
    if (next)
      for (int n = 0; n < NB; ++n) __builtin_prefetch(next + n * k_dim + k, 0, 3);
    for (int r = 0; r < RB; ++r) {
      const v16 xv = load(x + r * k_dim + k);
      for (int n = 0; n < NB; ++n) acc[r * NB + n] += xv * wv[n];
    }
  }
  if (k16 < k_dim) {  // the last K % 16 columns, zero-padded (zeros add nothing to any lane)
    float wt[NB][16] = {}, xt[RB][16] = {};
    for (int n = 0; n < NB; ++n) std::memcpy(wt[n], w + n * k_dim + k16, (k_dim - k16) * sizeof(float));
    for (int r = 0; r < RB; ++r) std::memcpy(xt[r], x + r * k_dim + k16, (k_dim - k16) * sizeof(float));
    for (int r = 0; r < RB; ++r)
      for (int n = 0; n < NB; ++n) acc[r * NB + n] += load(xt[r]) * load(wt[n]);
  }
  float s[kAcc];
  for (int i = 0; i < kAcc; i += 16) {
    const v16 sums = sums16(acc + i);
    std::memcpy(s + i, &sums, sizeof(sums));
  }
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) y[r * ldy + n] = s[r * NB + n];
}

// A tile of `rows` < RB rows (the rows left after the full tiles).
template <int RB, int NB>
void short_tile(int64_t rows, const float* x, const float* w, int64_t k_dim, float* y, int64_t ldy,
                const float* next) {
  if constexpr (RB > 0) {
    if (rows == RB) return tile<RB, NB>(x, w, k_dim, y, ldy, next);
    short_tile<RB - 1, NB>(rows, x, w, k_dim, y, ldy, next);
  }
}

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t rows, k_dim, n_dim;
};

// Outputs [n0, n1) of every row.
template <int NB>
void outputs(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += NB) {
    const float* w = p.w + n * p.k_dim;
    const float* next = n + NB < n1 ? w + NB * p.k_dim : nullptr;
    if constexpr (NB > 1) {
      if (n + NB > n1) return outputs<1>(p, n, n1);
    }
    int64_t r = 0;
    for (; r + kRows <= p.rows; r += kRows)
      tile<kRows, NB>(p.x + r * p.k_dim, w, p.k_dim, p.y + r * p.n_dim + n, p.n_dim, r == 0 ? next : nullptr);
    if (r < p.rows)
      short_tile<kRows - 1, NB>(p.rows - r, p.x + r * p.k_dim, w, p.k_dim, p.y + r * p.n_dim + n, p.n_dim,
                                r == 0 ? next : nullptr);
  }
}

struct Shared {
  Problem problem;
  int64_t chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
};

void work(Shared& shared) {
  const Problem& p = shared.problem;
  for (int64_t c; (c = shared.next.fetch_add(1)) < shared.chunks;)
    outputs<kOutputs>(p, c * shared.chunk, std::min(p.n_dim, (c + 1) * shared.chunk));
}

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != xd[1])
    return ffi::Error::InvalidArgument("rows_matmul: x must be [R, K] and w [L, N, K]");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= wd[0]) return ffi::Error::InvalidArgument("rows_matmul: layer index out of range");
  auto shared = std::make_shared<Shared>();
  shared->problem = Problem{x.typed_data(), w.typed_data() + index * wd[1] * wd[2], y->typed_data(), xd[0], xd[1],
                            wd[1]};
  // A few chunks per thread balance the threads; each chunk is a multiple of a tile's outputs.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunk = std::max<int64_t>(64, (wd[1] + 4 * threads - 1) / (4 * threads));
  shared->chunk = (chunk + kOutputs - 1) / kOutputs * kOutputs;
  shared->chunks = (wd[1] + shared->chunk - 1) / shared->chunk;
  // As in paged_attention.cc: helpers join through XLA's pool, the calling thread works too and
  // waits only for helpers that started (a late one finds no chunk left and touches nothing).
  const int64_t helpers = std::min(threads, shared->chunks) - 1;
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgl_dflash_rows_matmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
