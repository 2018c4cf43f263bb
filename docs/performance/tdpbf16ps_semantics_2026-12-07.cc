// Which float32 arithmetic tdpbf16ps does for one output: compare the tile's C[0][0] with emulations.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <cstdlib>
#include <cfenv>
struct Cfg { uint8_t palette = 1, start = 0, r[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
float bf(uint16_t h) { uint32_t b = uint32_t(h) << 16; float f; memcpy(&f, &b, 4); return f; }
uint16_t tobf(float f) { uint32_t b; memcpy(&b, &f, 4); return b >> 16; }
int main(int argc, char** argv) {
  const int np = argc > 1 ? atoi(argv[1]) : 16; const int rz = argc > 2 ? atoi(argv[2]) : 0;
  if (syscall(SYS_arch_prctl, 0x1023, 18)) return 1;
  Cfg cfg; for (int t = 0; t < 3; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16; _tile_loadconfig(&cfg);
  std::mt19937 rng(1); std::normal_distribution<float> nd(0, 1); std::uniform_int_distribution<int> ex(-20, 20);
  alignas(64) uint16_t A[16 * 32] = {}, B[16 * 32] = {}; alignas(64) float C[256];
  long match[6] = {}; const int trials = 200000;
  for (int t = 0; t < trials; ++t) {
    float c0 = std::ldexp(nd(rng), ex(rng));
    for (int k = 0; k < 32; ++k) { if (k >= 2 * np) { A[k] = 0; B[(k / 2) * 32 + k % 2] = 0; continue; } A[k] = tobf(std::ldexp(nd(rng), ex(rng))); B[(k / 2) * 32 + k % 2] = tobf(std::ldexp(nd(rng), ex(rng))); }
    for (int i = 0; i < 256; ++i) C[i] = 0; C[0] = c0;
    _tile_loadd(0, C, 64); _tile_loadd(1, A, 64); _tile_loadd(2, B, 64); _tile_dpbf16ps(0, 1, 2); _tile_stored(0, C, 64);
    const float got = C[0];
    if (rz) fesetround(FE_TOWARDZERO);
    auto a = [&](int k) { return bf(A[k]); }; auto b = [&](int k) { return bf(B[(k / 2) * 32 + k % 2]); };
    float e[6]; e[0] = e[1] = e[2] = e[3] = e[4] = e[5] = c0; double all = c0;
    for (int i = 0; i < 16; ++i) {
      const float p0 = a(2 * i) * b(2 * i), p1 = a(2 * i + 1) * b(2 * i + 1);  // exact
      e[0] = e[0] + (p0 + p1);                 // pair rounded, then added
      e[1] = (e[1] + p0) + p1;                 // even then odd
      e[2] = (e[2] + p1) + p0;                 // odd then even
      e[3] = float(double(e[3]) + double(p0) + double(p1));  // pair exact, one rounding
      all += double(p0) + double(p1);
    }
    e[4] = float(all);  // the whole sum exact, one rounding
    { float s = 0; for (int i = 0; i < 16; ++i) s += a(2*i)*b(2*i) + a(2*i+1)*b(2*i+1); e[5] = c0 + s; }  // products summed, then c
    fesetround(FE_TONEAREST);
    for (int h = 0; h < 6; ++h) match[h] += memcmp(&got, &e[h], 4) == 0;
  }
  const char* names[6] = {"pair rounded then added", "even then odd", "odd then even", "pair exact + c, one rounding", "whole sum exact", "sum then + c"};
  for (int h = 0; h < 6; ++h) printf("%-32s %ld / %d\n", names[h], match[h], trials);
  _tile_release();
}
