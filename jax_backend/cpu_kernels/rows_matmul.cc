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
// layer s32 [] (which of the L to use). Output y [R, N] f32. `sgl_dflash_rows_matmul_blocks` takes
// the weights as GGUF Q4_1 / Q8_0 blocks instead (`Weights`): ~5x fewer bytes, the same products,
// each weight vector decoded in registers and used at once by a tile's rows (`decoded_tile`,
// AVX-512 and AVX2), or for many rows decoded into scratch for the float32 tiles.
//
// Every output is the same sum in the same order whatever R, its row or its tile: 16 lanes each
// accumulate k = lane, lane + 16, ... in order, then lanes fold pairwise (i + 8, + 4, + 2, + 1).
// So a verify block's rows and a decode step's single row get bit-identical products.
//
// Work is split over chunks of outputs (`parallel_units`).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace ffi = xla::ffi;

namespace {

// 16 bytes at p as 16 int32 lanes, zero- or sign-extended (one instruction with AVX-512; GCC
// scalarizes the generic vector conversion).
template <bool Signed>
inline i16 widen(const uint8_t* p) {
  i16 out;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i w = Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  std::memcpy(&out, &w, 64);
#elif defined(__AVX2__)
  for (int h = 0; h < 2; ++h) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h));
    const __m256i w = Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    std::memcpy(reinterpret_cast<char*>(&out) + 32 * h, &w, 32);
  }
#else
  for (int i = 0; i < 16; ++i) out[i] = Signed ? int32_t(int8_t(p[i])) : int32_t(p[i]);
#endif
  return out;
}

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
// flight. Into L2 (prefetcht1): at 4-16 rows a cold weight read 0.66-0.99x the time of asking
// for it into L1, the same at 32 (docs/performance.md section 47).
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
      for (int n = 0; n < NB; ++n) __builtin_prefetch(next + n * k_dim + k, 0, 2);
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

// 16 bfloat16 at p as float32 (exact: a bfloat16 is a float32's high half).
inline v16 bf16x16(const uint8_t* p) {
  i16 out;
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&out, &wide, 64);
#elif defined(__AVX2__)
  for (int h = 0; h < 2; ++h) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
    std::memcpy(reinterpret_cast<char*>(&out) + 32 * h, &wide, 32);
  }
#else
  for (int i = 0; i < 16; ++i) out[i] = int32_t(p[2 * i]) | int32_t(p[2 * i + 1]) << 8;
#endif
  out <<= 16;
  v16 w;
  std::memcpy(&w, &out, 64);
  return w;
}

// Out-major weights [N, K]: float32 rows read in place, or GGUF's blocks of 32 along K, decoded
// a tile's rows at a time into float32 (the same values the checkpoint's float32 dequantization
// holds, so the same products) where the tiles read them from cache:
//   Q4_1 (bits 4): codes [N, K/2], byte j of a block holds q_j (low nibble) and q_{j+16} (high);
//     w = q * scale + offset (q * scale is exact in float32, so one rounding, as numpy's);
//   Q8_0 (bits 8): codes [N, K] int8; w = q * scale (exact);
//   bfloat16 (bits 16): codes [N, 2K], the weights' bfloat16 bytes (exact; no scale or offset).
struct Weights {
  const float* f32 = nullptr;
  const uint8_t* codes = nullptr;
  const float* scale = nullptr;   // [N, K/32]
  const float* offset = nullptr;  // [N, K/32], Q4_1 only
  int bits = 32;

  // Rows [n, n + count) as float32 rows of k_dim: in place, or decoded into `scratch`.
  const float* rows(int64_t n, int64_t count, int64_t k_dim, float* scratch) const {
    if (bits == 32) return f32 + n * k_dim;
    const int64_t blocks = k_dim / 32;
    for (int64_t i = 0; i < count; ++i) {
      const float* s = bits == 16 ? nullptr : scale + (n + i) * blocks;
      float* out = scratch + i * k_dim;
      if (bits == 4) {
        const uint8_t* q = codes + (n + i) * (k_dim / 2);
        const float* m = offset + (n + i) * blocks;
        for (int64_t b = 0; b < blocks; ++b) {
          const i16 packed = widen<false>(q + b * 16);
          const v16 lo = __builtin_convertvector(packed & 15, v16), hi = __builtin_convertvector(packed >> 4, v16);
          store(out + b * 32, lo * s[b] + m[b]);
          store(out + b * 32 + 16, hi * s[b] + m[b]);
        }
      } else if (bits == 16) {
        for (int64_t b = 0; b < 2 * blocks; ++b) store(out + b * 16, bf16x16(codes + (n + i) * 2 * k_dim + b * 32));
      } else {
        const uint8_t* q = codes + (n + i) * k_dim;
        for (int64_t b = 0; b < blocks; ++b)
          for (int h = 0; h < 2; ++h)
            store(out + b * 32 + h * 16, __builtin_convertvector(widen<true>(q + b * 32 + h * 16), v16) * s[b]);
      }
    }
    return scratch;
  }
};

struct Problem {
  const float* x;
  Weights w;
  float* y;
  int64_t rows, k_dim, n_dim;
};

#if defined(__AVX512F__)  // one vector is half a block; AVX2: a quarter (below)
// lane_sums<1>'s value (the pairs i + 8, + 4, + 2, + 1) from one vector's own halves, where
// lane_sums<1> would fold 16 vectors to sum one.
inline float lane_sum(vn a) {
  const __m512 v = (__m512)a;
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// How many output rows ahead a decoded tile of 2+ rows asks for its weights (into L2), for bfloat16,
// Q8_0 and Q4_1 (0: not at all; a build flag for experiments). At 4-16 rows the hardware's own
// prefetch did not keep the bytes coming: a cold bfloat16 weight read 0.57-0.73x and the Q8_0
// lm_head 0.79-0.85x the time with it; Q4_1, fewer bytes per product, is bound in the core
// (docs/performance.md section 47). One row streams fast enough without it.
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2, 2, 0
#endif
constexpr int kPrefetchAhead[3] = {PREFETCH_AHEAD};

// Outputs [n, n + G) of R rows from GGUF blocks (AVX-512: a vector is half a block), each weight
// vector decoded in registers and used at once by every row: the same values, products and order
// as `tile` over decoded rows, without storing and reloading them. Few outputs at a time: with 2-12
// outputs of one row at once (each its own codes, scales and offsets) the one-row products ran
// 1.1-2.4x slower (the lm_head's 49,152 x 576 Q8_0 at one row: 1.15-1.34 ms with G = 1, 2.1-3.3
// with 2-8).
template <int Bits, int R, int G>
void decoded_tile(const Problem& p, int64_t n, int64_t r0) {  // rows [r0, r0 + R)
  const int64_t k_dim = p.k_dim, blocks = k_dim / 32, row_bytes = k_dim * Bits / 8;
  const float* xr = p.x + r0 * k_dim;
  float* yr = p.y + r0 * p.n_dim;
  vn acc[R * G];
  for (int i = 0; i < R * G; ++i) acc[i] = vn{};
  for (int64_t b = 0; b < blocks; ++b) {
    vn w0[G], w1[G];  // the block's two weight vectors of each output, decoded once
    for (int g = 0; g < G; ++g) {
      const uint8_t* codes = p.w.codes + (n + g) * row_bytes;
      constexpr int ahead = kPrefetchAhead[Bits == 16 ? 0 : Bits == 8 ? 1 : 2];
      if constexpr (R > 1 && ahead > 0) __builtin_prefetch(codes + ahead * row_bytes + b * 4 * Bits, 0, 2);
      if constexpr (Bits == 16) {
        w0[g] = (vn)bf16x16(codes + b * 64);
        w1[g] = (vn)bf16x16(codes + b * 64 + 32);
        continue;
      }
      const float s = p.w.scale[(n + g) * blocks + b];
      if constexpr (Bits == 4) {
        const float m = p.w.offset[(n + g) * blocks + b];
        const i16 packed = widen<false>(codes + b * 16);
        // The block's 16 possible weights q * s + m (q = 0..15, the same values as converting
        // each code), then each weight is one permute: 0.82-0.99x the time of two conversions
        // and FMAs per vector at 1-16 rows (docs/performance.md section 47).
        const vn table = vn{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} * s + m;
        w0[g] = (vn)_mm512_permutexvar_ps((__m512i)(packed & 15), (__m512)table);
        w1[g] = (vn)_mm512_permutexvar_ps((__m512i)(packed >> 4), (__m512)table);
      } else {
        w0[g] = __builtin_convertvector(widen<true>(codes + b * 32), vn) * s;
        w1[g] = __builtin_convertvector(widen<true>(codes + b * 32 + 16), vn) * s;
      }
    }
    for (int r = 0; r < R; ++r) {  // each row's x loaded once for the G outputs
      vn x0 = load_n(xr + r * k_dim + b * 32), x1 = load_n(xr + r * k_dim + b * 32 + 16);
      // Held in registers: GCC otherwise folds the load into each output's FMA, loading x G times,
      // and on AMD Zen 4 a 64-byte load takes the cycle's load bandwidth (Q4_1 at 16 rows 0.93-0.95x
      // the time, at 8 0.96-1.01x; docs/performance.md section 61). The same arithmetic, the same bits.
#ifndef X_FOLDED  // a build flag for experiments: the loads folded as GCC chooses
      if constexpr (G > 1) asm("" : "+v"(x0), "+v"(x1));
#endif
      for (int g = 0; g < G; ++g) acc[r * G + g] += x0 * w0[g];
      for (int g = 0; g < G; ++g) acc[r * G + g] += x1 * w1[g];
    }
  }
  if constexpr (R * G == 1) {
    yr[n] = lane_sum(acc[0]);
  } else {
    float sums[R * G];
    lane_sums<R * G>(acc, sums);
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) yr[r * p.n_dim + n + g] = sums[r * G + g];
  }
}

// Rows [r0, r0 + rows) (1-8) of G = 1 or 2 outputs from n.
template <int Bits, int G>
void decoded_rows(const Problem& p, int64_t n, int64_t r0, int64_t rows) {
  switch (rows) {
    case 1: return decoded_tile<Bits, 1, G>(p, n, r0);
    case 2: return decoded_tile<Bits, 2, G>(p, n, r0);
    case 3: return decoded_tile<Bits, 3, G>(p, n, r0);
    case 4: return decoded_tile<Bits, 4, G>(p, n, r0);
    case 5: return decoded_tile<Bits, 5, G>(p, n, r0);
    case 6: return decoded_tile<Bits, 6, G>(p, n, r0);
    case 7: return decoded_tile<Bits, 7, G>(p, n, r0);
    default: return decoded_tile<Bits, 8, G>(p, n, r0);
  }
}

// From this many rows (a batch-24+ decode, verify blocks of 24+ rows) GGUF weights are decoded a
// tile's outputs at a time into scratch and the float32 tiles read them from L1, where
// `decoded_outputs` decodes each weight vector again for every 8 rows: at 24-64 rows 0.82-0.99x
// the time (Q4_1 MLP and attention shapes, the Q8_0 lm_head at 32; at 16 rows 1.0-1.35x;
// docs/performance.md section 50). The same bits: the same decoded values, products and order.
#ifndef BLOCKS_SCRATCH_ROWS  // a build flag for experiments
#define BLOCKS_SCRATCH_ROWS 24
#endif
constexpr int64_t kScratchRows = BLOCKS_SCRATCH_ROWS, kScratchMaxK = INT64_MAX;

// Outputs [n0, n1) of every row: two outputs at a time (one for a single row: measured, G = 2
// beat 1, 3, 4 and 6 at 4 and 8 rows), their rows in tiles of up to 8 that decode the same
// weights again from cache (past 8 rows the accumulators would not fit the registers).
template <int Bits>
void decoded_outputs(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1;) {
    const bool pair = p.rows > 1 && n + 2 <= n1;
    for (int64_t r0 = 0; r0 < p.rows; r0 += 8) {
      const int64_t rows = std::min<int64_t>(8, p.rows - r0);
      pair ? decoded_rows<Bits, 2>(p, n, r0, rows) : decoded_rows<Bits, 1>(p, n, r0, rows);
    }
    n += pair ? 2 : 1;
  }
}
#define SGL_DFLASH_DECODED_TILES 1

#elif defined(SGL_DFLASH_AVX2_HALVES) && !defined(AVX2_SCRATCH)
// AVX2 (16 registers of 8 floats): GGUF and bfloat16 weights decoded in registers too, where they
// were decoded into scratch and read back by the float32 tiles (a one-row decode step spent more
// time in that round trip than in its products: a one-row Q4_1 product now takes 0.33-0.40x the
// time, 8 rows 0.57-0.69x; docs/performance.md section 62). `-DAVX2_SCRATCH` builds the old path.
// A vector is a quarter of a block: half `part` of the 16-lane sums takes k = b * 32 + 8 * part +
// [0, 8) (w0) and, 16 further on, w1, in that order, so each lane sums the same products in the
// same order as `tile` over decoded rows: the same bits.
// From 32 rows the float32 tiles over scratch, for K below 1024: at 32-64 rows 0.91-1.14x the time
// of decoding in registers where K = 576, but 0.64-0.74x the time at K = 1536 (whose 4 x 3 tiles
// over scratch read 60-67 GFLOP/s); at 24 rows registers were as fast or faster at every K.
#ifndef BLOCKS_SCRATCH_ROWS  // a build flag for experiments
#define BLOCKS_SCRATCH_ROWS 32
#endif
constexpr int64_t kScratchRows = BLOCKS_SCRATCH_ROWS, kScratchMaxK = 1023;

typedef int32_t vi __attribute__((vector_size(32)));

// Half `part` of output n's block b: w0 (k = b * 32 + 8 * part + [0, 8)) and w1 (16 further on),
// the same values as `Weights::rows` decodes.
template <int Bits>
inline void decode_quarters(const Problem& p, int64_t n, int64_t b, int part, vn& w0, vn& w1) {
  const int64_t k_dim = p.k_dim, blocks = k_dim / 32;
  const uint8_t* codes = p.w.codes + n * (k_dim * Bits / 8);
  if constexpr (Bits == 16) {
    const uint8_t* at = codes + (b * 32 + 8 * part) * 2;
    const vi lo = (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    const vi hi = (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 32)));
    w0 = (vn)(lo << 16), w1 = (vn)(hi << 16);
  } else if constexpr (Bits == 4) {
    const float s = p.w.scale[n * blocks + b], m = p.w.offset[n * blocks + b];
    const vi q = (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + b * 16 + 8 * part)));
    w0 = __builtin_convertvector(q & 15, vn) * s + m;
    w1 = __builtin_convertvector(q >> 4, vn) * s + m;
  } else {
    const float s = p.w.scale[n * blocks + b];
    const uint8_t* at = codes + b * 32 + 8 * part;
    w0 = __builtin_convertvector((vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at))), vn) * s;
    w1 = __builtin_convertvector((vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 16))), vn) * s;
  }
}

// Outputs [n, n + G) of rows [r0, r0 + R). One row takes both halves at once (2G accumulators);
// more rows take one half after the other (R x G accumulators), the second pass reading the
// codes again from cache.
template <int Bits, int R, int G>
void decoded_tile(const Problem& p, int64_t n, int64_t r0) {
  const int64_t k_dim = p.k_dim, blocks = k_dim / 32, row_bytes = k_dim * Bits / 8;
  const float* xr = p.x + r0 * k_dim;
  float* yr = p.y + r0 * p.n_dim;
  constexpr int kPasses = R == 1 ? 1 : 2, kAtOnce = 2 / kPasses;
  vn all[R * G * 2];
  for (int pass = 0; pass < kPasses; ++pass) {
    vn acc[R * G * kAtOnce];
    for (int i = 0; i < R * G * kAtOnce; ++i) acc[i] = vn{};
    for (int64_t b = 0; b < blocks; ++b) {
      if (R > 1 && pass == 0)
        for (int g = 0; g < G; ++g) __builtin_prefetch(p.w.codes + (n + g + 2) * row_bytes + b * 4 * Bits, 0, 2);
      for (int h = 0; h < kAtOnce; ++h) {
        const int part = pass + h;
        vn w0[G], w1[G];
        for (int g = 0; g < G; ++g) decode_quarters<Bits>(p, n + g, b, part, w0[g], w1[g]);
        for (int r = 0; r < R; ++r) {
          const float* x = xr + r * k_dim + b * 32 + 8 * part;
          vn x0 = load_n(x), x1 = load_n(x + 16);
          if constexpr (G > 1) asm("" : "+x"(x0), "+x"(x1));  // loaded once for the G outputs
          for (int g = 0; g < G; ++g) acc[(r * G + g) * kAtOnce + h] += x0 * w0[g];
          for (int g = 0; g < G; ++g) acc[(r * G + g) * kAtOnce + h] += x1 * w1[g];
        }
      }
    }
    for (int i = 0; i < R * G; ++i)
      for (int h = 0; h < kAtOnce; ++h) all[i * 2 + pass + h] = acc[i * kAtOnce + h];
  }
  float sums[R * G];
  lane_sums<R * G>(all, sums);
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) yr[r * p.n_dim + n + g] = sums[r * G + g];
}

// Tiles of 4 rows x 2 outputs (of 3 x 2, 5 x 2, 6 x 2, 3 x 3, 2 x 4, 8 x 1 the fastest or as fast
// at 4-16 rows), and 1 x 2 for one row (two independent chains of FMAs: 0.82-0.93x the time of 1 x 1).
#ifndef AVX2_DECODED_TILE  // rows per tile, outputs per tile of 2+ rows, of one row (a build flag for experiments)
#define AVX2_DECODED_TILE 4, 2, 2
#endif
constexpr int kDecodedTile[3] = {AVX2_DECODED_TILE};
constexpr int kDecodedRows = kDecodedTile[0], kDecodedOutputs = kDecodedTile[1], kDecodedRowOutputs = kDecodedTile[2];

template <int Bits, int G, int R = kDecodedRows>
void decoded_rows(const Problem& p, int64_t n, int64_t r0, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return decoded_rows<Bits, G, R - 1>(p, n, r0, rows);
  }
  decoded_tile<Bits, R, G>(p, n, r0);
}

template <int Bits>
void decoded_outputs(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1;) {
    if (p.rows == 1 && n + kDecodedRowOutputs <= n1) {
      decoded_tile<Bits, 1, kDecodedRowOutputs>(p, n, 0);
      n += kDecodedRowOutputs;
      continue;
    }
    const bool group = p.rows > 1 && n + kDecodedOutputs <= n1;
    for (int64_t r0 = 0; r0 < p.rows; r0 += kDecodedRows) {
      const int64_t rows = std::min<int64_t>(kDecodedRows, p.rows - r0);
      group ? decoded_rows<Bits, kDecodedOutputs>(p, n, r0, rows) : decoded_rows<Bits, 1>(p, n, r0, rows);
    }
    n += group ? kDecodedOutputs : 1;
  }
}
#define SGL_DFLASH_DECODED_TILES 1
#endif  // __AVX512F__, or AVX2 decoded tiles

// Outputs [n0, n1) of every row, in tiles of RB rows x NB outputs.
template <int RB, int NB>
void outputs(const Problem& p, int64_t n0, int64_t n1, float* scratch) {
  const int64_t blocks = (p.rows + RB - 1) / RB;
  for (int64_t n = n0; n < n1; n += NB) {
    if constexpr (NB > 1) {
      if (n + NB > n1) return outputs<RB, 1>(p, n, n1, scratch);
    }
    const float* w = p.w.rows(n, NB, p.k_dim, scratch);
    // In-place rows prefetch the next tile's; decoded ones are read from cache.
    const float* next = p.w.bits == 32 && n + NB < n1 ? w + NB * p.k_dim : nullptr;
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
  // Each unit decodes a tile's rows into its own scratch (an L1/L2-sized buffer per thread).
  parallel_units(pool, (p.n_dim + chunk - 1) / chunk, [&p, chunk](int64_t c) {
    thread_local std::vector<float> scratch;
    if (p.w.bits != 32) scratch.resize(std::max<size_t>(scratch.size(), NB * p.k_dim + 16));
    // 64-byte aligned, as XLA's buffers are: a vector load across two cache lines cost ~25% (section 33).
    float* aligned = scratch.data() + (16 - reinterpret_cast<uintptr_t>(scratch.data()) / 4 % 16) % 16;
    outputs<RB, NB>(p, c * chunk, std::min(p.n_dim, (c + 1) * chunk), aligned);
  });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && !defined(SGL_DFLASH_NO_AMX_PRODUCTS)
#define SGL_DFLASH_AMX_PRODUCTS 1
constexpr bool kAmxProducts = true;

// Q4_1 products on AMX tiles, for weights in tile order (`blocks.TiledQ4`; docs/performance.md
// section 53): per block b of 32 along K,
//   y[r, n] += scale[n, b] * (sum_{k in b} q[n, k] x[r, k]) + offset[n, b] * (sum_{k in b} x[r, k]),
// the first sum by three bfloat16 tile products into one float32 tile: q (0..15) is exact in
// bfloat16 and x = x1 + x2 + x3 exactly (each part the bfloat16 truncation of what the previous
// ones left), so every product is exact and only float32 accumulation rounds. Rows are the A
// operand, the codes the B operand (16 pair-rows x 16 outputs per block, 256 bytes in tile order),
// C [rows, 16 outputs]. Each element of a row is computed alone, so a row's bits do not depend on
// the rows beside it; they are not the FMA kernel's bits (another summation). Steps of at most
// AMX_EMULATED_ROWS rows compute the same bits without tiles (`groups_emulated`): there the tiles
// cost more than they save (a batch-1 decode step 0.88x the FMA kernel's time emulated, 1.1-1.4x on
// tiles; from 8 rows the tiles 0.74-0.87x).
namespace amx_q4 {
#ifndef AMX_EMULATED_ROWS
#define AMX_EMULATED_ROWS 2
#endif
#ifndef AMX_UNITS
#define AMX_UNITS 8
#endif
#ifndef AMX_FEW_ROWS  // steps of up to this many rows (<= 16) run `groups_few_rows`
#define AMX_FEW_ROWS 16
#endif
#ifndef AMX_AHEAD
#define AMX_AHEAD 8
#endif
#ifndef AMX_LEVEL
#define AMX_LEVEL 2
#endif

constexpr int kMaxTiles = 4;  // rows <= 64: B tile 0, C tiles 1-4, A tiles 5-7

// Rows x [R, K] as three bfloat16 parts, x = x1 + x2 + x3 exactly (each part the bfloat16
// truncation of what the previous ones left): parts [3][part_rows][K]; where given, each block's
// sums [R][K / 32] and the parts as float32 values [3][R][K].
inline void split_parts(const float* x, int64_t r, int64_t k, uint16_t* parts, int64_t part_rows, float* sums,
                        float* values) {
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < k; j += 16) {
      __m512 rest = _mm512_loadu_ps(x + i * k + j);
      if (sums && j % 32 == 0) sums[i * (k / 32) + j / 32] = _mm512_reduce_add_ps(_mm512_add_ps(rest, _mm512_loadu_ps(x + i * k + j + 16)));
      for (int p = 0; p < 3; ++p) {
        const __m512i bits = _mm512_and_si512(_mm512_castps_si512(rest), high);
        rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(bits));  // exact: the bits below the part's
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts + (p * part_rows + i) * k + j),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
        if (values) _mm512_storeu_ps(values + (p * r + i) * k + j, _mm512_castsi512_ps(bits));
      }
    }
}

// The rows as three bfloat16 parts [3][tiles * 16][K] (zero rows past R) and each block's sums.
struct Rows {
  int64_t rows, tiles, k_dim, blocks;
  uint16_t* parts;
  float* sums;             // [R][blocks]
  float* values = nullptr;  // the parts as float32 [3][R][K], for the emulation

  // In the calling thread's buffers, kept between calls: a fresh allocation per call (~55-150 KB,
  // past glibc's mmap threshold at K = 1536) faulted its pages in again at every product.
  Rows(const float* x, int64_t r, int64_t k, bool emulated) : rows(r), tiles((r + 15) / 16), k_dim(k), blocks(k / 32) {
    static thread_local std::vector<uint16_t> part_buffer;
    static thread_local std::vector<float> sum_buffer, value_buffer;
    part_buffer.resize(std::max<size_t>(part_buffer.size(), 3 * tiles * 16 * k));
    sum_buffer.resize(std::max<size_t>(sum_buffer.size(), r * blocks));
    parts = part_buffer.data(), sums = sum_buffer.data();
    if (emulated) {  // the emulation reads the parts as floats
      value_buffer.resize(std::max<size_t>(value_buffer.size(), 3 * r * k));
      values = value_buffer.data();
    } else {
      for (int p = 0; p < 3; ++p)  // the last tile's rows past R: zeros
        std::memset(parts + (p * tiles * 16 + r) * k, 0, (tiles * 16 - r) * k * sizeof(uint16_t));
    }
    split_parts(x, r, k, parts, tiles * 16, sums, values);
  }
  const uint16_t* part(int p, int64_t tile, int64_t b) const { return parts + (p * tiles * 16 + tile * 16) * k_dim + b * 32; }
};

template <int C, int A, int B> inline void tile_dp() {  // C += A . B, bfloat16 (tile helpers: common.h)
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// The bfloat16 values of the codes 0..15 (words 0-15 of a permute table; the rest unused).
inline __m512i code_table() {
  return _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                          0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
}

// A block's codes (256 bytes in tile order) as the B tile's bfloat16 values (1 KB): per pair-row i,
// byte n = q[n, 2i] | q[n, 2i + 1] << 4 becomes the words (table[q[n, 2i]], table[q[n, 2i + 1]])
// (table: `code_table`).
// The permute's index words are the byte's low nibble and, 16 bits up, its high one: (b | b << 12)
// & 0x000F000F in one ternary-logic op (four shift/and/or ops before: the decode was a quarter of
// a 4-row verify step, the ports it shares with the permute its bound).
inline void decode_codes(const uint8_t* q, const __m512i& table, uint16_t* codes) {
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  for (int i = 0; i < 16; ++i) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * 16)));
    const __m512i index = _mm512_ternarylogic_epi32(bytes, _mm512_slli_epi32(bytes, 12), nibbles, 0xA8);  // (a | b) & c
    _mm512_store_si512(codes + i * 32, _mm512_permutexvar_epi16(index, table));
  }
}

// C tile 1 + T = row tile T's three parts . the block's codes (B tile 0), stored to c.
template <int T>
inline void row_tile(const Rows& rows, int64_t b, float* c) {
  if (T < rows.tiles) {
    const int64_t stride = rows.k_dim * 2;
    tile_zero<1 + T>();
    tile_load<5>(rows.part(0, T, b), stride);
    tile_dp<1 + T, 5, 0>();
    tile_load<6>(rows.part(1, T, b), stride);
    tile_dp<1 + T, 6, 0>();
    tile_load<7>(rows.part(2, T, b), stride);
    tile_dp<1 + T, 7, 0>();
    tile_store<1 + T>(c, 64);
  }
}

// Groups of 16 outputs [g0, g1) of p's rows.
void groups(const Problem& p, const Rows& rows, int64_t g0, int64_t g1) {
  configure_tiles();
  const __m512i table = code_table();
  alignas(64) uint16_t codes[512];
  alignas(64) float c[kMaxTiles * 256];
  alignas(64) float acc[kMaxTiles * 16][16];
  const int64_t blocks = rows.blocks;
  for (int64_t g = g0; g < g1; ++g) {
    std::memset(acc, 0, sizeof(float) * 16 * rows.rows);
    const uint8_t* q = p.w.codes + g * blocks * 256;
    const float *d = p.w.scale + g * blocks * 16, *m = p.w.offset + g * blocks * 16;
    for (int64_t b = 0; b < blocks; ++b, q += 256) {
      for (int line = 0; line < 4; ++line) __builtin_prefetch(q + AMX_AHEAD * 256 + line * 64, 0, AMX_LEVEL);
      __builtin_prefetch(d + (b + AMX_AHEAD) * 16, 0, AMX_LEVEL);
      __builtin_prefetch(m + (b + AMX_AHEAD) * 16, 0, AMX_LEVEL);
      decode_codes(q, table, codes);
      tile_load<0>(codes, 64);
      row_tile<0>(rows, b, c);
      row_tile<1>(rows, b, c + 256);
      row_tile<2>(rows, b, c + 512);
      row_tile<3>(rows, b, c + 768);
      const __m512 dv = _mm512_loadu_ps(d + b * 16), mv = _mm512_loadu_ps(m + b * 16);
      for (int64_t r = 0; r < rows.rows; ++r) {
        const __m512 a = _mm512_fmadd_ps(dv, _mm512_load_ps(c + r * 16), _mm512_load_ps(acc[r]));
        _mm512_store_ps(acc[r], _mm512_fmadd_ps(mv, _mm512_set1_ps(rows.sums[r * blocks + b]), a));
      }
    }
    for (int64_t r = 0; r < rows.rows; ++r) _mm512_storeu_ps(p.y + r * p.n_dim + g * 16, _mm512_load_ps(acc[r]));
  }
  _tile_release();
}

// One group of outputs' block in `few_rows`: the codes decoded to B tile B (0 or 4), C tile 1 + I
// = the parts (A tiles 5-7, loaded once for the G groups) . the codes, stored to c.
template <int I, int B>
inline void few_rows_group(const uint8_t* q, const __m512i& table, uint16_t* codes, float* c) {
  for (int line = 0; line < 4; ++line) __builtin_prefetch(q + AMX_AHEAD * 256 + line * 64, 0, AMX_LEVEL);
  decode_codes(q, table, codes);
  tile_load<B>(codes, 64);
  tile_zero<1 + I>();
  tile_dp<1 + I, 5, B>();
  tile_dp<1 + I, 6, B>();
  tile_dp<1 + I, 7, B>();
  tile_store<1 + I>(c, 64);
}

// `groups` for at most 16 rows: the A and C tiles configured R rows high (no zero rows loaded,
// multiplied or stored), and G groups of outputs from g at a time share each block's part loads
// (three A tiles per block and group before: at 4 rows those loads were most of a product's time).
// Every element is the same tile product as in `groups`: the same bits.
template <int G>
void few_rows(const Problem& p, const Rows& rows, int64_t g, const __m512i& table) {
  alignas(64) uint16_t codes[2][512];
  alignas(64) float c[3][256];
  alignas(64) float acc[3][16][16];
  const int64_t blocks = rows.blocks, stride = rows.k_dim * 2;
  const uint8_t* q = p.w.codes + g * blocks * 256;
  const float *d = p.w.scale + g * blocks * 16, *m = p.w.offset + g * blocks * 16;
  std::memset(acc, 0, sizeof(acc));
  for (int64_t b = 0; b < blocks; ++b) {
    for (int i = 0; i < G; ++i) {  // (the codes' lines: `few_rows_group`)
      __builtin_prefetch(d + (i * blocks + b + AMX_AHEAD) * 16, 0, AMX_LEVEL);
      __builtin_prefetch(m + (i * blocks + b + AMX_AHEAD) * 16, 0, AMX_LEVEL);
    }
    tile_load<5>(rows.part(0, 0, b), stride);
    tile_load<6>(rows.part(1, 0, b), stride);
    tile_load<7>(rows.part(2, 0, b), stride);
    few_rows_group<0, 0>(q + b * 256, table, codes[0], c[0]);
    if constexpr (G > 1) few_rows_group<1, 4>(q + (blocks + b) * 256, table, codes[1], c[1]);
    if constexpr (G > 2) few_rows_group<2, 0>(q + (2 * blocks + b) * 256, table, codes[0], c[2]);
    for (int i = 0; i < G; ++i) {
      const __m512 dv = _mm512_loadu_ps(d + (i * blocks + b) * 16), mv = _mm512_loadu_ps(m + (i * blocks + b) * 16);
      for (int64_t r = 0; r < rows.rows; ++r) {
        const __m512 a = _mm512_fmadd_ps(dv, _mm512_load_ps(c[i] + r * 16), _mm512_load_ps(acc[i][r]));
        _mm512_store_ps(acc[i][r], _mm512_fmadd_ps(mv, _mm512_set1_ps(rows.sums[r * blocks + b]), a));
      }
    }
  }
  for (int i = 0; i < G; ++i)
    for (int64_t r = 0; r < rows.rows; ++r) _mm512_storeu_ps(p.y + r * p.n_dim + (g + i) * 16, _mm512_load_ps(acc[i][r]));
}

void groups_few_rows(const Problem& p, const Rows& rows, int64_t g0, int64_t g1) {
  uint8_t heights[8];
  for (int t = 0; t < 8; ++t) heights[t] = uint8_t(t == 0 || t == 4 ? 16 : rows.rows);
  configure_tiles(heights);
  const __m512i table = code_table();
  int64_t g = g0;
  for (; g + 3 <= g1; g += 3) few_rows<3>(p, rows, g, table);
  if (g1 - g == 2) few_rows<2>(p, rows, g, table);
  if (g1 - g == 1) few_rows<1>(p, rows, g, table);
  _tile_release();
}

// `groups` without tiles, for few rows: the same bits, from the tile product's arithmetic as
// measured (docs/performance.md section 54: C + (the even-position products summed in order + the
// odd ones summed in order), each add rounded to nearest; a code times a part is exact, so an FMA
// is that add; test_amx_products checks it bit for bit against the tiles on every AMX host). Two
// rows at a time (12 accumulators), the codes decoded again for each pair.
void groups_emulated(const Problem& p, const Rows& rows, int64_t g0, int64_t g1) {
  const int64_t blocks = rows.blocks;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r0 = 0; r0 < rows.rows; r0 += 2) {
      const int nr = int(std::min<int64_t>(2, rows.rows - r0));
      __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      const uint8_t* q = p.w.codes + g * blocks * 256;
      const float *d = p.w.scale + g * blocks * 16, *m = p.w.offset + g * blocks * 16;
      for (int64_t b = 0; b < blocks; ++b, q += 256) {
        for (int line = 0; line < 4; ++line) __builtin_prefetch(q + AMX_AHEAD * 256 + line * 64, 0, AMX_LEVEL);
        __m512 even[2][3], odd[2][3];
        for (int r = 0; r < 2; ++r)
          for (int k = 0; k < 3; ++k) even[r][k] = odd[r][k] = _mm512_setzero_ps();
        for (int i = 0; i < 16; ++i) {
          const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * 16)));
          const __m512 qe = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
          const __m512 qo = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
          for (int r = 0; r < nr; ++r)
            for (int k = 0; k < 3; ++k) {
              const float* x = rows.values + (k * rows.rows + r0 + r) * rows.k_dim + b * 32 + 2 * i;
              even[r][k] = _mm512_fmadd_ps(qe, _mm512_set1_ps(x[0]), even[r][k]);
              odd[r][k] = _mm512_fmadd_ps(qo, _mm512_set1_ps(x[1]), odd[r][k]);
            }
        }
        const __m512 dv = _mm512_loadu_ps(d + b * 16), mv = _mm512_loadu_ps(m + b * 16);
        for (int r = 0; r < nr; ++r) {
          __m512 c = _mm512_setzero_ps();
          for (int k = 0; k < 3; ++k) c = _mm512_add_ps(c, _mm512_add_ps(even[r][k], odd[r][k]));
          acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(rows.sums[(r0 + r) * blocks + b]), _mm512_fmadd_ps(dv, c, acc[r]));
        }
      }
      for (int r = 0; r < nr; ++r) _mm512_storeu_ps(p.y + (r0 + r) * p.n_dim + g * 16, acc[r]);
    }
}

void run(ffi::ThreadPool& pool, const Problem& p, bool tiles) {
  const Rows rows(p.x, p.rows, p.k_dim, !tiles);
  const int64_t count = p.n_dim / 16, units = std::min<int64_t>(count, AMX_UNITS * std::max<int64_t>(1, pool.num_threads()));
  const int64_t per = (count + units - 1) / units;
  parallel_units(pool, (count + per - 1) / per, [&p, &rows, per, count, tiles](int64_t u) {
    (!tiles ? groups_emulated : rows.rows <= AMX_FEW_ROWS ? groups_few_rows : groups)(p, rows, u * per, std::min(count, (u + 1) * per));
  });
}

}  // namespace amx_q4

// bfloat16 weights on AMX tiles (the drafter's bf16 checkpoint; `rows_matmul(bf16_tiled=True)`),
// for weights in tile order (`cpu_kernels.bf16_tile_order`: per 16 outputs and 32 k, the B tile of
// 16 k-pairs x 16 outputs, 1 KB): each row is split into three bfloat16 parts (x = x1 + x2 + x3
// exactly, as in amx_q4), the A operand, so every product is exact and only float32 accumulation
// rounds: y[r, n] = sum over blocks and parts of the tiles' sums, in one float32 C tile. An element
// of C is computed from its row alone, so a row's bits do not depend on the rows beside it or
// their number (they are not the FMA kernel's bits: another summation). At 8 rows the FMA kernel's
// products were bound by its multiply-adds (docs/performance.md section 55).
namespace amx_bf16 {
using amx_q4::tile_dp;

// The rows' three parts [3][tiles * 16][K] bfloat16, in the calling thread's buffer kept between
// calls. One row tile (R <= 16) is configured R rows high; of several, the last one's rows past R
// are zeros.
struct Parts {
  int64_t rows, tiles, k_dim;
  uint16_t* parts;

  Parts(const float* x, int64_t r, int64_t k) : rows(r), tiles((r + 15) / 16), k_dim(k) {
    static thread_local std::vector<uint16_t> buffer;
    buffer.resize(std::max<size_t>(buffer.size(), 3 * tiles * 16 * k));
    parts = buffer.data();
    if (tiles > 1)
      for (int p = 0; p < 3; ++p) std::memset(parts + (p * tiles * 16 + r) * k, 0, (tiles * 16 - r) * k * 2);
    amx_q4::split_parts(x, r, k, parts, tiles * 16, nullptr, nullptr);
  }
  const uint16_t* part(int p, int64_t tile, int64_t b) const { return parts + (p * tiles * 16 + tile * 16) * k_dim + b * 32; }
  int height() const { return tiles == 1 ? int(rows) : 16; }  // rows of the A and C tiles
};

// Tiles: B (weights) 0 and 4, C 1-3 (one per group of outputs or per row tile; 4 too for the
// fourth row tile), A (the rows' parts) 5-7.
void configure(const Parts& parts) {
  uint8_t rows[8];
  for (int t = 0; t < 8; ++t) rows[t] = uint8_t(t == 0 || (t == 4 && parts.tiles < 4) ? 16 : parts.height());
  configure_tiles(rows);
}

// Weight tiles of the blocks AMX_AHEAD ahead into L2, one 1 KB tile per group of outputs.
inline void prefetch(const uint16_t* group, int64_t b, int64_t blocks) {
  if (b + AMX_AHEAD < blocks)
    for (int line = 0; line < 16; ++line) __builtin_prefetch(group + (b + AMX_AHEAD) * 512 + line * 32, 0, AMX_LEVEL);
}

template <int C, int B>
inline void group_block(const uint16_t* group, int64_t b) {
  tile_load<B>(group + b * 512, 64);
  tile_dp<C, 5, B>();
  tile_dp<C, 6, B>();
  tile_dp<C, 7, B>();
}

// At most 16 rows: G groups of outputs from g at a time (C tiles 1..G), each block's parts loaded
// once for all of them (from 8 rows the A loads cost as much as the products).
template <int G>
void one_row_tile(const Problem& p, const Parts& parts, int64_t g) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(p.w.codes) + g * 16 * p.k_dim;
  const int64_t blocks = p.k_dim / 32, next = 16 * p.k_dim;  // group g + 1's tiles
  tile_zero<1>();
  if constexpr (G > 1) tile_zero<2>();
  if constexpr (G > 2) tile_zero<3>();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int i = 0; i < G; ++i) prefetch(w + i * next, b, blocks);
    tile_load<5>(parts.part(0, 0, b), p.k_dim * 2);
    tile_load<6>(parts.part(1, 0, b), p.k_dim * 2);
    tile_load<7>(parts.part(2, 0, b), p.k_dim * 2);
    group_block<1, 0>(w, b);
    if constexpr (G > 1) group_block<2, 4>(w + next, b);
    if constexpr (G > 2) group_block<3, 0>(w + 2 * next, b);
  }
  const int64_t stride = p.n_dim * 4;  // C [rows, 16 outputs] straight into y
  tile_store<1>(p.y + g * 16, stride);
  if constexpr (G > 1) tile_store<2>(p.y + (g + 1) * 16, stride);
  if constexpr (G > 2) tile_store<3>(p.y + (g + 2) * 16, stride);
}

template <int T>
inline void row_tile(const Parts& parts, int64_t b) {
  if (T < parts.tiles) {
    tile_load<5>(parts.part(0, T, b), parts.k_dim * 2);
    tile_load<6>(parts.part(1, T, b), parts.k_dim * 2);
    tile_load<7>(parts.part(2, T, b), parts.k_dim * 2);
    tile_dp<1 + T, 5, 0>();
    tile_dp<1 + T, 6, 0>();
    tile_dp<1 + T, 7, 0>();
  }
}

template <int T>
inline void zero_tile(const Parts& parts) {
  if (T < parts.tiles) tile_zero<1 + T>();
}

// 17-64 rows: one group of outputs at a time, a C tile per 16 rows (1-4).
void row_tiles(const Problem& p, const Parts& parts, int64_t g) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(p.w.codes) + g * 16 * p.k_dim;
  const int64_t blocks = p.k_dim / 32;
  zero_tile<0>(parts);
  zero_tile<1>(parts);
  zero_tile<2>(parts);
  zero_tile<3>(parts);
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch(w, b, blocks);
    tile_load<0>(w + b * 512, 64);
    row_tile<0>(parts, b);
    row_tile<1>(parts, b);
    row_tile<2>(parts, b);
    row_tile<3>(parts, b);
  }
  alignas(64) float c[amx_q4::kMaxTiles * 256];
  tile_store<1>(c, 64);
  if (parts.tiles > 1) tile_store<2>(c + 256, 64);
  if (parts.tiles > 2) tile_store<3>(c + 512, 64);
  if (parts.tiles > 3) tile_store<4>(c + 768, 64);
  for (int64_t r = 0; r < p.rows; ++r) std::memcpy(p.y + r * p.n_dim + g * 16, c + r * 16, 64);
}

// Groups of 16 outputs [g0, g1).
void groups(const Problem& p, const Parts& parts, int64_t g0, int64_t g1) {
  configure(parts);
  for (int64_t g = g0; g < g1;) {
    if (parts.tiles > 1) {
      row_tiles(p, parts, g), g += 1;
    } else if (g1 - g >= 3) {
      one_row_tile<3>(p, parts, g), g += 3;
    } else if (g1 - g == 2) {
      one_row_tile<2>(p, parts, g), g += 2;
    } else {
      one_row_tile<1>(p, parts, g), g += 1;
    }
  }
  _tile_release();
}

void run(ffi::ThreadPool& pool, const Problem& p) {
  const Parts parts(p.x, p.rows, p.k_dim);
  const int64_t count = p.n_dim / 16, units = std::min<int64_t>(count, 2 * std::max<int64_t>(1, pool.num_threads()));
  const int64_t per = (count + units - 1) / units;
  parallel_units(pool, (count + per - 1) / per,
                 [&p, &parts, per, count](int64_t u) { groups(p, parts, u * per, std::min(count, (u + 1) * per)); });
}

}  // namespace amx_bf16
#else
constexpr bool kAmxProducts = false;
#endif

// Whether Q4_1 products in tile order run here (`amx_q4`): built with AMX and granted it.
bool amx_products() { return kAmxProducts && amx_permission(); }

void dispatch(ffi::ThreadPool& pool, const Problem& problem) {
#if defined(SGL_DFLASH_DECODED_TILES)
  if (problem.w.bits != 32 && (problem.rows < kScratchRows || problem.k_dim > kScratchMaxK)) {
    const int64_t units = 8 * std::max<int64_t>(1, pool.num_threads());
    const int64_t chunk = (problem.n_dim + units - 1) / units;
    parallel_units(pool, (problem.n_dim + chunk - 1) / chunk, [&problem, chunk](int64_t c) {
      const int64_t n0 = c * chunk, n1 = std::min(problem.n_dim, n0 + chunk);
      const int bits = problem.w.bits;
      (bits == 4 ? decoded_outputs<4> : bits == 8 ? decoded_outputs<8> : decoded_outputs<16>)(problem, n0, n1);
    });
    return;
  }
#endif
  if (problem.rows == 1)
    run<1, kRowOutputs>(pool, problem);
  else if (kAvx512 && problem.rows <= kFewRows)
    run<kFewRows, kFewOutputs>(pool, problem);
  else if (kAvx512 && problem.rows >= kMidFirst && problem.rows <= kMidLast)
    run<kMidTile, kMidOutputs>(pool, problem);
  else
    run<kRows, kOutputs>(pool, problem);
}

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != xd[1])
    return ffi::Error::InvalidArgument("rows_matmul: x must be [R, K] and w [L, N, K]");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= wd[0]) return ffi::Error::InvalidArgument("rows_matmul: layer index out of range");
  Weights weights;
  weights.f32 = w.typed_data() + index * wd[1] * wd[2];
  dispatch(pool, Problem{x.typed_data(), weights, y->typed_data(), xd[0], xd[1], wd[1]});
  return ffi::Error::Success();
}

// x @ w.T for GGUF-block weights: codes [L, N, K/2] (bits 4) or [L, N, K] (bits 8, int8 as uint8),
// scale and offset [L, N, K/32] (offset unused at bits 8).
ffi::Error RowsMatmulBlocks(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> layer,
                            ffi::ResultBuffer<ffi::F32> y, int32_t bits, int32_t tiled) {
  auto xd = x.dimensions();
  auto cd = codes.dimensions();
  auto sd = scale.dimensions();
  const int64_t k_dim = xd.size() == 2 ? xd[1] : 0;
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("rows_matmul_blocks: bits must be 4 or 8");
  if (xd.size() != 2 || k_dim % 32 || cd.size() != 3 || cd[2] * (8 / bits) != k_dim || sd.size() != 3 ||
      sd[0] != cd[0] || sd[1] != cd[1] || sd[2] * 32 != k_dim ||
      (bits == 4 && offset.dimensions().size() != 3) || (bits == 4 && offset.element_count() != scale.element_count()))
    return ffi::Error::InvalidArgument(
        "rows_matmul_blocks: x must be [R, K] (K % 32 == 0), codes [L, N, K*bits/8], scale and offset [L, N, K/32]");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= cd[0]) return ffi::Error::InvalidArgument("rows_matmul_blocks: layer index out of range");
  Weights weights;
  weights.bits = bits;
  weights.codes = codes.typed_data() + index * cd[1] * cd[2];
  weights.scale = scale.typed_data() + index * sd[1] * sd[2];
  weights.offset = bits == 4 ? offset.typed_data() + index * sd[1] * sd[2] : nullptr;
  const Problem problem{x.typed_data(), weights, y->typed_data(), xd[0], k_dim, cd[1]};
  if (tiled) {  // Q4_1 in tile order: only the AMX products read it
    if (bits != 4 || cd[1] % 16 || xd[0] > 64 || !amx_products())
      return ffi::Error::InvalidArgument("rows_matmul_blocks: tiled Q4_1 needs AMX, N % 16 == 0 and at most 64 rows");
#ifdef SGL_DFLASH_AMX_PRODUCTS
    amx_q4::run(pool, problem, tiled == 2 || (tiled == 1 && xd[0] > AMX_EMULATED_ROWS));
#endif
    return ffi::Error::Success();
  }
  dispatch(pool, problem);
  return ffi::Error::Success();
}

// x @ w.T for bfloat16 weights w [L, N, K] (K % 32 == 0), read as their exact float32 values.
// XLA hands the bfloat16 buffer over as it is (a bitcast to bytes in the program was a copy).
ffi::Error RowsMatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int32_t tiles) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != xd[1] || xd[1] % 32)
    return ffi::Error::InvalidArgument("rows_matmul_bf16: x must be [R, K] and w [L, N, K], K % 32 == 0");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= wd[0]) return ffi::Error::InvalidArgument("rows_matmul_bf16: layer index out of range");
  Weights weights;
  weights.bits = 16;
  weights.codes = reinterpret_cast<const uint8_t*>(w.typed_data()) + index * wd[1] * wd[2] * 2;
  const Problem problem{x.typed_data(), weights, y->typed_data(), xd[0], xd[1], wd[1]};
  if (tiles) {  // on AMX tiles: float32-accurate, not the FMA kernel's bits
    if (wd[1] % 16 || xd[0] > 64 || !amx_products())
      return ffi::Error::InvalidArgument("rows_matmul_bf16: tiles need AMX, N % 16 == 0 and at most 64 rows");
#ifdef SGL_DFLASH_AMX_PRODUCTS
    amx_bf16::run(pool, problem);
#endif
    return ffi::Error::Success();
  }
  dispatch(pool, problem);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgl_dflash_rows_matmul_blocks, RowsMatmulBlocks,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("tiled"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgl_dflash_rows_matmul_bf16, RowsMatmulBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("tiles"));

// 1 where this process runs Q4_1 products in tile order on AMX (`blocks.TiledQ4`).
extern "C" int sgl_dflash_amx_products() { return amx_products() ? 1 : 0; }
