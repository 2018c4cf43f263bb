// What the CPU kernels share: 16-float vectors (AVX-512, or two AVX2 halves where the CPU has no
// AVX-512), a fixed-order horizontal sum of 16 accumulators at once, and the split of a kernel's
// work units over XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// Whether Linux grants this process AMX's tile state (asked once; the kernels' tile code also needs
// the build to have AMX: -march=native on a CPU with it).
inline bool amx_permission() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

#if defined(__AMX_TILE__)
#include <immintrin.h>

// AMX tile helpers shared by the kernels. `configure_tiles`: palette 1, tiles 0-7 each 64 bytes wide
// and `rows[t]` rows high (16 each by default).
inline void configure_tiles(const uint8_t* rows = nullptr) {
  struct {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t tile_rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.tile_rows[t] = rows ? rows[t] : 16;
  // As an asm reading `config` (not _tile_loadconfig): GCC dropped the builtin's colsb and rows
  // stores as dead in one caller (the few-rows Q4_1 products), and ldtilecfg faulted.
  asm volatile("ldtilecfg %0" ::"m"(config));
}

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
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// The register tiles' vectors: one machine register each. A tile's accumulators are arrays of
// these whose address is never taken, so they stay in registers. Held as v16 (two AVX2 registers
// each), GCC kept them in memory, and every product waited on a store-to-load forward: on an AVX2
// CPU (AMD EPYC) the matmul of 8 rows ran 3-8x slower than XLA's own dot (docs/performance.md
// section 31). kParts of them make 16 lanes; lane j of a 16-lane sum is the same sum either way.
#ifdef __AVX512F__
typedef float vn __attribute__((vector_size(64)));
constexpr bool kAvx512 = true;
#else
typedef float vn __attribute__((vector_size(32)));
constexpr bool kAvx512 = false;
#endif
constexpr int kLanes = sizeof(vn) / sizeof(float);
constexpr int kParts = 16 / kLanes;

inline vn load_n(const float* p) {
  vn v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_n(float* p, vn v) { std::memcpy(p, &v, sizeof(v)); }

// Two vectors' lanes folded one level: level 0 adds lane i and i + 8 of each, level 1 i and i + 4
// of each half's partial sums, and so on; after four levels 16 accumulators give their 16 sums in
// order, each summed by the same tree whichever accumulators share its vectors.
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

// The lane sums of acc[0..15], in order.
inline v16 sums16(const v16* acc) {
  v16 t[8], u[4], v[2];
  for (int i = 0; i < 8; ++i) t[i] = fold(acc[2 * i], acc[2 * i + 1], 0);
  for (int i = 0; i < 4; ++i) u[i] = fold(t[2 * i], t[2 * i + 1], 1);
  for (int i = 0; i < 2; ++i) v[i] = fold(u[2 * i], u[2 * i + 1], 2);
  return fold(v[0], v[1], 3);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define SGL_DFLASH_AVX2_HALVES 1  // AVX2 epilogue and tiles over one half of the lanes at a time

// sums16's tree for 8 outputs whose lanes 0-7 are lo[o] and 8-15 hi[o], with AVX2's in-lane
// shuffles: the same pairs added in the same order (i + 8, + 4, + 2, + 1), so the same bits, where
// GCC's generic 64-byte shuffles cost more than the tiles' products at K = 576 (docs/performance.md
// section 37).
inline __m256 sums8(const __m256* lo, const __m256* hi) {
  __m256 s[8], t[4];
  for (int o = 0; o < 8; ++o) s[o] = _mm256_add_ps(lo[o], hi[o]);  // lane i + lane i + 8
  for (int j = 0; j < 4; ++j)  // i + 4: outputs 2j and 2j + 1 side by side
    t[j] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * j], s[2 * j + 1], 0x20),
                         _mm256_permute2f128_ps(s[2 * j], s[2 * j + 1], 0x31));
  // i + 2, then i + 1; the 128-bit halves then hold outputs 0, 2, 4, 6 and 1, 3, 5, 7
  const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
  const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
  const __m256 v = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x88), _mm256_shuffle_ps(u0, u1, 0xDD));
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

// out[i] = the 16-lane sum of accumulator i < N, whose lanes are acc[i * kParts + part], folded by
// sums16's tree (whatever the vector width, the same bits).
template <int N>
inline void lane_sums(const vn* acc, float* out) {
#ifdef SGL_DFLASH_AVX2_HALVES
  for (int g = 0; g < N; g += 8) {
    __m256 lo[8], hi[8];
    for (int i = 0; i < 8; ++i) {
      lo[i] = g + i < N ? (__m256)acc[(g + i) * 2] : _mm256_setzero_ps();
      hi[i] = g + i < N ? (__m256)acc[(g + i) * 2 + 1] : _mm256_setzero_ps();
    }
    float s[8];
    _mm256_storeu_ps(s, sums8(lo, hi));
    for (int i = g; i < std::min(N, g + 8); ++i) out[i] = s[i - g];
  }
#else
  constexpr int kAcc = (N + 15) / 16 * 16;
  v16 all[kAcc] = {};
  for (int i = 0; i < N; ++i) std::memcpy(&all[i], &acc[i * kParts], sizeof(v16));
  float s[kAcc];
  for (int i = 0; i < kAcc; i += 16) store(s + i, sums16(all + i));
  std::memcpy(out, s, N * sizeof(float));
#endif
}

// body(u) for every unit u in [0, units), on the calling thread and up to num_threads - 1 helpers
// of XLA's pool, each with its own copy of `body` (its scratch); returns when every unit is done.
// The caller waits only for helpers that started: one that starts late finds no unit left and
// touches nothing (so `body` may refer to the caller's frame).
template <class Body>
void parallel_units(xla::ffi::ThreadPool& pool, int64_t units, Body body) {
  struct Progress {
    std::atomic<int64_t> next{0}, active{0};
  };
  auto progress = std::make_shared<Progress>();
  auto run = [progress, units, body]() mutable {
    for (int64_t u; (u = progress->next.fetch_add(1)) < units;) body(u);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), units) - 1;
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([progress, run]() mutable {
      progress->active.fetch_add(1);
      run();
      progress->active.fetch_sub(1);
    });
  run();
  while (progress->active.load() > 0) std::this_thread::yield();
}
