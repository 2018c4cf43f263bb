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
// Work is split over chunks of outputs (`parallel_units`).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 3;     // rows of a register tile
constexpr int kOutputs = 8;  // outputs of a register tile (3 x 8 accumulators + 8 weight vectors)

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

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != xd[1])
    return ffi::Error::InvalidArgument("rows_matmul: x must be [R, K] and w [L, N, K]");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= wd[0]) return ffi::Error::InvalidArgument("rows_matmul: layer index out of range");
  const Problem problem{x.typed_data(), w.typed_data() + index * wd[1] * wd[2], y->typed_data(), xd[0], xd[1], wd[1]};
  // A few chunks per thread balance the threads; each chunk is a multiple of a tile's outputs.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunk = std::max<int64_t>(64, (wd[1] + 4 * threads - 1) / (4 * threads));
  chunk = (chunk + kOutputs - 1) / kOutputs * kOutputs;
  parallel_units(pool, (wd[1] + chunk - 1) / chunk, [&problem, chunk](int64_t c) {
    outputs<kOutputs>(problem, c * chunk, std::min(problem.n_dim, (c + 1) * chunk));
  });
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
