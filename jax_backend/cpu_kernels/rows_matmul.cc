// y = x @ w.T for the few-row products of decode and verify steps, as one XLA:CPU custom call.
//
// XLA:CPU runs a 1-row product as its GEMV (~20 GB/s of weights here) and 2-64 rows through
// YNNPACK's kernels, which read weights from memory at 4-10 GB/s: every decode and verify step's
// dots were bound by them (docs/performance.md sections 23-24, 29). This kernel streams each weight
// row once from memory (prefetching the next tile while it computes this one) and keeps a tile of
// rows x outputs in vector registers (4 x 6 or 8 x 3 with AVX-512, 5 x 5 on AMD Zen, 4 x 3 with
// AVX2), so the rows it reuses come from L1.
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

// Register tiles of RB rows x NB outputs (their accumulators `vn`s, common.h).
// AVX-512 (32 registers): one row 1 x 8; 2-8 rows one block of
// 8 x 3 tiles, so each weight tile is read from memory once (at 8 rows 0.62-0.76 of 4 x 6's
// time, section 31b); 13-16 rows (a verify block of 16, two of 8) 6 x 4 tiles (with weights from
// memory 0.73-0.85 of 4 x 6's time; at 9-12 rows 1.07-1.29, section 31c); other rows 4 x 6 (24
// accumulators + 6 weight vectors; against 3 x 8 tiles at 16 rows and batch-32 decode 0.78-0.94,
// section 30).
// AMD Zen with AVX-512 (GCC's -march=native names it znver3 or later): one row 1 x 12 and other
// rows 5 x 5 (of 1 x 8 and 4 x 6's time with weights from memory: 0.90-0.94 at one row and K =
// 576, 0.82-0.91 at 24-64 rows but 1.00 for 1536 x 576 at 24; section 39). Intel keeps its own.
// AVX2 (16 registers of 8 floats): 1 x 6 (two registers per output), and 4 x 3 tiles taking the
// two halves of their lanes in turn (12 accumulators) for any other number of rows: 1.5-1.7x the
// 3 x 2 tiles of both halves at once at 16-64 rows (section 37).
#ifndef TILE  // rows, outputs, outputs of a one-row tile (a build flag for tile experiments)
#if defined(__AVX512F__) && (defined(__znver3__) || defined(__znver4__) || defined(__znver5__))
#define TILE 5, 5, 12
#else
#define TILE 4, (kAvx512 ? 6 : 3), (kAvx512 ? 8 : 6)
#endif
#endif
constexpr int kTile[3] = {TILE};
constexpr int kRows = kTile[0], kOutputs = kTile[1], kRowOutputs = kTile[2];
constexpr int kFewRows = 8, kFewOutputs = 3;  // with AVX-512, 2..kFewRows rows: one block of these tiles
constexpr int kMidFirst = 13, kMidLast = 16, kMidTile = 6, kMidOutputs = 4;  // AVX-512, 13..16 rows

// Lanes [part0 * kLanes, (part0 + NP) * kLanes) of the 16-lane sums of a tile of RB rows and NB
// outputs: out[(r * NB + n) * NP + p] += part0 + p's lanes of x[r, :] * w[n, :], over every k in
// order (the last K % 16 columns zero-padded: zeros add nothing to any lane). `next` (the next
// tile's weights, or null) is prefetched while this one computes, spread over the tile's `blocks`
// row blocks: this one (`block`) takes every blocks-th cache line of each weight row. Prefetching
// the whole next tile in the first row block's steps queued more misses than the core keeps in
// flight.
template <int RB, int NB, int NP>
inline void accumulate(const float* x, const float* w, int64_t k_dim, int part0, vn* out, const float* next,
                       int64_t block, int64_t blocks) {
  vn acc[RB * NB * NP];
  for (int i = 0; i < RB * NB * NP; ++i) acc[i] = vn{};
  const int64_t k16 = k_dim & ~int64_t{15};
  // Cache line k / 16 of the next tile is this block's to prefetch when (k / 16) % blocks == block.
  const int64_t first = next ? 16 * block : k16, stride = 16 * blocks;
  for (int64_t k = 0, fetch = first; k < k16; k += 16) {
    if (k == fetch) {
      for (int n = 0; n < NB; ++n) __builtin_prefetch(next + n * k_dim + k, 0, 3);
      fetch += stride;
    }
    for (int p = 0; p < NP; ++p) {
      const int64_t at = k + (part0 + p) * kLanes;
      vn wv[NB];
      for (int n = 0; n < NB; ++n) wv[n] = load_n(w + n * k_dim + at);
      for (int r = 0; r < RB; ++r) {
        const vn xv = load_n(x + r * k_dim + at);
        for (int n = 0; n < NB; ++n) acc[(r * NB + n) * NP + p] += xv * wv[n];
      }
    }
  }
  if (k16 < k_dim) {
    float wt[NB][16] = {}, xt[RB][16] = {};
    for (int n = 0; n < NB; ++n) std::memcpy(wt[n], w + n * k_dim + k16, (k_dim - k16) * sizeof(float));
    for (int r = 0; r < RB; ++r) std::memcpy(xt[r], x + r * k_dim + k16, (k_dim - k16) * sizeof(float));
    for (int r = 0; r < RB; ++r)
      for (int n = 0; n < NB; ++n)
        for (int p = 0; p < NP; ++p)
          acc[(r * NB + n) * NP + p] += load_n(xt[r] + (part0 + p) * kLanes) * load_n(wt[n] + (part0 + p) * kLanes);
  }
  for (int i = 0; i < RB * NB * NP; ++i) out[i] = acc[i];
}

// y[r, n] = x[r, :] . w[n, :] for RB rows and NB outputs; lane j of output (r, n) sums k = j,
// j + 16, .. in order, whatever the vector width. With AVX2 a tile of more than one row takes one
// half of the lanes after the other: RB x NB accumulators of 8 lanes instead of
// RB x NB x 2, so its tiles can be twice as large (4 x 3 rather than 3 x 2: 7 loads per 12 FMAs
// rather than 5 per 6), the second pass reading the tile's weights from cache.
template <int RB, int NB>
void tile(const float* x, const float* w, int64_t k_dim, float* y, int64_t ldy, const float* next, int64_t block,
          int64_t blocks) {
  vn acc[RB * NB * kParts];  // output (r, n)'s lanes are acc[(r * NB + n) * kParts + part]
  if constexpr (kParts == 2 && RB > 1) {
    vn half[RB * NB];
    for (int part = 0; part < 2; ++part) {
      accumulate<RB, NB, 1>(x, w, k_dim, part, half, part ? nullptr : next, block, blocks);
      for (int i = 0; i < RB * NB; ++i) acc[i * 2 + part] = half[i];
    }
  } else {
    accumulate<RB, NB, kParts>(x, w, k_dim, 0, acc, next, block, blocks);
  }
  float s[RB * NB];
  lane_sums<RB * NB>(acc, s);
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) y[r * ldy + n] = s[r * NB + n];
}

// A tile of `rows` < RB rows (the rows left after the full tiles).
template <int RB, int NB>
void short_tile(int64_t rows, const float* x, const float* w, int64_t k_dim, float* y, int64_t ldy,
                const float* next, int64_t block, int64_t blocks) {
  if constexpr (RB > 0) {
    if (rows == RB) return tile<RB, NB>(x, w, k_dim, y, ldy, next, block, blocks);
    short_tile<RB - 1, NB>(rows, x, w, k_dim, y, ldy, next, block, blocks);
  }
}

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t rows, k_dim, n_dim;
};

// Outputs [n0, n1) of every row, in tiles of RB rows x NB outputs.
template <int RB, int NB>
void outputs(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t blocks = (p.rows + RB - 1) / RB;
  for (int64_t n = n0; n < n1; n += NB) {
    const float* w = p.w + n * p.k_dim;
    const float* next = n + NB < n1 ? w + NB * p.k_dim : nullptr;
    if constexpr (NB > 1) {
      if (n + NB > n1) return outputs<RB, 1>(p, n, n1);
    }
    int64_t r = 0;
    for (; r + RB <= p.rows; r += RB)
      tile<RB, NB>(p.x + r * p.k_dim, w, p.k_dim, p.y + r * p.n_dim + n, p.n_dim, next, r / RB, blocks);
    if (r < p.rows)
      short_tile<RB - 1, NB>(p.rows - r, p.x + r * p.k_dim, w, p.k_dim, p.y + r * p.n_dim + n, p.n_dim, next,
                             r / RB, blocks);
  }
}

// Every output of `p` in RB x NB tiles, over the pool's threads: a few chunks per thread balance
// them, each chunk a multiple of a tile's outputs.
template <int RB, int NB>
void run(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunk = std::max<int64_t>(64, (p.n_dim + 4 * threads - 1) / (4 * threads));
  chunk = (chunk + NB - 1) / NB * NB;
  parallel_units(pool, (p.n_dim + chunk - 1) / chunk, [&p, chunk](int64_t c) {
    outputs<RB, NB>(p, c * chunk, std::min(p.n_dim, (c + 1) * chunk));
  });
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
  if (problem.rows == 1)
    run<1, kRowOutputs>(pool, problem);
  else if (kAvx512 && problem.rows <= kFewRows)
    run<kFewRows, kFewOutputs>(pool, problem);
  else if (kAvx512 && problem.rows >= kMidFirst && problem.rows <= kMidLast)
    run<kMidTile, kMidOutputs>(pool, problem);
  else
    run<kRows, kOutputs>(pool, problem);
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
