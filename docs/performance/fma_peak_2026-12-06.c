// This core's vector FMA throughput (docs/performance.md section 50): 12 independent accumulators,
// 512- and 256-bit. `gcc -O2 -march=native docs/performance/fma_peak_2026-12-06.c -o /tmp/fma && /tmp/fma`
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  long n=100000000;
  double t=now();
  for(long i=0;i<n;i++){
    __asm__ volatile(
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm0\n vfmadd231ps %%zmm30, %%zmm31, %%zmm1\n vfmadd231ps %%zmm30, %%zmm31, %%zmm2\n vfmadd231ps %%zmm30, %%zmm31, %%zmm3\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm4\n vfmadd231ps %%zmm30, %%zmm31, %%zmm5\n vfmadd231ps %%zmm30, %%zmm31, %%zmm6\n vfmadd231ps %%zmm30, %%zmm31, %%zmm7\n"
      "vfmadd231ps %%zmm30, %%zmm31, %%zmm8\n vfmadd231ps %%zmm30, %%zmm31, %%zmm9\n vfmadd231ps %%zmm30, %%zmm31, %%zmm10\n vfmadd231ps %%zmm30, %%zmm31, %%zmm11\n"
      ::: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11");
  }
  double dt=now()-t;
  printf("zmm: %.1f GFLOP/s per thread, %.2f G FMA/s\n", n*12*32/dt/1e9, n*12/dt/1e9);
  t=now();
  for(long i=0;i<n;i++){
    __asm__ volatile(
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n vfmadd231ps %%ymm14, %%ymm15, %%ymm1\n vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n vfmadd231ps %%ymm14, %%ymm15, %%ymm3\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n vfmadd231ps %%ymm14, %%ymm15, %%ymm9\n vfmadd231ps %%ymm14, %%ymm15, %%ymm10\n vfmadd231ps %%ymm14, %%ymm15, %%ymm11\n"
      ::: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11");
  }
  dt=now()-t;
  printf("ymm: %.1f GFLOP/s per thread, %.2f G FMA/s\n", n*12*16/dt/1e9, n*12/dt/1e9);
}
