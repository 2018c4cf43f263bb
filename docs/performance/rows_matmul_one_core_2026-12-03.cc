// One core, warm caches: the matmul kernel's dot-form register tiles beside a plain outer-product
// (broadcast) tile over k-major weight panels, GFLOP/s (docs/performance.md section 33). Build and run:
//   g++ -O3 -march=native -std=c++17 -fno-math-errno -w -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       docs/performance/rows_matmul_one_core_2026-12-03.cc -o /tmp/one_core && /tmp/one_core ROWS [N]
// ROWS a multiple of 24 (every tile here covers whole row blocks only), N a multiple of 96.
// (the outer tiles read w as if packed k-major: their outputs are not compared, only timed. Section 33's
// K-blocked outer tiles and the all-in-L1 tile were variants of this loop, run by hand.)
#include "../../jax_backend/cpu_kernels/rows_matmul.cc"
#include <chrono>
#include <cstdio>
#include <cstdlib>
template <int RB, int NV>
void outer_tile(const float* x, int64_t k_dim, const float* panel, float* y, int64_t ldy) {
  vn acc[RB][NV];
  for (int r = 0; r < RB; ++r) for (int v = 0; v < NV; ++v) acc[r][v] = vn{};
  for (int64_t k = 0; k < k_dim; ++k) {
    vn wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load_n(panel + k * NV * 16 + v * 16);
    for (int r = 0; r < RB; ++r) {
      const vn xb = vn{} + x[r * k_dim + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += xb * wv[v];
    }
  }
  for (int r = 0; r < RB; ++r) for (int v = 0; v < NV; ++v) store_n(y + r * ldy + v * 16, acc[r][v]);
}
template <int RB, int NV>
void outer(const float* x, int64_t rows, int64_t k_dim, const float* packed, int64_t n_dim, float* y) {
  for (int64_t n = 0; n < n_dim; n += NV * 16)
    for (int64_t r = 0; r + RB <= rows; r += RB)
      outer_tile<RB, NV>(x + r * k_dim, k_dim, packed + n * k_dim, y + r * n_dim + n, n_dim);
}
int main(int argc, char** argv) {
  const int64_t rows = atoi(argv[1]), k = 576, n = argc > 2 ? atoi(argv[2]) : 1536;
  float* x = (float*)aligned_alloc(64, rows * k * 4); float* w = (float*)aligned_alloc(64, n * k * 4);
  float* y = (float*)aligned_alloc(64, rows * n * 4 + 64);
  for (int64_t i = 0; i < rows * k; ++i) x[i] = rand() / float(RAND_MAX);
  for (int64_t i = 0; i < n * k; ++i) w[i] = rand() / float(RAND_MAX);
  const int iters = 2000;
  auto time = [&](auto f, const char* name) {
    f(); auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) f();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("  %-12s rows %ld N %ld: %6.1f GFLOP/s\n", name, rows, n, 2.0 * rows * k * n * iters / s / 1e9);
  };
  Problem p{x, w, y, rows, k, n};
  time([&] { outputs<4, 6>(p, 0, n); }, "dot 4x6");
  time([&] { outputs<8, 3>(p, 0, n); }, "dot 8x3");
  time([&] { outputs<6, 4>(p, 0, n); }, "dot 6x4");
  time([&] { outer<8, 3>(x, rows, k, w, n, y); }, "outer 8x3v");
  time([&] { outer<4, 6>(x, rows, k, w, n, y); }, "outer 4x6v");
  time([&] { outer<6, 4>(x, rows, k, w, n, y); }, "outer 6x4v");
}
