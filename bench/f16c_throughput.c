/* The CPU's own float16 conversion rate, for bench/RESULTS.md ("The kernel at small H").
 *
 * W5's row (K=2, H=256 float16) is two widenings, one float32 add and one narrowing per element.
 * This times that loop hand-written with AVX2 + F16C intrinsics over L1-resident rows (so memory
 * plays no part), its halves, and an integer widening (the magic-number multiply), to compare
 * with the compiled kernel's time per row. Not part of moegrad: a measuring stick.
 *
 *   gcc -O2 -mavx2 -mf16c -mfma -o /tmp/f16c_throughput bench/f16c_throughput.c && /tmp/f16c_throughput
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#define H 256
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
uint16_t a[H] __attribute__((aligned(64))), b[H] __attribute__((aligned(64))), o[H] __attribute__((aligned(64)));
float f[H] __attribute__((aligned(64)));
__attribute__((noinline)) void hw(void){
  for(int h=0;h<H;h+=8){
    __m256 x=_mm256_cvtph_ps(_mm_load_si128((__m128i*)(a+h)));
    __m256 y=_mm256_cvtph_ps(_mm_load_si128((__m128i*)(b+h)));
    _mm_store_si128((__m128i*)(o+h), _mm256_cvtps_ph(_mm256_add_ps(x,y), 0));
  }
}
__attribute__((noinline)) void hw_widen_only(void){
  for(int h=0;h<H;h+=8){
    __m256 x=_mm256_cvtph_ps(_mm_load_si128((__m128i*)(a+h)));
    __m256 y=_mm256_cvtph_ps(_mm_load_si128((__m128i*)(b+h)));
    _mm256_store_ps(f+h,_mm256_add_ps(x,y));
  }
}
__attribute__((noinline)) void hw_narrow_only(void){
  for(int h=0;h<H;h+=8){
    __m256 x=_mm256_load_ps(f+h);
    _mm_store_si128((__m128i*)(o+h), _mm256_cvtps_ph(x, 0));
  }
}
/* integer widen: exact for normals/subnormals/inf/nan via magic multiply */
static inline __m256 iwiden(__m128i hh){
  __m256i w=_mm256_cvtepu16_epi32(hh);
  __m256i sign=_mm256_slli_epi32(_mm256_and_si256(w,_mm256_set1_epi32(0x8000)),16);
  __m256i mag=_mm256_slli_epi32(_mm256_and_si256(w,_mm256_set1_epi32(0x7fff)),13);
  __m256 v=_mm256_mul_ps(_mm256_castsi256_ps(mag),_mm256_castsi256_ps(_mm256_set1_epi32(0x77800000)));
  __m256i infnan=_mm256_cmpgt_epi32(mag,_mm256_set1_epi32(0x0f7fe000));
  __m256i vi=_mm256_or_si256(_mm256_castps_si256(v),_mm256_and_si256(infnan,_mm256_set1_epi32(0x7f800000)));
  return _mm256_castsi256_ps(_mm256_or_si256(vi,sign));
}
__attribute__((noinline)) void int_widen(void){
  for(int h=0;h<H;h+=8){
    __m256 x=iwiden(_mm_load_si128((__m128i*)(a+h)));
    __m256 y=iwiden(_mm_load_si128((__m128i*)(b+h)));
    _mm_store_si128((__m128i*)(o+h), _mm256_cvtps_ph(_mm256_add_ps(x,y), 0));
  }
}
int main(){
  for(int i=0;i<H;i++){a[i]=0x3c00+i;b[i]=0x3800+i;f[i]=i*0.5f;}
  void (*fs[])(void)={hw,hw_widen_only,hw_narrow_only,int_widen};
  const char*names[]={"hw full (2 widen+add+narrow)","hw widen only (+f32 store)","hw narrow only","int widen + hw narrow"};
  for(int k=0;k<4;k++){
    double best=1e9;
    for(int r=0;r<20;r++){double t=now();for(int i=0;i<20000;i++)fs[k]();double d=(now()-t)/20000/H*1e9;if(d<best)best=d;}
    printf("%-32s %.3f ns/elem  (%.1f ns/row of 256)\n",names[k],best,best*256);
  }
}
