#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main(){
  __m256 a[12]; for(int i=0;i<12;++i) a[i]=_mm256_set1_ps(0.001f*i);
  __m256 b=_mm256_set1_ps(0.9999f), c=_mm256_set1_ps(0.0001f);
  long iters=200000000;
  auto t0=std::chrono::steady_clock::now();
  for(long it=0;it<iters;++it){
    for(int i=0;i<12;++i) a[i]=_mm256_fmadd_ps(a[i],b,c);
    __asm__ volatile("" : "+x"(a[0]),"+x"(a[1]),"+x"(a[2]),"+x"(a[3]),"+x"(a[4]),"+x"(a[5]),"+x"(a[6]),"+x"(a[7]),"+x"(a[8]),"+x"(a[9]),"+x"(a[10]),"+x"(a[11]));
  }
  double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();
  float r=0; for(int i=0;i<12;++i) r+=a[i][0];
  printf("%.1f GFLOP/s one core (%g)\n", iters*12.0*16/s/1e9, r);
}
