"""CUDA device helpers of the TileLang flush kernel: PTX that the TileLang language does not spell (mma.sync,
cp.async, packing, the bit search), called through ``T.call_extern``; and the helpers of the clock-stamp builds.

Packing converts with cvt.rn.{bf16,f16}x2.f32 (its first source goes to the upper half, the mma's higher k index); the
mma wrappers take the accumulator by pointer so that one call updates four registers of the thread's state tile in
place. The rounding constant is :data:`leapquant.numerics.RINT_MAGIC`, written into the text below.
"""
from __future__ import annotations

import re

from ..numerics import CODE_BIAS, CODE_BIAS_BITS, RINT_MAGIC

_PRELUDE = r"""
__device__ __forceinline__ unsigned lq_pack_bf16x2(float lo, float hi) {
  unsigned d; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo)); return d;
}
__device__ __forceinline__ unsigned lq_pack_f16x2(float lo, float hi) {
  unsigned d; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo)); return d;
}
__device__ __forceinline__ float lq_bf16_trunc(float x) { return __uint_as_float(__float_as_uint(x) & 0xffff0000u); }
// part 0 or 1 of the split x = hi + lo into bf16 values, two keys packed: hi truncates to the top 8 significant bits,
// lo is the remainder (exact in fp32) rounded to bf16
__device__ __forceinline__ unsigned lq_key_part(float k0, float k1, int part) {
  float h0 = lq_bf16_trunc(k0), h1 = lq_bf16_trunc(k1);
  if (part == 0) return __byte_perm(__float_as_uint(h0), __float_as_uint(h1), 0x7632);
  return lq_pack_bf16x2(k0 - h0, k1 - h1);
}
// byte b (0..3) of a word of int8 codes whose sign bits were flipped (code + 128, unsigned), as a float: the byte
// becomes the low mantissa byte of 2^23 (PRMT), and subtracting 2^23 + 128 is exact. Two full-rate instructions
// instead of I2F, which issues at a quarter of the rate on the conversion pipe (64 per thread per program)
__device__ __forceinline__ float lq_code(unsigned biased_word, int b) {
  return __uint_as_float(__byte_perm(biased_word, @CODE_BIAS_BITS@u, 0x7650u + b)) - @CODE_BIAS@f;
}
// four values x_i * scale rounded half to even and packed as int8 bytes, little-endian: fma(x, scale, 1.5 * 2^23)
// rounds the exact product to an integer in the low mantissa bits (its low byte is the two's-complement code), so no
// F2I (conversion pipe) and one rounding instead of two. |x * scale| <= 127 (1 + 2^-22) by construction
__device__ __forceinline__ int lq_pack_codes(float x0, float x1, float x2, float x3, float scale) {
  const float magic = @RINT_MAGIC@f;
  unsigned c0 = __float_as_uint(__fmaf_rn(x0, scale, magic)), c1 = __float_as_uint(__fmaf_rn(x1, scale, magic));
  unsigned c2 = __float_as_uint(__fmaf_rn(x2, scale, magic)), c3 = __float_as_uint(__fmaf_rn(x3, scale, magic));
  return (int)__byte_perm(__byte_perm(c0, c1, 0x0040), __byte_perm(c2, c3, 0x0040), 0x5410);
}
// asynchronous copies global -> shared (cp.async: no registers held while the bytes are in flight)
__device__ __forceinline__ void lq_cp16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void lq_cp4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem)
               : "memory");
}
// position of the n-th (0-based) set bit of a mask word: a binary search on population counts, five steps (PTX's
// fns is emulated by ~150 instructions on sm_90, a loop over the lower set bits takes up to 31 dependent rounds)
__device__ __forceinline__ int lq_nth_set_bit(unsigned mask, int n) {
  int pos = 0;
#pragma unroll
  for (int step = 16; step > 0; step >>= 1) {
    int low = __popc(mask & ((1u << step) - 1u));
    if (n >= low) { n -= low; mask >>= step; pos += step; }
  }
  return pos;
}
// nonzero in every lane when any lane of the warp passes a nonzero value (the whole warp calls it)
__device__ __forceinline__ int lq_warp_any(int x) { return __any_sync(0xffffffffu, x); }
// stores to global memory where `code` >= 0 (a program's code, its sign bit set where its window is empty: such a
// program writes nothing), each one predicated instruction: with an `if` around each store nvcc branched around them
// and the kernel spilled 52 bytes where it spills 12 without the condition (sm_90a, KDA). lq_st_f16_if rounds x to
// fp16 first (exact for the tokens: x holds an fp16 value)
__device__ __forceinline__ void lq_st_f16_if(void* p, float x, int code) {
  asm volatile("{ .reg .pred q; .reg .b16 h; setp.ge.s32 q, %2, 0; cvt.rn.f16.f32 h, %1; @q st.global.b16 [%0], h; }"
               :: "l"(p), "f"(x), "r"(code));
}
__device__ __forceinline__ void lq_st_f32_if(void* p, float x, int code) {
  asm volatile("{ .reg .pred q; setp.ge.s32 q, %2, 0; @q st.global.f32 [%0], %1; }" :: "l"(p), "f"(x), "r"(code));
}
__device__ __forceinline__ void lq_st_v2_if(void* p, int a, int b, int code) {
  asm volatile("{ .reg .pred q; setp.ge.s32 q, %3, 0; @q st.global.v2.b32 [%0], {%1, %2}; }"
               :: "l"(p), "r"(a), "r"(b), "r"(code));
}
__device__ __forceinline__ void lq_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void lq_cp_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ void lq_cp_wait_but_last() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void lq_mma_bf16(float* c0, float* c1, float* c2, float* c3, unsigned a0, unsigned a1,
                                            unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(*c0), "+f"(*c1), "+f"(*c2), "+f"(*c3) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// x = big + small with big = x's sign, exponent and top 10 mantissa bits (a tf32 value, exact) and small = x - big
// (exact in fp32, |small| < 2^-10 |x|)
__device__ __forceinline__ float lq_tf32_big(float x) { return __uint_as_float(__float_as_uint(x) & 0xffffe000u); }
// C += A B on the tensor cores (mma.m16n8k8, tf32 inputs, fp32 accumulation) with A = big + small split here: two
// mma, A's big part then its small part, against the same B (whose columns carry b's own big and small parts, so the
// products big * big, big * small, small * big, small * small all land in C). The tf32 inputs keep ~21 significant
// bits of each fp32 value, the accumulation is fp32: the product is the fp32 one up to ~2^-20 relative per term
__device__ __forceinline__ void lq_mma_tf32_split(float* c0, float* c1, float* c2, float* c3, float a0, float a1,
                                                  float a2, float a3, float b0, float b1) {
  float h0 = lq_tf32_big(a0), h1 = lq_tf32_big(a1), h2 = lq_tf32_big(a2), h3 = lq_tf32_big(a3);
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(*c0), "+f"(*c1), "+f"(*c2), "+f"(*c3)
      : "r"(__float_as_uint(h0)), "r"(__float_as_uint(h1)), "r"(__float_as_uint(h2)), "r"(__float_as_uint(h3)),
        "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(*c0), "+f"(*c1), "+f"(*c2), "+f"(*c3)
      : "r"(__float_as_uint(a0 - h0)), "r"(__float_as_uint(a1 - h1)), "r"(__float_as_uint(a2 - h2)),
        "r"(__float_as_uint(a3 - h3)), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}
__device__ __forceinline__ void lq_mma_f16_k8(float* c0, float* c1, float* c2, float* c3, unsigned a0, unsigned a1,
                                              unsigned b0) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
      : "+f"(*c0), "+f"(*c1), "+f"(*c2), "+f"(*c3) : "r"(a0), "r"(a1), "r"(b0));
}
"""
#: the helpers every build has (``prelude`` of the kernel)
PRELUDE = (_PRELUDE.replace("@RINT_MAGIC@", f"{RINT_MAGIC}").replace("@CODE_BIAS_BITS@", f"{CODE_BIAS_BITS:#x}")
           .replace("@CODE_BIAS@", f"{CODE_BIAS}"))
assert re.search(r"@[A-Z_]+@", PRELUDE) is None

#: the clock-stamp builds' helpers (FlushConfig.clock), put before PRELUDE in those builds only:
#: "phases" adds the cycles since the thread's previous stamp to a counter, "ctas" stores (globaltimer, clock64, SM
#: id), "prologue" stores clock64
CLOCK_HELPERS = {
    "phases": ('__device__ __forceinline__ void lq_mark(int* ctr, int64_t* stamp) {\n'
               '  long long n = clock64(); atomicAdd(ctr, (int)(n - *stamp)); *stamp = n;\n}\n'),
    "ctas": ('__device__ __forceinline__ void lq_cta_stamp(int* p) {\n'
             '  long long* d = (long long*)p; long long t; unsigned sm;\n'
             '  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));\n'
             '  d[0] = t; d[1] = clock64(); d[2] = sm;\n}\n'),
    "prologue": ('__device__ __forceinline__ void lq_pro_stamp(int* p) {\n'
                 '  *(long long*)p = clock64();\n}\n'),
}


def prelude(clock: str | None) -> str:
    """The kernel's prelude for a build with clock mode ``clock`` (None: the shipped kernel's)."""
    return PRELUDE if clock is None else "\n" + CLOCK_HELPERS[clock] + PRELUDE[1:]
