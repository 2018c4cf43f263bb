// The greedy token of each row, argmax_v (x @ w.T)[r, v], as the float32 kernels compute the
// logits (`rows_matmul`: lane j sums k = j, j + 16, .. in order, the lanes folded pairwise), without
// computing most of them exactly.
//
// The lm_head is a fifth of a decode step's products (SmolLM2: 49,152 x 576 against ~106M weights
// in the layers), bound by float32 FMAs past a few rows. A greedy step needs only each row's
// argmax. So:
//   1. approximate logits a_v = D_v (s_hi hi . q_v + s_lo lo . q_v) from exact int32 sums on AMX
//      int8 tiles (32x the float32 FMA rate: the head is then bound by reading its int8 copy, as
//      many bytes as its GGUF Q8_0 blocks): w_v ~ D_v q_v (q_v int8, D_v = max|w_v| / 127, one scale
//      per output) and x ~ s_hi hi + s_lo lo (see Rows), with an upper bound b_v on |logit_v - a_v|:
//      E_v ||x||_1 (E_v = max_i |w_vi - D_v q_vi|, measured when packing) plus max|w_v| times the
//      parts' error and the float32 roundings of the logit and of a_v;
//   2. every v whose a_v + b_v reaches the largest a_u - b_u is a candidate; the others are
//      strictly below that u's exact logit, so the argmax is a candidate;
//   3. the candidates' logits exactly as `rows_matmul` computes them (the same lanes, order and
//      fold: the same bits), the largest, the lowest index among equals (jnp.argmax's tie rule).
// On SmolLM2's final hidden rows a median of ~4 candidates remains (bfloat16 tiles of both, the
// section-51 kernel, kept ~15 from twice the bytes). A row with a non-finite input, approximation or
// bound takes every logit exactly (NaN first, as jnp.argmax).
//
// Inputs: x [R, K] f32, w [V, K] f32 (the exact weights), packed [V/16, K/64, 1024] s8 (q as AMX
// B tiles: tile (g, c) row i, bytes 4n .. 4n + 3 hold q[16g + n, 64c + 4i .. 64c + 4i + 3]),
// scale, row_max, row_err [V] f32 (D_v, max_i |w_vi|, E_v). Output tokens [R] s32. Attribute `sums`,
// how step 1's int32 sums are computed (the same sums each way): 2 on AMX tiles where this process
// runs them, else as 1; 1 with AVX-512 VNNI where built with it, else as 0; 0 with plain code.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kGroup = 16;    // outputs per tile column block
constexpr int kChunk = 64;    // K per tile (16 groups of 4 int8)
constexpr int kTile = 1024;   // int8 per tile
constexpr int kMaxRows = 64;  // rows per call (four row tiles)
constexpr int kMaxGroups = 2; // output groups per pass

typedef int32_t i16v __attribute__((vector_size(64), aligned(4)));

inline v16 load_sums(const int32_t* p) {
  i16v v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, v16);
}

// x . w as `rows_matmul` sums it (`accumulate` with one row and one output, then lane_sums).
float exact_logit(const float* x, const float* w, int64_t k_dim) {
  vn acc[kParts];
  for (int p = 0; p < kParts; ++p) acc[p] = vn{};
  const int64_t k16 = k_dim & ~int64_t{15};
  for (int64_t k = 0; k < k16; k += 16)
    for (int p = 0; p < kParts; ++p) {
      const vn xv = load_n(x + k + p * kLanes);
      acc[p] += xv * load_n(w + k + p * kLanes);
    }
  if (k16 < k_dim) {
    float wt[16] = {}, xt[16] = {};
    std::memcpy(wt, w + k16, (k_dim - k16) * sizeof(float));
    std::memcpy(xt, x + k16, (k_dim - k16) * sizeof(float));
    for (int p = 0; p < kParts; ++p) acc[p] += load_n(xt + p * kLanes) * load_n(wt + p * kLanes);
  }
  float sum;
  lane_sums<1>(acc, &sum);
  return sum;
}

// The rows as two int8 parts, x ~ s_hi * hi + s_lo * lo (hi, lo in [-127, 127]; s_lo = s_hi / 254:
// ~16 bits per element against the row's largest; one int8 part per row kept every output a
// candidate: final hidden rows have outlier channels ~30x their mean), laid out as AMX A tiles
// [M, K] (M = R rounded up to 16, zero rows), and each row's bound factors:
//   |logit_v - a_v| <= E_v * l1 + M_v * extra, with
//   l1 = ||x||_1, extra = sum_i |x_i - s_hi hi_i - s_lo lo_i| (the parts' error, exact in double)
//        + K 2^-24 l1 (the float32 logit's own roundings) + 4 2^-24 sum_i (s_hi |hi_i| + s_lo |lo_i|)
//        (the approximation's three float roundings), each with a little slack.
struct Rows {
  int64_t rows, padded, k_dim;
  std::vector<int8_t> hi, lo;
  std::vector<float> s_hi, s_lo, l1, extra;
  std::vector<bool> finite;

  Rows(const float* x, int64_t r, int64_t k)
      : rows(r), padded((r + kGroup - 1) / kGroup * kGroup), k_dim(k), hi(padded * k, 0), lo(padded * k, 0),
        s_hi(r, 0), s_lo(r, 0), l1(r, 0), extra(r, 0), finite(r, true) {
    const double u = std::ldexp(1.0, -24);
    for (int64_t i = 0; i < r; ++i) {
      const float* xi = x + i * k;
      double norm = 0, largest = 0;
      for (int64_t j = 0; j < k; ++j) {
        finite[i] = finite[i] && std::isfinite(xi[j]);
        norm += std::fabs(double(xi[j])), largest = std::max(largest, std::fabs(double(xi[j])));
      }
      if (!finite[i] || !std::isfinite(float(norm))) {
        finite[i] = false;
        continue;
      }
      const float sh = float(largest / 127), sl = sh / 254;
      double error = 0, parts = 0;
      for (int64_t j = 0; j < k && sh > 0; ++j) {
        const double a = std::clamp(std::nearbyint(xi[j] / double(sh)), -127.0, 127.0);
        const double rest = xi[j] - a * sh;  // exact: a * sh has 31 bits
        const double b = std::clamp(std::nearbyint(rest / sl), -127.0, 127.0);
        hi[i * k + j] = int8_t(a), lo[i * k + j] = int8_t(b);
        error += std::fabs(rest - b * sl), parts += std::fabs(a) * sh + std::fabs(b) * sl;
      }
      s_hi[i] = sh, s_lo[i] = sl;
      l1[i] = float(norm * (1 + 1e-6));
      extra[i] = float((error + k * u * 1.01 * norm + 4 * u * parts) * (1 + 1e-5));
    }
  }
};

// One group's approximations, [rows, 16] from the int32 sums of both parts: D_v (s_hi c_hi + s_lo c_lo).
inline v16 approx_of(const Rows& rows, int64_t r, const int32_t* c_hi, const int32_t* c_lo, v16 scale) {
  const v16 t = load_sums(c_hi) * rows.s_hi[r] + load_sums(c_lo) * rows.s_lo[r];
  return t * scale;
}

// Step 1 for one group of 16 outputs without tiles: the exact int32 sums [padded, 16] of each part.
void sums_plain(const Rows& rows, const int8_t* packed, int32_t* c_hi, int32_t* c_lo) {
  const int64_t chunks = rows.k_dim / kChunk;
  for (int64_t r = 0; r < rows.rows; ++r)
    for (int n = 0; n < kGroup; ++n) {
      int32_t h = 0, l = 0;
      for (int64_t c = 0; c < chunks; ++c)
        for (int k = 0; k < kChunk; ++k) {
          const int32_t w = packed[c * kTile + k / 4 * 64 + n * 4 + k % 4];
          h += rows.hi[r * rows.k_dim + c * kChunk + k] * w, l += rows.lo[r * rows.k_dim + c * kChunk + k] * w;
        }
      c_hi[r * kGroup + n] = h, c_lo[r * kGroup + n] = l;
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
constexpr bool kHasAmx = true;

// How many groups of weight tiles ahead a chunk's prefetch asks for (into L2): tile loads leave the
// hardware prefetcher idle (one thread streamed 6.6 GB/s without; 1, 2, 4 and 8 were within noise).
constexpr int64_t kAhead = 2;

template <int C, int A, int B>  // C += A . B, signed int8 (tile helpers: common.h)
inline void tile_dpbssd() {
  asm volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// One chunk's products on MT x NG x 2 accumulator tiles (rows tile m, outputs group g, part p: tile
// (m * NG + g) * 2 + p), NG weight tiles after them and the row tiles in what is left. Four
// accumulators at once: a tile product's latency is ~3x its issue interval, and with one accumulator
// the chain of chunks waited on it.
template <int MT, int NG, int I = 0>
inline void chunk_products(const int8_t* hi, const int8_t* lo, int64_t a_stride, const int8_t* b, int64_t b_step) {
  if constexpr (I < MT * NG * 2) {
    constexpr int m = I / (NG * 2), g = I / 2 % NG, p = I % 2;
    constexpr int c_tile = I, b_tile = MT * NG * 2 + g;
    constexpr int a_tile = MT * NG * 2 + NG + (m * 2 + p) % (8 - MT * NG * 2 - NG);
    if constexpr (m == 0 && p == 0) tile_load<b_tile>(b + g * b_step, 64);
    if constexpr (g == 0) tile_load<a_tile>((p ? lo : hi) + m * kGroup * a_stride, a_stride);
    tile_dpbssd<c_tile, a_tile, b_tile>();
    chunk_products<MT, NG, I + 1>(hi, lo, a_stride, b, b_step);
  }
}

template <int N, int I = 0>
inline void zero_tiles() {
  if constexpr (I < N) {
    tile_zero<I>();
    zero_tiles<N, I + 1>();
  }
}

// Tile (m, g, p) to sums + p * kMaxGroups * kMaxRows * 16 + g * kMaxRows * 16 + (m0 + m) * 256: each
// part's and group's [rows, 16] block.
template <int MT, int NG, int I = 0>
inline void store_tiles(int32_t* sums, int m0) {
  if constexpr (I < MT * NG * 2) {
    constexpr int m = I / (NG * 2), g = I / 2 % NG, p = I % 2;
    tile_store<I>(sums + (p * kMaxGroups + g) * kMaxRows * kGroup + (m0 + m) * kGroup * kGroup, 64);
    store_tiles<MT, NG, I + 1>(sums, m0);
  }
}

// Step 1 for row tiles [m0, m0 + MT) and NG groups of outputs from `packed` (their first group's
// tiles); `ahead` asks for the next groups' tiles.
template <int MT, int NG>
void sum_tiles(const Rows& rows, const int8_t* packed, int m0, bool ahead, int32_t* sums) {
  const int64_t chunks = rows.k_dim / kChunk, stride = rows.k_dim;
  const int8_t *hi = rows.hi.data() + m0 * kGroup * stride, *lo = rows.lo.data() + m0 * kGroup * stride;
  zero_tiles<MT * NG * 2>();
  for (int64_t c = 0; c < chunks; ++c) {
    if (ahead)
      for (int g = 0; g < NG; ++g)  // (past the last group a prefetch does nothing)
        for (int line = 0; line < kTile / 64; ++line)
          __builtin_prefetch(packed + ((kAhead * NG + g) * chunks + c) * kTile + line * 64, 0, 2);
    chunk_products<MT, NG>(hi + c * kChunk, lo + c * kChunk, stride, packed + c * kTile, chunks * kTile);
  }
  store_tiles<MT, NG>(sums, m0);
}

// Groups [g0, g1) of step 1, `keep` called with each group's sums of both parts. One row tile: 2
// groups at once; more: a group at a time, its row tiles two by two (the group's weight tiles then
// come from L1).
template <class Keep>
void sums_amx(const Rows& rows, const int8_t* packed, int64_t g0, int64_t g1, int32_t* sums, Keep keep) {
  const int64_t chunks = rows.k_dim / kChunk, part = kMaxGroups * kMaxRows * kGroup;
  const int row_tiles = int(rows.padded / kGroup);
  int64_t g = g0;
  if (row_tiles == 1)
    for (; g + 2 <= g1; g += 2) {
      sum_tiles<1, 2>(rows, packed + g * chunks * kTile, 0, true, sums);
      for (int i = 0; i < 2; ++i) keep(g + i, sums + i * kMaxRows * kGroup, sums + part + i * kMaxRows * kGroup);
    }
  for (; g < g1; ++g) {
    const int8_t* group = packed + g * chunks * kTile;
    int m = 0;
    for (; m + 2 <= row_tiles; m += 2) sum_tiles<2, 1>(rows, group, m, m == 0, sums);
    if (m < row_tiles) sum_tiles<1, 1>(rows, group, m, m == 0, sums);
    keep(g, sums, sums + part);
  }
}
#else
constexpr bool kHasAmx = false;
#endif

// Whether this process may run AMX tiles: built with them, and Linux grants the tile state.
bool amx_ready() { return kHasAmx && amx_permission(); }

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
constexpr bool kHasVnni = true;

// Step 1 with AVX-512 VNNI (no AMX: AMD Zen 4, Intel Ice Lake on): vpdpbusd multiplies unsigned by
// signed bytes, four at a time, into int32 lanes. A weight tile's 64-byte row is one register: 16
// outputs x the same 4 k, so each k quad of a row part is broadcast against it. The parts are
// biased to unsigned (u = p + 128), and 128 * sum_k q[n, k] is taken off after: the same exact int32
// sums as the tiles' (at most 255 * 127 * K in a lane: no overflow below K = 66,000).
struct BiasedRows {
  int64_t quads;               // K / 4 words per row
  std::vector<int32_t> words;  // [2][rows][quads]: part p of row r, k quad j as four u8, little-endian

  BiasedRows(const Rows& rows, bool build) : quads(rows.k_dim / 4), words(build ? 2 * rows.rows * quads : 0) {
    for (int p = 0; p < 2 && build; ++p) {
      const int8_t* part = (p ? rows.lo : rows.hi).data();
      uint8_t* out = reinterpret_cast<uint8_t*>(words.data() + p * rows.rows * quads);
      for (int64_t i = 0; i < rows.rows * rows.k_dim; ++i) out[i] = uint8_t(part[i]) ^ 0x80;  // p + 128
    }
  }
};

// RB rows' sums of both parts for one group (its tiles' rows are `quads` 64-byte rows in k order).
template <int RB>
inline void vnni_rows(const int32_t* hi, const int32_t* lo, int64_t quads, const int8_t* group, __m512i bias,
                      int32_t* c_hi, int32_t* c_lo) {
  __m512i h[RB], l[RB];
  for (int r = 0; r < RB; ++r) h[r] = l[r] = _mm512_setzero_si512();
  for (int64_t j = 0; j < quads; ++j) {
    const __m512i w = _mm512_loadu_si512(group + j * 64);
    for (int r = 0; r < RB; ++r) {
      h[r] = _mm512_dpbusd_epi32(h[r], _mm512_set1_epi32(hi[r * quads + j]), w);
      l[r] = _mm512_dpbusd_epi32(l[r], _mm512_set1_epi32(lo[r * quads + j]), w);
    }
  }
  for (int r = 0; r < RB; ++r) {
    _mm512_storeu_si512(c_hi + r * kGroup, _mm512_sub_epi32(h[r], bias));
    _mm512_storeu_si512(c_lo + r * kGroup, _mm512_sub_epi32(l[r], bias));
  }
}

// Step 1 for one group of 16 outputs: the exact int32 sums [rows, 16] of each part, eight rows at a
// time (the group's 9 KB of weights come from L1 after the first eight).
void sums_vnni(const BiasedRows& biased, int64_t rows, const int8_t* group, int32_t* c_hi, int32_t* c_lo) {
  const int64_t quads = biased.quads;
  __m512i column = _mm512_setzero_si512();  // sum_k q[n, k]
  for (int64_t j = 0; j < quads; ++j)
    column = _mm512_dpbusd_epi32(column, _mm512_set1_epi32(0x01010101), _mm512_loadu_si512(group + j * 64));
  const __m512i bias = _mm512_slli_epi32(column, 7);
  const int32_t *hi = biased.words.data(), *lo = hi + rows * quads;
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8)
    vnni_rows<8>(hi + r * quads, lo + r * quads, quads, group, bias, c_hi + r * kGroup, c_lo + r * kGroup);
  const int64_t left = rows - r;
  auto rest = [&](auto rb) {
    vnni_rows<decltype(rb)::value>(hi + r * quads, lo + r * quads, quads, group, bias, c_hi + r * kGroup, c_lo + r * kGroup);
  };
  switch (left) {
    case 1: rest(std::integral_constant<int, 1>{}); break;
    case 2: rest(std::integral_constant<int, 2>{}); break;
    case 3: rest(std::integral_constant<int, 3>{}); break;
    case 4: rest(std::integral_constant<int, 4>{}); break;
    case 5: rest(std::integral_constant<int, 5>{}); break;
    case 6: rest(std::integral_constant<int, 6>{}); break;
    case 7: rest(std::integral_constant<int, 7>{}); break;
    default: break;
  }
}
#else
constexpr bool kHasVnni = false;
#endif

// A row's threshold shared by the units: at most the largest a - b any unit has seen (so at most the
// final one). With thresholds of their own, units whose outputs held no large logit kept ~330
// candidates per row each (half a million appends at 32 rows: most of the head's time).
struct Threshold {
  std::atomic<float> value{-std::numeric_limits<float>::infinity()};

  float raise(float seen) {  // the threshold after offering `seen`
    float now = value.load(std::memory_order_relaxed);
    while (seen > now && !value.compare_exchange_weak(now, seen, std::memory_order_relaxed)) {
    }
    return std::max(now, seen);
  }
};

// One unit's view of a row: its largest a - b, the sum of its a (non-finite where any a was), and
// its candidates (a + b reaching the threshold when seen: a superset of the final ones).
struct RowState {
  float lower = -std::numeric_limits<float>::infinity();
  v16 sums = v16{};
  std::vector<std::pair<int32_t, float>> candidates;  // (v, a + b)
};

inline float max_lane(v16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
#endif
}

// Bit n: upper[n] >= threshold.
inline uint32_t reaching(v16 upper, float threshold) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)upper, _mm512_set1_ps(threshold), _CMP_GE_OQ);
#else
  uint32_t bits = 0;
  for (int n = 0; n < 16; ++n) bits |= uint32_t(upper[n] >= threshold) << n;
  return bits;
#endif
}

// The 16 outputs from v0 of one row: a + b and a - b, the threshold raised, the candidates kept.
inline void keep_candidates(RowState& s, Threshold& shared, v16 a, v16 b, int64_t v0) {
  const v16 upper = a + b;
  s.sums += a;  // b is finite: row_max and the row's scale are
  const float lower = max_lane(a - b);
  s.lower = std::max(s.lower, lower);
  const float threshold = shared.raise(lower);
  for (uint32_t reach = reaching(upper, threshold); reach; reach &= reach - 1) {
    const int n = __builtin_ctz(reach);
    s.candidates.emplace_back(int32_t(v0 + n), upper[n]);
  }
}

inline bool finite_lanes(v16 v) {
  for (int i = 0; i < 16; ++i)
    if (!std::isfinite(v[i])) return false;
  return true;
}

// jnp.argmax over every exact logit of row x: the first NaN, else the first maximum.
int32_t argmax_all(const float* x, const float* w, int64_t vocab, int64_t k_dim) {
  int32_t best = 0;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < vocab; ++v) {
    const float logit = exact_logit(x, w + v * k_dim, k_dim);
    if (std::isnan(logit)) return int32_t(v);
    if (logit > top || v == 0) top = logit, best = int32_t(v);
  }
  return best;
}

ffi::Error GreedyHead(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S8> packed, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> row_max,
                      ffi::Buffer<ffi::F32> row_err, ffi::ResultBuffer<ffi::S32> tokens, int32_t sums_by) {
  auto xd = x.dimensions(), wd = w.dimensions(), pd = packed.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || xd[0] > kMaxRows || wd[1] % kChunk || wd[0] % kGroup)
    return ffi::Error::InvalidArgument("greedy_head: x must be [R <= 64, K] and w [V, K], K % 64 == 0, V % 16 == 0");
  const int64_t rows = xd[0], k_dim = xd[1], vocab = wd[0], groups = vocab / kGroup;
  bool vectors = true;
  for (const auto* v : {&scale, &row_max, &row_err})
    vectors = vectors && v->dimensions().size() == 1 && v->dimensions()[0] == vocab;
  if (pd.size() != 3 || pd[0] != groups || pd[1] != k_dim / kChunk || pd[2] != kTile || !vectors)
    return ffi::Error::InvalidArgument("greedy_head: packed must be [V/16, K/64, 1024] and scale, row_max, row_err [V]");
  const bool tiles = sums_by >= 2 && amx_ready(), vnni = sums_by >= 1 && !tiles && kHasVnni;
  const float *wp = w.typed_data(), *dp = scale.typed_data(), *mp = row_max.typed_data(), *ep = row_err.typed_data();
  const int8_t* pp = packed.typed_data();
  const Rows prepared(x.typed_data(), rows, k_dim);

  constexpr int64_t kGroupsPerUnit = 64;
  const int64_t units = (groups + kGroupsPerUnit - 1) / kGroupsPerUnit;
  std::vector<std::vector<RowState>> states(units, std::vector<RowState>(rows));
  std::vector<Threshold> thresholds(rows);
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  const BiasedRows biased(prepared, vnni);
#endif
  parallel_units(pool, units, [&, tiles, vnni](int64_t u) {
    alignas(64) int32_t sums[2 * kMaxGroups * kMaxRows * kGroup];
    const int64_t g0 = u * kGroupsPerUnit, g1 = std::min(groups, g0 + kGroupsPerUnit);
    auto keep = [&](int64_t g, const int32_t* c_hi, const int32_t* c_lo) {
      const v16 d = load(dp + g * kGroup), m = load(mp + g * kGroup), e = load(ep + g * kGroup);
      for (int64_t r = 0; r < rows; ++r) {
        if (!prepared.finite[r]) continue;  // every logit exactly
        const v16 a = approx_of(prepared, r, c_hi + r * kGroup, c_lo + r * kGroup, d);
        const v16 b = e * prepared.l1[r] + m * prepared.extra[r] + 1e-28f;  // slack: denormals flushed
        keep_candidates(states[u][r], thresholds[r], a, b, g * kGroup);
      }
    };
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
    if (tiles) {
      configure_tiles();
      sums_amx(prepared, pp, g0, g1, sums, keep);
      _tile_release();
      return;
    }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    if (vnni) {
      for (int64_t g = g0; g < g1; ++g) {
        sums_vnni(biased, rows, pp + g * k_dim / kChunk * kTile, sums, sums + kMaxRows * kGroup);
        keep(g, sums, sums + kMaxRows * kGroup);
      }
      return;
    }
#endif
    for (int64_t g = g0; g < g1; ++g) {
      sums_plain(prepared, pp + g * k_dim / kChunk * kTile, sums, sums + kMaxRows * kGroup);
      keep(g, sums, sums + kMaxRows * kGroup);
    }
  });

  // Step 3, a row per unit over the pool (candidate rows are read from memory: ~0.7 us each alone).
  int32_t* out = tokens->typed_data();
  parallel_units(pool, rows, [&](int64_t r) {
    const float* xr = x.typed_data() + r * k_dim;
    float lower = -std::numeric_limits<float>::infinity();
    bool ok = prepared.finite[r];
    for (const auto& unit : states) lower = std::max(lower, unit[r].lower), ok = ok && finite_lanes(unit[r].sums);
    if (!ok) {
      out[r] = argmax_all(xr, wp, vocab, k_dim);
      return;
    }
    std::vector<int32_t> kept;
    for (const auto& unit : states)  // units in order: candidates by increasing v
      for (const auto& [v, upper] : unit[r].candidates)
        if (upper >= lower) kept.push_back(v);
    int32_t best = -1;
    float top = 0;
    for (size_t i = 0; i < kept.size(); ++i) {
      if (i + 1 < kept.size())  // the next candidate's weights, while this one's are summed
        for (int64_t line = 0; line < k_dim; line += 16) __builtin_prefetch(wp + kept[i + 1] * k_dim + line, 0, 3);
      const float logit = exact_logit(xr, wp + kept[i] * k_dim, k_dim);
      if (best < 0 || logit > top) best = kept[i], top = logit;
    }
    out[r] = best;
  });
  return ffi::Error::Success();
}

}  // namespace

// 1 where this process runs the greedy head's AMX tiles (`sums` = 2 uses them).
extern "C" int sgl_dflash_greedy_head_amx() { return amx_ready() ? 1 : 0; }

// 1 where the greedy head's sums can run with AVX-512 VNNI (`sums` >= 1 uses it without AMX).
extern "C" int sgl_dflash_greedy_head_vnni() { return kHasVnni ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgl_dflash_greedy_head, GreedyHead,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("sums"));
