// The greedy token of each row, argmax_v (x @ w.T)[r, v], as the float32 kernels compute the
// logits (`rows_matmul`: lane j sums k = j, j + 16, .. in order, the lanes folded pairwise), without
// computing most of them exactly.
//
// The lm_head is a fifth of a decode step's products (SmolLM2: 49,152 x 576 against ~106M weights
// in the layers) and at 32 rows ~9.7 ms of a ~63 ms step on two cores, bound by float32 FMAs. A
// greedy step needs only each row's argmax. So:
//   1. approximate logits a_v = bf16(w_v) . bf16(x) on AMX tiles (16x the FMA rate: the head is then
//      bound by reading its bfloat16 copy), and with them an upper bound b_v on |logit_v - a_v|:
//      rounding x and w to bfloat16 (unit roundoff u = 2^-8) moves a product by at most
//      u (2 + u) |w_i| |x_i|, and sum_i |w_i| |x_i| <= max_i |w_i| * ||x||_1, with slack for
//      float32 accumulation in both (a bound per block of 32 kept ~4x fewer candidates but cost
//      a second tile product and store per group: more than the candidates' exact logits);
//   2. every v whose a_v + b_v reaches the largest a_u - b_u is a candidate; the others are
//      strictly below that u's exact logit, so the argmax is a candidate;
//   3. the candidates' logits exactly as `rows_matmul` computes them (the same lanes, order and
//      fold: the same bits), the largest, the lowest index among equals (jnp.argmax's tie rule).
// On SmolLM2's rows a median of ~20 candidates remains. A row with a non-finite input, approximation
// or bound takes every logit exactly (NaN first, as jnp.argmax).
//
// Inputs: x [R, K] f32, w [V, K] f32 (the exact weights), packed [V/16, K/32, 512] u16 (bf16(w) as
// AMX B tiles: tile (g, c) row i, column n holds the pair w[16g + n, 32c + 2i + {0, 1}]),
// row_max [V] f32 (max_i |w[v, i]|). Output tokens [R] s32. Attribute `amx`: 0 computes step 1 with
// plain float code instead (same values up to accumulation order: for CPUs without AMX and tests).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "common.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kGroup = 16;    // outputs per tile column block
constexpr int kChunk = 32;    // K per tile (16 pairs of bfloat16)
constexpr int kTile = 512;    // bfloat16 per tile
constexpr int kMaxRows = 64;  // rows per call (four row tiles)

inline uint16_t bf16_nearest(float f) {  // round to nearest even (finite f)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

inline float bf16_value(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
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

// The rows as AMX A tiles, x̂ [M, K] bf16 (M = R rounded up to 16, zero rows), and each row's bound
// factor eps * ||x||_1.
struct Rows {
  int64_t rows, padded, k_dim;
  std::vector<uint16_t> xh;
  std::vector<float> scale;
  std::vector<bool> finite;

  Rows(const float* x, int64_t r, int64_t k)
      : rows(r), padded((r + kGroup - 1) / kGroup * kGroup), k_dim(k), xh(padded * k, 0), scale(r, 0), finite(r, true) {
    // u(2 + u) for the roundings, with slack for 2K float32 roundings (the tile sums, the exact
    // sums) and the bound's own few.
    const double eps = (std::ldexp(1.0, -7) + std::ldexp(1.0, -16)) * (1 + 1.0 / 32) + 2.0 * k * std::ldexp(1.0, -24);
    for (int64_t i = 0; i < r; ++i) {
      const float* xi = x + i * k;
      double l1 = 0;
      for (int64_t j = 0; j < k; ++j) finite[i] = finite[i] && std::isfinite(xi[j]), l1 += std::fabs(double(xi[j]));
      scale[i] = float(l1 * eps * (1 + 1e-6));
      finite[i] = finite[i] && std::isfinite(scale[i]);
      if (!finite[i]) continue;
      for (int64_t j = 0; j < k; ++j) xh[i * k + j] = bf16_nearest(xi[j]);
    }
  }
};

// Step 1 for one group of 16 outputs without tiles: approx [padded, 16] f32.
void approx_plain(const Rows& rows, const uint16_t* packed, float* approx) {
  const int64_t chunks = rows.k_dim / kChunk;
  for (int64_t r = 0; r < rows.rows; ++r)
    for (int n = 0; n < kGroup; ++n) {
      float a = 0;
      for (int64_t c = 0; c < chunks; ++c)
        for (int k = 0; k < kChunk; ++k)
          a += bf16_value(rows.xh[r * rows.k_dim + c * kChunk + k]) * bf16_value(packed[c * kTile + k / 2 * 32 + n * 2 + k % 2]);
      approx[r * kGroup + n] = a;
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool kHasAmx = true;

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t tile_rows[16] = {};
};

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.tile_rows[t] = 16;
  _tile_loadconfig(&config);
}

// How many groups of weight tiles ahead a chunk's prefetch asks for (into L2): tile loads leave the
// hardware prefetcher idle (one thread streamed 6.6 GB/s without; 1, 2, 4 and 8 were within noise).
constexpr int64_t kAhead = 2;

// Tile instructions on tile numbers that are template arguments (GCC's _tile_* macros paste their
// argument's spelling into the instruction).
template <int T>
inline void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int C, int A, int B>  // C += A . B
inline void tile_dpbf16ps() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// One chunk's products on MT x NG accumulator tiles (rows tile m, outputs group g: tile m * NG + g),
// NG weight tiles after them and the row tiles in what is left. Four accumulators at once: a tile
// product's latency is ~3x its issue interval, and with one accumulator per row tile the chain of
// chunks waited on it (one thread, weights in cache: 1.66 ms for the head at 32 rows).
template <int MT, int NG, int I = 0>
inline void chunk_products(const uint16_t* a, int64_t a_stride, const uint16_t* b, int64_t b_step) {
  if constexpr (I < MT * NG) {
    constexpr int m = I / NG, g = I % NG;
    constexpr int c_tile = I, b_tile = MT * NG + g, a_tile = MT * NG + NG + m % (8 - MT * NG - NG);
    if constexpr (m == 0) tile_load<b_tile>(b + g * b_step, 64);
    if constexpr (g == 0) tile_load<a_tile>(a + m * kGroup * a_stride / 2, a_stride);
    tile_dpbf16ps<c_tile, a_tile, b_tile>();
    chunk_products<MT, NG, I + 1>(a, a_stride, b, b_step);
  }
}

template <int MT, int NG, int I = 0>
inline void zero_tiles() {
  if constexpr (I < MT * NG) {
    tile_zero<I>();
    zero_tiles<MT, NG, I + 1>();
  }
}

// Tile (m, g) to out + g * kMaxRows * 16 + m * 256: each group's [rows, 16] block.
template <int MT, int NG, int I = 0>
inline void store_tiles(float* out) {
  if constexpr (I < MT * NG) {
    tile_store<I>(out + (I % NG) * kMaxRows * kGroup + (I / NG) * kGroup * kGroup, 64);
    store_tiles<MT, NG, I + 1>(out);
  }
}

// Step 1 for NG groups of outputs from `packed` (their first group's tiles).
template <int MT, int NG>
void approx_tiles(const Rows& rows, const uint16_t* packed, float* approx) {
  const int64_t chunks = rows.k_dim / kChunk, stride = rows.k_dim * 2;
  zero_tiles<MT, NG>();
  for (int64_t c = 0; c < chunks; ++c) {
    for (int g = 0; g < NG; ++g)  // (past the last group a prefetch does nothing)
      for (int line = 0; line < kTile * 2 / 64; ++line)
        __builtin_prefetch(packed + ((kAhead * NG + g) * chunks + c) * kTile + line * 32, 0, 2);
    chunk_products<MT, NG>(rows.xh.data() + c * kChunk, stride, packed + c * kTile, chunks * kTile);
  }
  store_tiles<MT, NG>(approx);
}

// Groups [g0, g1) of step 1, `keep` called with each group's approx block. Per row tiles: 1 -> 3
// groups at once, 2 -> 2, 3 and 4 -> 1.
template <int MT, class Keep>
void approx_groups(const Rows& rows, const uint16_t* packed, int64_t g0, int64_t g1, float* approx, Keep keep) {
  constexpr int NG = MT == 1 ? 3 : MT == 2 ? 2 : 1;
  const int64_t chunks = rows.k_dim / kChunk;
  int64_t g = g0;
  for (; g + NG <= g1; g += NG) {
    approx_tiles<MT, NG>(rows, packed + g * chunks * kTile, approx);
    for (int i = 0; i < NG; ++i) keep(g + i, approx + i * kMaxRows * kGroup);
  }
  for (; g < g1; ++g) {
    approx_tiles<MT, 1>(rows, packed + g * chunks * kTile, approx);
    keep(g, approx);
  }
}

template <class Keep>
void approx_amx(const Rows& rows, const uint16_t* packed, int64_t g0, int64_t g1, float* approx, Keep keep) {
  switch (rows.padded / kGroup) {
    case 1: return approx_groups<1>(rows, packed, g0, g1, approx, keep);
    case 2: return approx_groups<2>(rows, packed, g0, g1, approx, keep);
    case 3: return approx_groups<3>(rows, packed, g0, g1, approx, keep);
    default: return approx_groups<4>(rows, packed, g0, g1, approx, keep);
  }
}
#else
constexpr bool kHasAmx = false;
#endif

// Whether this process may run AMX tiles: built with them, and Linux grants the tile state.
bool amx_ready() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ready = [] {
    if (!kHasAmx) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

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
                      ffi::Buffer<ffi::U16> packed, ffi::Buffer<ffi::F32> row_max,
                      ffi::ResultBuffer<ffi::S32> tokens, int32_t amx) {
  auto xd = x.dimensions(), wd = w.dimensions(), pd = packed.dimensions(), md = row_max.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || xd[0] > kMaxRows || wd[1] % kChunk || wd[0] % kGroup)
    return ffi::Error::InvalidArgument("greedy_head: x must be [R <= 64, K] and w [V, K], K % 32 == 0, V % 16 == 0");
  const int64_t rows = xd[0], k_dim = xd[1], vocab = wd[0], groups = vocab / kGroup;
  if (pd.size() != 3 || pd[0] != groups || pd[1] != k_dim / kChunk || pd[2] != kTile || md.size() != 1 || md[0] != vocab)
    return ffi::Error::InvalidArgument("greedy_head: packed must be [V/16, K/32, 512] and row_max [V]");
  const bool tiles = amx && amx_ready();
  const float *wp = w.typed_data(), *mp = row_max.typed_data();
  const uint16_t* pp = packed.typed_data();
  const Rows prepared(x.typed_data(), rows, k_dim);

  constexpr int64_t kGroupsPerUnit = 64;
  const int64_t units = (groups + kGroupsPerUnit - 1) / kGroupsPerUnit;
  std::vector<std::vector<RowState>> states(units, std::vector<RowState>(rows));
  std::vector<Threshold> thresholds(rows);
  parallel_units(pool, units, [&, tiles](int64_t u) {
    alignas(64) float approx[3 * kMaxRows * kGroup];
    const int64_t g0 = u * kGroupsPerUnit, g1 = std::min(groups, g0 + kGroupsPerUnit);
    auto keep = [&](int64_t g, const float* a) {
      const v16 row_max = load(mp + g * kGroup);
      for (int64_t r = 0; r < rows; ++r)  // slack: tiles flush denormals to zero
        keep_candidates(states[u][r], thresholds[r], load(a + r * kGroup), row_max * prepared.scale[r] + 1e-28f,
                        g * kGroup);
    };
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles) {
      configure_tiles();
      approx_amx(prepared, pp, g0, g1, approx, keep);
      _tile_release();
      return;
    }
#endif
    for (int64_t g = g0; g < g1; ++g) {
      approx_plain(prepared, pp + g * k_dim / kChunk * kTile, approx);
      keep(g, approx);
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

// 1 where this process runs the greedy head's AMX tiles (`amx` = 1 uses them).
extern "C" int sgl_dflash_greedy_head_amx() { return amx_ready() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgl_dflash_greedy_head, GreedyHead,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("amx"));
