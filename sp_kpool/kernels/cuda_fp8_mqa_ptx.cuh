// The PTX helpers of the CUDA scorer (cuda_fp8_mqa.cu, which includes this file): shared-memory
// addresses, mbarriers (with the KPOOL_DEBUG wait), TMA loads, register reallocation, wgmma
// descriptors and steps, as inline device functions in namespace kpool.
//
// Built with cuda_fp8_mqa.cu by sp_kpool/kernels/cuda_fp8_mqa.py (a quoted include: nvcc finds
// this file next to the .cu).

#pragma once

#include <cuda.h>
#include <stdint.h>
#include <stdio.h>

namespace kpool {

// ---- PTX helpers ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Whether the barrier's phase of the given parity has completed (one try).
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Waits until the barrier's phase of the given parity has completed. Built with
// -DKPOOL_DEBUG (cuda_fp8_mqa.py's debug=True), a wait still open kDebugWaitNs after its first
// failed try (by the global nanosecond timer, so the same wall time on every clock and load)
// prints which barrier (`what`), stage and parity it waited for and traps: a broken pipeline
// then fails with its place within about a second instead of hanging.
#ifdef KPOOL_DEBUG
constexpr uint64_t kDebugWaitNs = 1000000000ull;  // 1 s: a legitimate wait lasts micro- to milliseconds

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity, const char* what, int stage) {
#ifdef KPOOL_DEBUG
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t start = global_timer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (global_timer_ns() - start >= kDebugWaitNs) {
      printf("kpool_fp8_mqa: block %d thread %d waited too long for %s[%d] parity %u\n", blockIdx.x, threadIdx.x,
             what, stage, parity);
      __trap();
    }
  }
#else
  (void)what, (void)stage;
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "KPOOL_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra KPOOL_WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void tma_load_1d(void* dst, const CUtensorMap* map, int c0, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void tma_prefetch(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

template <int N>
__device__ __forceinline__ void set_registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

template <int N>
__device__ __forceinline__ void set_registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

// Shared-memory matrix descriptor of a K-major tile of 128-byte rows written by TMA with the
// 128-byte swizzle: start address, stride of 8 rows (1024 bytes), swizzle mode 1 (128 B).
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* p) {
  const uint64_t addr = smem_addr(p);
  uint64_t desc = (addr & 0x3FFFF) >> 4;
  // leading byte offset 0: unused for swizzled K-major tiles (as DeepGEMM's make_smem_desc)
  desc |= uint64_t(1024 >> 4) << 32;    // stride byte offset: 8 rows of 128 bytes
  desc |= uint64_t(1) << 62;            // 128-byte swizzle
  return desc;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void keep_in_register(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// One wgmma of 64 x 128 FP32 accumulators d[64] from two shared-memory descriptors: `shape`
// is the instruction's shape and types, `tail` its operands after `scale-d` (the immediate
// scales, and the transposes where the types have them). The first step of a chain passes
// accumulate = 0 (D = A B), the others 1 (D += A B). Fragment layout: thread t of the
// warpgroup holds rows 16 (t / 32) + (t % 32) / 4 (+ 8) and columns 8 n + 2 (t % 4) (+ 1),
// register 4 n + {0, 1} (row) and {2, 3} (row + 8).
#define KPOOL_WGMMA(shape, tail)                                    \
  asm volatile(                                                     \
      "{\n"                                                         \
      ".reg .pred acc;\n"                                           \
      "setp.ne.b32 acc, %66, 0;\n"                                  \
      "wgmma.mma_async.sync.aligned." shape " {"                    \
  "%0, %1, %2, %3, %4, %5, %6, %7, " \
  "%8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63" \
      "}, %64, %65, acc, " tail ";\n"                               \
      "}\n"                                                         \
      : \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))

// D[64 x 128] (+)= A[64 x 32] B[32 x 128]^T, E4M3 inputs, both K-major.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float* d, uint64_t desc_a, uint64_t desc_b, int accumulate) {
  KPOOL_WGMMA("m64n128k32.f32.e4m3.e4m3", "1, 1");
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128]^T, BF16 inputs, both K-major (no transpose).
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float* d, uint64_t desc_a, uint64_t desc_b, int accumulate) {
  KPOOL_WGMMA("m64n128k16.f32.bf16.bf16", "1, 1, 0, 0");
}

#undef KPOOL_WGMMA

__device__ __forceinline__ float relu(float x) { return fmaxf(x, 0.0f); }  // max.f32: NaN -> 0

}  // namespace kpool
