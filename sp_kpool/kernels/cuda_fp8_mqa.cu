// FP8 MQA scoring with DeepGEMM's per-logit arithmetic, as a CUDA kernel of our own (sm_90a);
// the same kernel on BF16 inputs.
//
// Scores query rows against pools exactly as DeepGEMM's SM90 `fp8_mqa_logits` computes each
// logit (docs/contract.md section 6; sp_kpool/kernels/triton_fp8_fused.py states the same
// formula), in a schedule of our own: a persistent grid, one producer warpgroup that loads
// query blocks and pool tiles with the tensor-memory accelerator (TMA) into a pipeline of
// shared-memory stages, and four math warpgroups that multiply with `wgmma` and reduce the
// heads in registers.
//
// Per logit (row i, pool p; a_h the tensor-core product of head h and the pool over the 128
// channels as chained wgmma steps, the first with no accumulator; r_h = max(a_h, 0), so NaN
// gives 0; w_h the folded FP32 head weight; s the pool's FP32 scale), with every operation
// an explicit round-to-nearest intrinsic, so that no compiler contraction choice changes a
// bit:
//
//   c_j   = fma(r_j, w_j, RN(r_{8+j} w_{8+j})), then c_j = fma(r_{8m+j}, w_{8m+j}, c_j),
//           m = 2 .. H/8 - 1 in order                       (eight chains, j = 0..7)
//   P_q   = RN(RN(c_{2q} + c_{2q+1}) * s)                    (q = 0..3, lane q of a quad)
//   logit = RN(RN(P_0 + P_1) + RN(P_2 + P_3))                (two butterfly steps)
//
// Variants (template arguments):
//   H     32, 64 or 128 index heads; a query block is 128 / H rows, so every wgmma is
//         m64n128 (64 pools x (rows x heads)).
//   NQB   query blocks per task that share each pool tile: 1 (four warpgroups split a tile of
//         256 pools) or 2 (two warpgroups per query block split a tile of 128 pools: every
//         pool byte brought to shared memory serves twice the rows).
//   MODE  0 (dense): write out[row * stride + pool] for every pool < P of the tiles scored
//         for the row's task (DeepGEMM's legacy columns: a task's tiles cover the union of
//         its rows' [ks, ke), so a row's columns outside its own range hold scores of pools
//         it does not see, and columns outside every tile are not written); the bitwise
//         test vehicle. 1 (no store): every logit is computed and none is written (a
//         store to `sink` under a condition no logit meets); times the scoring alone.
//   DT    0: E4M3 inputs, four k32 steps, the pool scale s (DeepGEMM's fp8_mqa_logits);
//         1: BF16 inputs, eight k16 steps, no scale (P_q = RN(c_{2q} + c_{2q+1})): the BF16
//         modes' scores of the `triton` backend (its Triton kernel's arithmetic).
//
// Not run on a GPU when it was written (2026-12-04): tests/gpu/test_cuda_fp8_mqa.py checks
// it against DeepGEMM (E4M3) and the Triton kernel (BF16) bit for bit;
// tests/unit/test_cuda_fp8_mqa_ptx.py checks what a CPU can (every variant compiles for
// sm_90a without spills and issues its wgmma steps over the swizzled tiles and no mma.sync;
// every stored logit is the formula's expression, and DeepGEMM's compiled template's).
//
// Built at first use by sp_kpool/kernels/cuda_fp8_mqa.py with the host's nvcc.

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>

#include "cuda_fp8_mqa_ptx.cuh"  // the PTX helpers (namespace kpool)

namespace kpool {

constexpr int kHeadDim = 128;                // channels
constexpr int kMathWarpgroups = 4;
constexpr int kMathThreads = kMathWarpgroups * 128;
constexpr int kThreads = kMathThreads + 128;  // + one producer warpgroup
constexpr int kSmemLimit = 227 * 1024;        // per CTA on sm_90
constexpr int kProducerRegisters = 32;
constexpr int kMathRegisters = 112;           // what the producer gives up, the math warpgroups take:
                                              // 128 x (96 - 32) = 512 x (112 - 96) at 96 on entry

// DT 0: E4M3 inputs and a pool scale (the fp8 arithmetic); DT 1: BF16 inputs, no scale (the
// BF16 modes' arithmetic of the `triton` backend: the same chains, P_q = RN(c_2q + c_2q+1)).
// A row of 128 channels is one 128-byte swizzle atom in E4M3 and two (channel halves, stored
// one after the other: [atom][rows][128 bytes]) in BF16; each wgmma step reads 32 bytes of
// every row (k32 E4M3 or k16 BF16), so four steps per atom.
template <int H, int NQB, int DT>
struct Shape {
  static_assert(H == 32 || H == 64 || H == 128, "H must be 32, 64 or 128");
  static_assert(NQB == 1 || NQB == 2, "NQB must be 1 or 2");
  static_assert(DT == 0 || DT == 1, "DT must be 0 (E4M3) or 1 (BF16)");
  static constexpr int kAtoms = DT == 0 ? 1 : 2;              // 128-byte atoms per row
  static constexpr int kAtomElems = 128 / (DT == 0 ? 1 : 2);  // channels per atom
  static constexpr int kSteps = 4 * kAtoms;                   // chained wgmma steps
  static constexpr int kRowsPerBlock = 128 / H;               // rows of one query block
  static constexpr int kRowsPerTask = kRowsPerBlock * NQB;
  static constexpr int kSubtiles = kMathWarpgroups / NQB;     // 64-pool subtiles per stage
  static constexpr int kPoolsPerStage = 64 * kSubtiles;
  static constexpr int kQAtomBytes = NQB * 128 * 128;         // one atom of a query stage
  static constexpr int kQBytes = kAtoms * kQAtomBytes;
  static constexpr int kKVAtomBytes = kPoolsPerStage * 128;
  static constexpr int kKVBytes = kAtoms * kKVAtomBytes;
  static constexpr int kScaleBytes = DT == 0 ? kPoolsPerStage * 4 : 0;
  // BF16: one query stage (the next task's queries load after this task's last tile, once
  // per task of ~100 tiles), the rest of shared memory for pool stages
  static constexpr int kQStages = DT == 0 ? 2 : 1;
  static constexpr int kKVStagesMax = DT == 0 ? (NQB == 1 ? 5 : 8) : 8;
  static constexpr int kKVStagesFit = (kSmemLimit - kQStages * kQBytes - 256) / (kKVBytes + kScaleBytes);
  static constexpr int kKVStages = kKVStagesFit < kKVStagesMax ? kKVStagesFit : kKVStagesMax;
  static_assert(kKVStages >= 2, "at least two pool stages");
  static constexpr int kSmemBytes = kQStages * kQBytes + kKVStages * (kKVBytes + kScaleBytes)
                                    + (2 * kQStages + 2 * kKVStages) * 8;
  static_assert(kSmemBytes <= kSmemLimit, "shared memory");
};

// ---- The kernel ----------------------------------------------------------------------------

// One task is kRowsPerTask consecutive rows (NQB query blocks). Every thread derives the same
// pool range of a task from ks/ke: [lo, hi), lo the smallest start rounded down to a multiple
// of 4, hi the largest end, both clamped to P; then ceil((hi - lo) / kPoolsPerStage) tiles.
template <class Sh>
__device__ __forceinline__ void task_range(int task, int S, int P, const int* ks, const int* ke, int& lo, int& tiles) {
  int start = P, end = 0;
#pragma unroll
  for (int i = 0; i < Sh::kRowsPerTask; ++i) {
    const int row = min(task * Sh::kRowsPerTask + i, S - 1);
    const int a = min(max(__ldg(ks + row), 0), P);
    const int b = min(max(__ldg(ke + row), 0), P);
    if (a < b) {
      start = min(start, a);
      end = max(end, b);
    }
  }
  lo = start / 4 * 4;
  tiles = end > lo ? (end - lo + Sh::kPoolsPerStage - 1) / Sh::kPoolsPerStage : 0;
}

template <int H, int NQB, int MODE, int DT>
__global__ void __launch_bounds__(kThreads, 1)
fp8_mqa_kernel(const int S, const int P, const long long stride, const int* __restrict__ ks,
               const int* __restrict__ ke, const float* __restrict__ weights, float* __restrict__ out,
               unsigned* __restrict__ sink, const __grid_constant__ CUtensorMap map_q,
               const __grid_constant__ CUtensorMap map_kv, const __grid_constant__ CUtensorMap map_scale) {
  using Sh = Shape<H, NQB, DT>;
  constexpr int BQ = Sh::kRowsPerBlock;
  constexpr int kQStages = Sh::kQStages;
  constexpr int M = H / 8;  // chain steps

  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* smem_q = smem;
  unsigned char* smem_kv = smem_q + kQStages * Sh::kQBytes;
  float* smem_scale = reinterpret_cast<float*>(smem_kv + Sh::kKVStages * Sh::kKVBytes);
  uint64_t* bars = reinterpret_cast<uint64_t*>(reinterpret_cast<unsigned char*>(smem_scale) +
                                               Sh::kKVStages * Sh::kScaleBytes);
  uint64_t* full_q = bars;
  uint64_t* empty_q = full_q + kQStages;
  uint64_t* full_kv = empty_q + kQStages;
  uint64_t* empty_kv = full_kv + Sh::kKVStages;

  const int tid = threadIdx.x;
  const int tasks = (S + Sh::kRowsPerTask - 1) / Sh::kRowsPerTask;

  if (tid == kMathThreads) {
    if (smem_addr(smem) % 1024 != 0) __trap();  // the 128-byte swizzle needs 1024-byte tiles
    for (int s = 0; s < kQStages; ++s) {
      mbar_init(full_q + s, 1);
      mbar_init(empty_q + s, kMathThreads);
    }
    for (int s = 0; s < Sh::kKVStages; ++s) {
      mbar_init(full_kv + s, 1);
      mbar_init(empty_kv + s, kMathThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    tma_prefetch(&map_q);
    tma_prefetch(&map_kv);
    tma_prefetch(&map_scale);
  }
  __syncthreads();

  if (tid >= kMathThreads) {
    // Producer warpgroup: one thread issues every load.
    set_registers_decrease<kProducerRegisters>();
    if (tid != kMathThreads) return;
    int kv_iter = 0, q_iter = 0;
    for (int task = blockIdx.x; task < tasks; task += gridDim.x, ++q_iter) {
      int lo, tiles;
      task_range<Sh>(task, S, P, ks, ke, lo, tiles);
      const int qs = q_iter % kQStages;
      mbar_wait(empty_q + qs, ((q_iter / kQStages) & 1) ^ 1, "empty_q", qs);
      mbar_expect_tx(full_q + qs, Sh::kQBytes);
#pragma unroll
      for (int a = 0; a < Sh::kAtoms; ++a)
        tma_load_2d(smem_q + qs * Sh::kQBytes + a * Sh::kQAtomBytes, &map_q, a * Sh::kAtomElems,
                    task * Sh::kRowsPerTask * H, full_q + qs);
      for (int t = 0; t < tiles; ++t, ++kv_iter) {
        const int s = kv_iter % Sh::kKVStages;
        mbar_wait(empty_kv + s, ((kv_iter / Sh::kKVStages) & 1) ^ 1, "empty_kv", s);
        mbar_expect_tx(full_kv + s, Sh::kKVBytes + Sh::kScaleBytes);
        const int pool = lo + t * Sh::kPoolsPerStage;
#pragma unroll
        for (int a = 0; a < Sh::kAtoms; ++a)
          tma_load_2d(smem_kv + s * Sh::kKVBytes + a * Sh::kKVAtomBytes, &map_kv, a * Sh::kAtomElems, pool, full_kv + s);
        if constexpr (DT == 0) tma_load_1d(smem_scale + s * Sh::kPoolsPerStage, &map_scale, pool, full_kv + s);
      }
    }
    return;
  }

  // Math warpgroups.
  set_registers_increase<kMathRegisters>();
  const int wg = tid / 128;
  const int qb = wg / Sh::kSubtiles;      // the query block of this warpgroup
  const int sub = wg % Sh::kSubtiles;     // its 64-pool subtile of each stage
  const int warp = (tid / 32) % 4;
  const int lane = tid % 32;
  const int quad = lane % 4;
  const int pool_in_stage = sub * 64 + warp * 16 + lane / 4;  // v0; v1 is 8 pools later

  int kv_iter = 0, q_iter = 0;
  for (int task = blockIdx.x; task < tasks; task += gridDim.x, ++q_iter) {
    int lo, tiles;
    task_range<Sh>(task, S, P, ks, ke, lo, tiles);

    // This warpgroup's head weights: head 8 m + 2 quad + b of row i is w[i][2 m + b].
    float w[BQ][2 * M];
#pragma unroll
    for (int i = 0; i < BQ; ++i) {
      const long long r = min(task * Sh::kRowsPerTask + qb * BQ + i, S - 1);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        w[i][2 * m] = __ldg(weights + r * H + 8 * m + 2 * quad);
        w[i][2 * m + 1] = __ldg(weights + r * H + 8 * m + 2 * quad + 1);
      }
    }

    const int qs = q_iter % kQStages;
    mbar_wait(full_q + qs, (q_iter / kQStages) & 1, "full_q", qs);
    const unsigned char* q_tile = smem_q + qs * Sh::kQBytes + qb * 128 * 128;  // atom 0 of this block

    for (int t = 0; t < tiles; ++t, ++kv_iter) {
      const int s = kv_iter % Sh::kKVStages;
      mbar_wait(full_kv + s, (kv_iter / Sh::kKVStages) & 1, "full_kv", s);
      float scale0 = 1.0f, scale1 = 1.0f;
      if constexpr (DT == 0) {
        const float* scales = smem_scale + s * Sh::kPoolsPerStage;
        scale0 = scales[pool_in_stage];
        scale1 = scales[pool_in_stage + 8];
      }
      const unsigned char* kv_tile = smem_kv + s * Sh::kKVBytes + sub * 64 * 128;  // atom 0 of this subtile

      float acc[64];
#pragma unroll
      for (int j = 0; j < 64; ++j) keep_in_register(acc[j]);
      wgmma_fence();
      // step k reads bytes [32 (k % 4), + 32) of atom k / 4: the descriptors of the tiles'
      // first bytes plus that offset in 16-byte units (the 14-bit address field cannot carry:
      // shared memory ends below 2^18 bytes)
      const uint64_t desc_a = smem_desc_sw128(kv_tile), desc_b = smem_desc_sw128(q_tile);
#pragma unroll
      for (int k = 0; k < Sh::kSteps; ++k) {
        const uint64_t da = desc_a + uint64_t(((k / 4) * Sh::kKVAtomBytes + 32 * (k % 4)) >> 4);
        const uint64_t db = desc_b + uint64_t(((k / 4) * Sh::kQAtomBytes + 32 * (k % 4)) >> 4);
        if constexpr (DT == 0)
          wgmma_m64n128k32_e4m3(acc, da, db, k);
        else
          wgmma_m64n128k16_bf16(acc, da, db, k);
      }
      wgmma_commit();
#pragma unroll
      for (int j = 0; j < 64; ++j) keep_in_register(acc[j]);
      wgmma_wait_all();
      mbar_arrive(empty_kv + s);

      const int pool0 = lo + t * Sh::kPoolsPerStage + pool_in_stage;
      const int pool1 = pool0 + 8;
#pragma unroll
      for (int i = 0; i < BQ; ++i) {
        const float* a = acc + i * (H / 2);  // register 4 m + j: head 8 m + 2 quad + (j & 1), pool v(j >> 1)
        float c[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          c[j] = __fmaf_rn(relu(a[j]), w[i][j & 1], __fmul_rn(relu(a[4 + j]), w[i][2 + (j & 1)]));
#pragma unroll
          for (int m = 2; m < M; ++m) c[j] = __fmaf_rn(relu(a[4 * m + j]), w[i][2 * m + (j & 1)], c[j]);
        }
        float v0 = __fadd_rn(c[0], c[1]);
        float v1 = __fadd_rn(c[2], c[3]);
        if constexpr (DT == 0) {
          v0 = __fmul_rn(v0, scale0);
          v1 = __fmul_rn(v1, scale1);
        }
        v0 = __fadd_rn(v0, __shfl_xor_sync(0xffffffffu, v0, 1));
        v1 = __fadd_rn(v1, __shfl_xor_sync(0xffffffffu, v1, 1));
        v0 = __fadd_rn(v0, __shfl_xor_sync(0xffffffffu, v0, 2));
        v1 = __fadd_rn(v1, __shfl_xor_sync(0xffffffffu, v1, 2));
        if constexpr (MODE == 0) {
          const int row = task * Sh::kRowsPerTask + qb * BQ + i;
          float* dst = out + (long long)row * stride;
          if (row < S && quad == 0 && pool0 < P) dst[pool0] = v0;
          if (row < S && quad == 1 && pool1 < P) dst[pool1] = v1;
        } else {
          // No store: a store under a condition no logit meets (the GPU's arithmetic gives
          // only the canonical NaN 0x7fffffff), so the compiler keeps every logit.
          if (__float_as_uint(v0) == 0x7fc0dead) sink[tid] = __float_as_uint(v1);
        }
      }
    }
    mbar_arrive(empty_q + qs);
  }
}

// ---- Host launcher -------------------------------------------------------------------------

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn(char* err, int err_len) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn != nullptr) return fn;
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found;
  const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
    snprintf(err, err_len, "cuTensorMapEncodeTiled is not available from the driver (%s)", cudaGetErrorString(e));
    return nullptr;
  }
  fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  return fn;
}

static int encode(CUtensorMap* map, CUtensorMapDataType type, int rank, void* base, const cuuint64_t* dims,
                  const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swizzle, const char* what,
                  char* err, int err_len) {
  auto fn = encode_fn(err, err_len);
  if (fn == nullptr) return 1;
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = fn(map, type, rank, base, dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    snprintf(err, err_len, "cuTensorMapEncodeTiled failed for %s (CUresult %d)", what, static_cast<int>(r));
    return 1;
  }
  return 0;
}

template <int H, int NQB, int MODE, int DT>
static int launch(const void* q, const void* kv, long long kv_row_bytes, const float* scale, const float* weights,
                  const int* ks, const int* ke, float* out, long long stride, unsigned* sink, int S, int P,
                  int grid, cudaStream_t stream, char* err, int err_len) {
  using Sh = Shape<H, NQB, DT>;
  const CUtensorMapDataType type = DT == 0 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16;
  CUtensorMap map_q, map_kv, map_scale;
  {
    const cuuint64_t dims[2] = {kHeadDim, cuuint64_t(S) * H};
    const cuuint64_t strides[1] = {cuuint64_t(Sh::kAtoms) * 128};
    const cuuint32_t box[2] = {cuuint32_t(Sh::kAtomElems), cuuint32_t(NQB * 128)};
    if (encode(&map_q, type, 2, const_cast<void*>(q), dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, "q", err,
               err_len))
      return 1;
  }
  {
    const cuuint64_t dims[2] = {kHeadDim, cuuint64_t(P)};
    const cuuint64_t strides[1] = {cuuint64_t(kv_row_bytes)};
    const cuuint32_t box[2] = {cuuint32_t(Sh::kAtomElems), cuuint32_t(Sh::kPoolsPerStage)};
    if (encode(&map_kv, type, 2, const_cast<void*>(kv), dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, "keys", err,
               err_len))
      return 1;
  }
  if constexpr (DT == 0) {
    const cuuint64_t dims[1] = {cuuint64_t(P)};
    const cuuint64_t strides[1] = {0};  // rank 1: no stride is read (a valid array all the same)
    const cuuint32_t box[1] = {cuuint32_t(Sh::kPoolsPerStage)};
    if (encode(&map_scale, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 1, const_cast<float*>(scale), dims, strides, box,
               CU_TENSOR_MAP_SWIZZLE_NONE, "scales", err, err_len))
      return 1;
  } else {
    map_scale = map_kv;  // unused
  }
  auto kernel = fp8_mqa_kernel<H, NQB, MODE, DT>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Sh::kSmemBytes);
  if (e != cudaSuccess) {
    snprintf(err, err_len, "cudaFuncSetAttribute(%d bytes of shared memory): %s", Sh::kSmemBytes, cudaGetErrorString(e));
    return 1;
  }
  const int tasks = (S + Sh::kRowsPerTask - 1) / Sh::kRowsPerTask;
  grid = grid < tasks ? grid : tasks;
  kernel<<<grid, kThreads, Sh::kSmemBytes, stream>>>(S, P, stride, ks, ke, weights, out, sink, map_q, map_kv,
                                                      map_scale);
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    snprintf(err, err_len, "kernel launch (H %d, NQB %d, mode %d, dtype %d, grid %d): %s", H, NQB, MODE, DT, grid,
             cudaGetErrorString(e));
    return 1;
  }
  return 0;
}

}  // namespace kpool

extern "C" {

// Scores S rows (q [S, heads, 128] E4M3 (dtype 0) or BF16 (dtype 1), contiguous; weights
// [S, heads] FP32; ks/ke [S] int32) against P pools (kv [P, 128] of the same dtype with rows
// kv_row_bytes apart; E4M3: scale [P] FP32, BF16: scale unused), on `stream`, with at most
// `grid` CTAs. mode 0 writes out[row * stride + pool] (see MODE above); mode 1 writes nothing
// (sink: 512 words that are never written in practice). Returns 0, or 1 with a message in err.
int kpool_fp8_mqa(int heads, int nqb, int mode, int dtype, const void* q, const void* kv, long long kv_row_bytes,
                  const float* scale, const float* weights, const int* ks, const int* ke, float* out,
                  long long stride, unsigned* sink, int S, int P, int grid, void* stream, char* err, int err_len) {
  using namespace kpool;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
#define KPOOL_CASE(H_, NQB_, MODE_, DT_)                                                                  \
  if (heads == H_ && nqb == NQB_ && mode == MODE_ && dtype == DT_)                                       \
    return launch<H_, NQB_, MODE_, DT_>(q, kv, kv_row_bytes, scale, weights, ks, ke, out, stride, sink, S, P, \
                                        grid, st, err, err_len);
#define KPOOL_CASES(H_, NQB_) \
  KPOOL_CASE(H_, NQB_, 0, 0) KPOOL_CASE(H_, NQB_, 1, 0) KPOOL_CASE(H_, NQB_, 0, 1) KPOOL_CASE(H_, NQB_, 1, 1)
  KPOOL_CASES(32, 1) KPOOL_CASES(32, 2) KPOOL_CASES(64, 1) KPOOL_CASES(64, 2) KPOOL_CASES(128, 1) KPOOL_CASES(128, 2)
#undef KPOOL_CASES
#undef KPOOL_CASE
  snprintf(err, err_len,
           "no variant for heads %d, nqb %d, mode %d, dtype %d (heads 32, 64 or 128; nqb 1 or 2; mode 0 or 1; "
           "dtype 0 or 1)",
           heads, nqb, mode, dtype);
  return 1;
}

}  // extern "C"
