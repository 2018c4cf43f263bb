// One output of tdpbf16ps against float32 emulations (docs/performance.md sections 53-54). Build: g++ -O0 -march=native; run with the number of nonzero pairs (1-16).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
struct Cfg { uint8_t palette = 1, start = 0, r[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
float bf(uint16_t h) { uint32_t b = uint32_t(h) << 16; float f; memcpy(&f, &b, 4); return f; }
uint16_t tobf(float f) { uint32_t b; memcpy(&b, &f, 4); return b >> 16; }
int main(int argc, char** argv) {
  const int np = atoi(argv[1]);
  if (syscall(SYS_arch_prctl, 0x1023, 18)) return 1;
  Cfg cfg; for (int t = 0; t < 3; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16; _tile_loadconfig(&cfg);
  std::mt19937 rng(1); std::normal_distribution<float> nd(0, 1); std::uniform_int_distribution<int> ex(-20, 20);
  alignas(64) uint16_t A[512] = {}, B[512] = {}; alignas(64) float C[256];
  const int H = 6; long match[H] = {}; const int trials = 100000; int shown = 0;
  for (int t = 0; t < trials; ++t) {
    float c0 = std::ldexp(nd(rng), ex(rng));
    for (int k = 0; k < 32; ++k) { bool on = k < 2 * np; A[k] = on ? tobf(std::ldexp(nd(rng), ex(rng))) : 0; B[(k / 2) * 32 + k % 2] = on ? tobf(std::ldexp(nd(rng), ex(rng))) : 0; }
    for (int i = 0; i < 256; ++i) C[i] = 0; C[0] = c0;
    _tile_loadd(0, C, 64); _tile_loadd(1, A, 64); _tile_loadd(2, B, 64); _tile_dpbf16ps(0, 1, 2); _tile_stored(0, C, 64);
    const float got = C[0];
    std::vector<float> p(32); for (int k = 0; k < 32; ++k) p[k] = bf(A[k]) * bf(B[(k / 2) * 32 + k % 2]);
    float e[H];
    { double s = 0; for (int k = 0; k < 32; ++k) s += p[k]; e[0] = c0 + float(s); }                      // exact products sum rounded, + c
    { float se = 0, so = 0; for (int i = 0; i < 16; ++i) se += p[2*i], so += p[2*i+1]; e[1] = c0 + (se + so); }  // even lane, odd lane
    { float s = c0; for (int i = 0; i < 16; ++i) s = s + (p[2*i] + p[2*i+1]); e[2] = s; }                // sequential pairs into c
    { float q[16]; for (int i = 0; i < 16; ++i) q[i] = p[2*i] + p[2*i+1];                                // tree of pairs, + c
      for (int w = 8; w >= 1; w /= 2) for (int i = 0; i < w; ++i) q[i] = q[i] + q[i + w]; e[3] = c0 + q[0]; }
    { float q[16]; for (int i = 0; i < 16; ++i) q[i] = p[2*i] + p[2*i+1];                                // adjacent tree
      for (int w = 1; w < 16; w *= 2) for (int i = 0; i + w < 16; i += 2 * w) q[i] = q[i] + q[i + w]; e[4] = c0 + q[0]; }
    { float s = c0; for (int i = 0; i < 16; ++i) s = (s + p[2*i+1]) + p[2*i]; e[5] = s; }
    for (int h = 0; h < H; ++h) match[h] += memcmp(&got, &e[h], 4) == 0;
  }
  const char* names[H] = {"exact sum rounded, + c", "even/odd lane sums, + c", "pairs into c in order", "pair tree (i+8..), + c", "pair tree adjacent, + c", "odd,even into c"};
  for (int h = 0; h < H; ++h) printf("np %2d %-28s %ld / %d\n", np, names[h], match[h], trials);
}
