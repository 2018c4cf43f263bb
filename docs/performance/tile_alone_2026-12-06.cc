// The float32 kernel's 4 x 6 tile alone, one thread, docs/performance.md section 50: x rows R, 6 * N
// outputs of K = 576, every tile in turn. Build from the repository root:
//   g++ -O3 -march=native -std=c++17 -fno-math-errno -fopenmp-simd -I $(python -c "import jax; print(jax.ffi.include_dir())") \
//       -I jax_backend/cpu_kernels docs/performance/tile_alone_2026-12-06.cc -o /tmp/tile_alone && /tmp/tile_alone 32 1
#include "../../jax_backend/cpu_kernels/rows_matmul.cc"
#include <chrono>
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  const int64_t K = 576, R = atoi(argv[1]), N = 6 * atoi(argv[2]);
  std::vector<float> xs(R * K + 64), ws(N * K + 64), ys(R * N + 64);
  for (auto& v : xs) v = rand() / float(RAND_MAX);
  for (auto& v : ws) v = rand() / float(RAND_MAX);
  float* x = xs.data() + (16 - reinterpret_cast<uintptr_t>(xs.data()) / 4 % 16) % 16;
  float* w = ws.data() + (16 - reinterpret_cast<uintptr_t>(ws.data()) / 4 % 16) % 16;
  long reps = 2000000000L / (R * N * K);
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < reps; ++i)
    for (int64_t n = 0; n < N; n += 6)
      for (int64_t r = 0; r + 4 <= R; r += 4)
        tile<4, 6>(x + r * K, w + n * K, K, ys.data() + r * N + n, N, nullptr, 0, 1);
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("R=%ld N=%ld: %.1f GFLOP/s one thread (x %.0f KB, w %.0f KB)\n", R, N, 2.0 * reps * R * N * K / dt / 1e9, R * K * 4 / 1024.0, N * K * 4 / 1024.0);
}
