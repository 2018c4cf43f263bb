// Prototype (not the repo's kernel): x [R, K] f32 times Q4_1-like weights (w = d_b q + m_b per block
// of 32) on AMX bf16 tiles: x as three bf16 parts (x1 + x2 + x3 == x exactly), the codes 0..15 as
// bf16 (exact), one fp32 tile sum per block, scaled per block by d and plus m * sum(x over block).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#include <algorithm>

struct TileConfig { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
template <int T> inline void tload(const void* p, int64_t s) { asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(s), "i"(T) : "memory"); }
template <int T> inline void tstore(void* p, int64_t s) { asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(s), "i"(T) : "memory"); }
template <int T> inline void tzero() { asm volatile("tilezero %%tmm%c0" ::"i"(T)); }
template <int C, int A, int B> inline void tdp() { asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B)); }

uint16_t bf16_trunc(float f) { uint32_t b; memcpy(&b, &f, 4); return b >> 16; }
float bf16_f(uint16_t h) { uint32_t b = uint32_t(h) << 16; float f; memcpy(&f, &b, 4); return f; }

constexpr int K = 576, NB = K / 32;
struct Weights { int n; std::vector<uint8_t> nib; std::vector<float> d, m; };  // nib [N/16][NB][16 rows][16 bytes]

// x parts: [3][Rp][K] bf16, xsum [R][NB]
void products(const Weights& w, const uint16_t* xp, const float* xsum, int R, int Rp, int g0, int g1, float* y) {
  TileConfig cfg; for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16; _tile_loadconfig(&cfg);
  alignas(64) uint16_t btile[512];
  alignas(64) float c[4][256];
  alignas(64) float acc[64][16];
  const __m512i table = _mm512_set_epi16(0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,
      0x4170,0x4160,0x4150,0x4140,0x4130,0x4120,0x4110,0x4100,0x40E0,0x40C0,0x40A0,0x4080,0x4040,0x4000,0x3F80,0x0000);
  const int64_t xs = int64_t(Rp) * K;
  const int tiles = Rp / 16;
  for (int g = g0; g < g1; ++g) {
    memset(acc, 0, sizeof(float) * 16 * R);
    for (int b = 0; b < NB; ++b) {
      const uint8_t* nb = w.nib.data() + (int64_t(g) * NB + b) * 256;
      __builtin_prefetch(nb + 256 * 4, 0, 2); __builtin_prefetch(nb + 256 * 4 + 64, 0, 2);
      __builtin_prefetch(nb + 256 * 4 + 128, 0, 2); __builtin_prefetch(nb + 256 * 4 + 192, 0, 2);
      for (int i = 0; i < 16; ++i) {
        const __m512i dw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(nb + i * 16)));
        const __m512i lo = _mm512_and_si512(dw, _mm512_set1_epi32(15));
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(dw, 4), _mm512_set1_epi32(15));
        const __m512i idx = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        _mm512_store_si512(btile + i * 32, _mm512_permutexvar_epi16(idx, table));
      }
      tload<0>(btile, 64);
      const float* dg = w.d.data() + (int64_t(g) * NB + b) * 16;
      const float* mg = w.m.data() + (int64_t(g) * NB + b) * 16;
      const __m512 dv = _mm512_loadu_ps(dg), mv = _mm512_loadu_ps(mg);
      for (int t = 0; t < tiles; t += 2) {
        const bool two = t + 1 < tiles;
        tzero<1>(); if (two) tzero<2>();
        const uint16_t* a = xp + int64_t(t) * 16 * K + b * 32;
        tload<3>(a, K * 2); tdp<1, 3, 0>();
        tload<4>(a + xs, K * 2); tdp<1, 4, 0>();
        tload<5>(a + 2 * xs, K * 2); tdp<1, 5, 0>();
        if (two) {
          tload<6>(a + 16 * K, K * 2); tdp<2, 6, 0>();
          tload<7>(a + 16 * K + xs, K * 2); tdp<2, 7, 0>();
          tload<3>(a + 16 * K + 2 * xs, K * 2); tdp<2, 3, 0>();
        }
        tstore<1>(c[0], 64); if (two) tstore<2>(c[1], 64);
        const int rows = std::min(R - t * 16, two ? 32 : 16);
        for (int r = 0; r < rows; ++r) {
          const float* cr = r < 16 ? c[0] + r * 16 : c[1] + (r - 16) * 16;
          const int rr = t * 16 + r;
          __m512 av = _mm512_load_ps(acc[rr]);
          av = _mm512_fmadd_ps(dv, _mm512_load_ps(cr), av);
          av = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[rr * NB + b]), av);
          _mm512_store_ps(acc[rr], av);
        }
      }
    }
    for (int r = 0; r < R; ++r) memcpy(y + int64_t(r) * w.n + g * 16, acc[r], 64);
  }
  _tile_release();
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("no AMX\n"); return 1; }
  const int N = argc > 1 ? atoi(argv[1]) : 3072, copies = 40;
  std::mt19937 rng(0); std::uniform_int_distribution<int> code(0, 15); std::normal_distribution<float> nd(0, 1);
  std::vector<Weights> ws(copies);
  for (auto& w : ws) {
    w.n = N; w.nib.resize(int64_t(N / 16) * NB * 256); w.d.resize(N * NB); w.m.resize(N * NB);
    for (auto& v : w.nib) v = uint8_t(code(rng) | code(rng) << 4);
    for (int i = 0; i < N * NB; ++i) w.d[i] = 0.01f * std::fabs(nd(rng)), w.m[i] = -8 * w.d[i];
  }
  for (int R : {1, 8, 16, 32, 64}) {
    const int Rp = (R + 15) / 16 * 16;
    std::vector<float> x(R * K); for (auto& v : x) v = nd(rng);
    std::vector<uint16_t> xp(3 * Rp * K, 0); std::vector<float> xsum(R * NB, 0);
    for (int r = 0; r < R; ++r) for (int k = 0; k < K; ++k) {
      float v = x[r * K + k]; uint16_t p1 = bf16_trunc(v); float r1 = v - bf16_f(p1); uint16_t p2 = bf16_trunc(r1);
      float r2 = r1 - bf16_f(p2); uint16_t p3 = bf16_trunc(r2);
      xp[r * K + k] = p1; xp[Rp * K + r * K + k] = p2; xp[2 * Rp * K + r * K + k] = p3;
      xsum[r * NB + k / 32] += v;
    }
    std::vector<float> y(R * N);
    auto run = [&](const Weights& w, int threads) {
      const int groups = N / 16;
      std::vector<std::thread> th;
      for (int t = 1; t < threads; ++t) th.emplace_back([&, t] { products(w, xp.data(), xsum.data(), R, Rp, groups * t / threads, groups * (t + 1) / threads, y.data()); });
      products(w, xp.data(), xsum.data(), R, Rp, 0, groups / threads, y.data());
      for (auto& h : th) h.join();
    };
    run(ws[0], 1);
    double err = 0;  // against a double reference
    for (int r = 0; r < R; ++r) for (int n = 0; n < N; n += 97) {
      double ref = 0, mag = 0;
      for (int k = 0; k < K; ++k) {
        const int g = n / 16, b = k / 32, i = (k % 32) / 2, lane = n % 16;
        const uint8_t byte = ws[0].nib[(int64_t(g) * NB + b) * 256 + i * 16 + lane];
        const int q = (k % 2) ? byte >> 4 : byte & 15;
        const double wv = double(ws[0].d[g * NB * 16 + b * 16 + lane]) * q + ws[0].m[g * NB * 16 + b * 16 + lane];
        ref += wv * x[r * K + k]; mag += std::fabs(wv * x[r * K + k]);
      }
      err = std::max(err, std::fabs(y[r * N + n] - ref) / mag);
    }
    for (int threads : {1, 2}) {
      std::vector<double> ts;
      for (int it = 0; it < 5 * copies; ++it) {
        auto t0 = std::chrono::steady_clock::now(); run(ws[it % copies], threads);
        ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(ts.begin(), ts.end());
      printf("N %d R %2d threads %d: %.3f ms (%.0f GFLOP/s), max err / sum|wx| %.2e\n", N, R, threads, ts[ts.size() / 2],
             2.0 * R * N * K / ts[ts.size() / 2] / 1e6, err);
    }
  }
}
