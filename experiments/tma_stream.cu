// How fast can a TMA pipeline stream a skinny GEMM's big operand, with no GEMM around it?
//
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/tma_stream experiments/tma_stream.cu && /tmp/tma_stream [K] [base|consumer|steal|desync|oob]
//
// At 16384x128x4096 both cuBLAS and our kernels stream A (16384 x 4096 fp16, row-major,
// 134 MB) at ~3.79 TB/s (a K sweep), while a plain contiguous read of 512 MB reaches
// 4.3-4.6 TB/s . This probe separates the suspects, one knob at a time, with the same
// mbarrier pipeline a warp-specialized GEMM uses (one producer thread issuing TMA boxes into
// STAGES shared-memory buffers, one consumer warp releasing them):
//   - access order: GEMM order (CTA owns BOX_M rows, walks along K in 128-byte boxes, so the
//     DRAM sees BOX_M rows 8 KB apart at once) vs contiguous slabs of the same size;
//   - pipeline depth (stages) and bytes per stage (TILE_K = 64 or 128 halves);
//   - CTA count: one M tile per CTA (128 CTAs on 132 SMs), split-K, or stream-K units over
//     every SM;
//   - the rest of the GEMM: the B operand (128 x K, re-read from L2 every stage) and the
//     consumer's wgmma time, emulated as a spin of CONSUME clocks per 128x128x64 block;
//   - TMA's L2 promotion (none, 128 B, 256 B).
// Timing: 20 back-to-back launches between two events (as graph-timed GEMMs run back to
// back), median of 5 such groups; TB/s counts the bytes each launch must read at least.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); std::exit(1); } } while (0)
#define CHECK_CU(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { \
  std::printf("driver error %d at %s:%d\n", int(r), __FILE__, __LINE__); std::exit(1); } } while (0)

constexpr int kMaxStages = 16;

enum Order { kGemm = 0, kContiguous = 1 };

struct Params {
  int m_tiles;         // rows / box_m
  int k_blocks;        // K / tile_k
  int splits;          // split-K pieces per M tile (ignored when streamk)
  int streamk;         // 1: the m_tiles * k_blocks units split evenly over gridDim.x CTAs
  int stages;
  int kb;              // 64-half (128-byte) boxes per stage along K: tile_k / 64
  int box_m;
  int order;           // kGemm or kContiguous
  int with_b;          // also load B's 128 x tile_k slice every stage (from L2)
  long long consume;   // consumer spin per stage, clocks
  int release;         // kAfter, kBefore or kLagged: when the consumer frees a stage
  int b_rows;          // rows of B per stage (the GEMM's TILE_N)
  unsigned stage_bytes;  // A's and B's boxes of one stage, rounded up to the swizzle's 1 KB
  unsigned long long* stats;  // per CTA, kStats words, written by every launch (the last one is read)
  // Dynamic tail: the last steal_tail k-blocks of every M tile are not the owner's; any CTA that
  // has finished its own units (or has none: CTAs past m_tiles) claims them steal_chunk k-blocks
  // at a time from *counter (a fresh zeroed counter per launch), first chunk of every tile first.
  int steal_tail, steal_chunk;
  unsigned* counter;
  // Desynchronizing the CTAs: the producer of CTA b starts (b % 16) * skew_ns late, and each
  // stage's spin is consume * (1 +- jitter / 2), pseudo-random per CTA and stage, same mean.
  int skew_ns;
  float jitter;
};

// Per-CTA record: the consumer's clock64 and global timer at start and end, and the clocks the
// consumer spent waiting for full stages and the producer waiting for empty ones.
enum Stat { kClk0, kClk1, kNs0, kNs1, kConsumerWait, kProducerWait, kStats };

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// kAfter: spin, then free the stage. kBefore: free it, then spin (the spin holds no buffer).
// kLagged: free stage i-1 after the spin on stage i, as CUTLASS's consumer frees a stage only
// once the next stage's wgmma is issued and the previous one has retired (warpgroup_wait<1>).
enum Release { kAfter = 0, kBefore = 1, kLagged = 2 };

__device__ __forceinline__ unsigned smem_u32(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(x), "r"(y) : "memory");
}

__global__ void __launch_bounds__(64, 1) stream(const __grid_constant__ CUtensorMap a_map,
                                               const __grid_constant__ CUtensorMap b_map, Params p) {
  extern __shared__ unsigned char smem_raw[];
  // The 128-byte swizzle wants 1024-byte aligned boxes; the host asks for 1 KB of slack.
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ int stop[kMaxStages];  // set with a stage's arrival: no more data, the consumer leaves

  // This CTA's units [u0, u1): unit u is k-block (u % k_blocks) of M tile (u / k_blocks).
  long long total = 1LL * p.m_tiles * p.k_blocks, u0, u1;
  if (p.streamk) {
    u0 = total * blockIdx.x / gridDim.x;
    u1 = total * (blockIdx.x + 1) / gridDim.x;
  } else if (p.steal_tail > 0) {
    u0 = 1LL * blockIdx.x * p.k_blocks;
    u1 = blockIdx.x < p.m_tiles ? u0 + p.k_blocks - p.steal_tail : u0;
  } else {
    int m = blockIdx.x % p.m_tiles, s = blockIdx.x / p.m_tiles;
    u0 = 1LL * m * p.k_blocks + 1LL * p.k_blocks * s / p.splits;
    u1 = 1LL * m * p.k_blocks + 1LL * p.k_blocks * (s + 1) / p.splits;
  }
  const unsigned a_bytes = p.box_m * 128 * p.kb, b_bytes = p.with_b ? p.b_rows * 128 * p.kb : 0;

  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int n = int(u1 - u0);
  unsigned long long* stat = p.stats + size_t(blockIdx.x) * kStats;
  if (threadIdx.x == 0) {  // producer
    long long waited = 0;
    int i = 0;
    auto acquire = [&](int i) {  // stage i % stages, once the consumer has freed it
      int s = i % p.stages;
      if (i >= p.stages) {
        long long w0 = clock64();
        mbar_wait(&empty[s], ((i / p.stages) & 1) ^ 1);
        waited += clock64() - w0;
      }
      return s;
    };
    auto issue = [&](int i, long long u) {
      int s = acquire(i);
      stop[s] = 0;
      mbar_expect_tx(&full[s], a_bytes + b_bytes);
      int m = int(u / p.k_blocks), kblk = int(u % p.k_blocks);
      unsigned char* dst = smem + size_t(s) * p.stage_bytes;
      for (int j = 0; j < p.kb; ++j) {
        if (p.order == kGemm)
          tma_load(dst + j * p.box_m * 128, &a_map, &full[s], (kblk * p.kb + j) * 64, m * p.box_m);
        else  // the same bytes as one contiguous slab: the buffer seen as rows of 128 B
          tma_load(dst + j * p.box_m * 128, &a_map, &full[s], 0, int((u * p.kb + j) * p.box_m));
        if (p.with_b) tma_load(dst + a_bytes + j * p.b_rows * 128, &b_map, &full[s], (kblk * p.kb + j) * 64, 0);
      }
    };
    if (p.skew_ns > 0) {
      unsigned long long t0 = global_ns();
      while (global_ns() - t0 < unsigned(blockIdx.x % 16) * p.skew_ns) {
      }
    }
    for (; i < n; ++i) issue(i, u0 + i);
    if (p.steal_tail > 0) {
      const int per_tile = p.steal_tail / p.steal_chunk;
      for (;;) {
        int claim = int(atomicAdd(p.counter, 1u));
        if (claim >= p.m_tiles * per_tile) break;
        int m = claim % p.m_tiles, part = claim / p.m_tiles;
        long long first = 1LL * m * p.k_blocks + p.k_blocks - p.steal_tail + 1LL * part * p.steal_chunk;
        for (int c = 0; c < p.steal_chunk; ++c, ++i) issue(i, first + c);
      }
    }
    int s = acquire(i);  // the end: a stage that carries no data, only the stop flag
    stop[s] = 1;
    mbar_arrive(&full[s]);
    stat[kProducerWait] = waited;
  } else if (threadIdx.x == 32) {  // consumer
    stat[kClk0] = clock64();
    stat[kNs0] = global_ns();
    long long waited = 0;
    int i = 0;
    for (;; ++i) {
      int s = i % p.stages;
      long long w0 = clock64();
      mbar_wait(&full[s], (i / p.stages) & 1);
      waited += clock64() - w0;
      if (stop[s]) break;
      if (p.release == kBefore) mbar_arrive(&empty[s]);
      long long spin = p.consume;
      if (p.jitter > 0) {
        unsigned h = (blockIdx.x * 0x9E3779B9u) ^ (unsigned(i) * 0x85EBCA6Bu);
        h ^= h >> 15;
        h *= 0x2C1B3C6Du;
        h ^= h >> 12;
        spin = (long long)(p.consume * (1.0f + p.jitter * ((h & 0xffff) / 65535.0f - 0.5f)));
      }
      long long t0 = clock64();
      while (clock64() - t0 < spin) {
      }
      if (p.release == kAfter) mbar_arrive(&empty[s]);
      if (p.release == kLagged && i > 0) mbar_arrive(&empty[(i - 1) % p.stages]);
    }
    stat[kConsumerWait] = waited;
    stat[kClk1] = clock64();
    stat[kNs1] = global_ns();
  }
}

using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

CUtensorMap make_map(EncodeFn encode, void* base, uint64_t cols, uint64_t rows, uint32_t box_rows,
                     CUtensorMapL2promotion promo) {
  CUtensorMap map;
  cuuint64_t dims[2] = {cols, rows}, strides[1] = {cols * 2};
  cuuint32_t box[2] = {64, box_rows}, elem[2] = {1, 1};
  CHECK_CU(encode(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, base, dims, strides, box, elem,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return map;
}

struct Case {
  const char* note;
  int order, box_m, kb, stages, splits, streamk_ctas, with_b;
  long long consume;  // clocks per 128x128x64 block of wgmma work
  CUtensorMapL2promotion promo;
  int release = kAfter;
  int b_rows = 128;
  int steal_tail = 0, steal_chunk = 1;  // > 0: the dynamic tail, on one CTA per SM
  int skew_ns = 0;
  float jitter = 0;
  int b_valid = 128;  // rows of B that exist: fewer than b_rows leaves the rest of each box to
                      // TMA's out-of-bounds zero fill (a 128-row tile on a 64-row operand)
};

int main(int argc, char** argv) {
  const int rows = 16384, K = argc > 1 ? std::atoi(argv[1]) : 4096;
  // Every case walks K in whole 128-half k-blocks (TILE_K 128 and split-K 2 included), and TB/s
  // counts all of A: a K that leaves a remainder would time fewer bytes than it reports. The
  // dynamic tail hands out up to 16 k-blocks of 64 per tile: K >= 1024.
  if (K < 1024 || K % 256 != 0) {
    std::printf("K must be a multiple of 256, at least 1024; got %s\n", argc > 1 ? argv[1] : "?");
    return 2;
  }
  const std::string set = argc > 2 ? argv[2] : "base";
  if (set != "base" && set != "consumer" && set != "steal" && set != "desync" && set != "oob") {
    std::printf("unknown case set %s: base, consumer, steal, desync or oob\n", set.c_str());
    return 2;
  }
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  EncodeFn encode;
  cudaDriverEntryPointQueryResult q;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                         cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess) { std::printf("no cuTensorMapEncodeTiled\n"); return 1; }
  const size_t a_bytes = size_t(rows) * K * 2;
  void *a, *b;
  CHECK(cudaMalloc(&a, a_bytes));
  CHECK(cudaMalloc(&b, size_t(128) * K * 2));
  CHECK(cudaMemset(a, 0x3c, a_bytes));
  CHECK(cudaMemset(b, 0x3c, size_t(128) * K * 2));
  CHECK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));

  // 128x128x64 of wgmma per SM: 2*128*128*64 flop at ~3.7 kflop/clock (989 TFLOP/s / 132 SMs / 1.98 GHz).
  const long long W = 560;
  const auto P0 = CU_TENSOR_MAP_L2_PROMOTION_NONE, P128 = CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
             P256 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  std::vector<Case> cases = {
      {"contiguous slabs, 128 CTAs", kContiguous, 128, 1, 6, 1, 0, 0, 0, P128},
      {"contiguous slabs, stream-K over all SMs", kContiguous, 128, 1, 6, 1, sms, 0, 0, P128},
      {"GEMM order, 2 stages", kGemm, 128, 1, 2, 1, 0, 0, 0, P128},
      {"GEMM order, 4 stages", kGemm, 128, 1, 4, 1, 0, 0, 0, P128},
      {"GEMM order, 6 stages", kGemm, 128, 1, 6, 1, 0, 0, 0, P128},
      {"GEMM order, 12 stages", kGemm, 128, 1, 12, 1, 0, 0, 0, P128},
      {"GEMM order, 6 stages, promotion none", kGemm, 128, 1, 6, 1, 0, 0, 0, P0},
      {"GEMM order, 6 stages, promotion 256", kGemm, 128, 1, 6, 1, 0, 0, 0, P256},
      {"GEMM order, TILE_K 128, 3 stages", kGemm, 128, 2, 3, 1, 0, 0, 0, P128},
      {"GEMM order, TILE_K 128, 6 stages", kGemm, 128, 2, 6, 1, 0, 0, 0, P128},
      {"GEMM order, 6 st, stream-K over all SMs", kGemm, 128, 1, 6, 1, sms, 0, 0, P128},
      {"GEMM order, 64-row tiles (256 CTAs), 6 st", kGemm, 64, 1, 6, 1, 0, 0, 0, P128},
      {"GEMM order, split-K 2 (256 CTAs), 3 st", kGemm, 128, 1, 3, 2, 0, 0, 0, P128},
      {"+B from L2, 6 st", kGemm, 128, 1, 6, 1, 0, 1, 0, P128},
      {"+B, +wgmma time, 6 st (the GEMM's shape)", kGemm, 128, 1, 6, 1, 0, 1, W, P128},
      {"+B, +wgmma time, 4 st", kGemm, 128, 1, 4, 1, 0, 1, W, P128},
      {"+B, +wgmma time, 6 st, stream-K all SMs", kGemm, 128, 1, 6, 1, sms, 1, W, P128},
      {"+B, +wgmma time, TILE_K 128, 3 st", kGemm, 128, 2, 3, 1, 0, 1, W, P128},
      {"+wgmma time (no B), 12 st", kGemm, 128, 1, 12, 1, 0, 0, W, P128},
      {"+B, +wgmma x1.5, 6 st", kGemm, 128, 1, 6, 1, 0, 1, W * 3 / 2, P128},
  };
  // Set "consumer": when does the consumer's time stop hiding behind the stream?
  std::vector<Case> consumer = {
      {"+B, +wgmma, 6 st", kGemm, 128, 1, 6, 1, 0, 1, W, P128},
      {"+B, 6 st", kGemm, 128, 1, 6, 1, 0, 1, 0, P128},
      {"+B, +wgmma, 6 st, free before spin", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kBefore},
      {"+B, +wgmma, 6 st, lagged free (CUTLASS)", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kLagged},
      {"+B, +wgmma, 7 st, lagged free", kGemm, 128, 1, 7, 1, 0, 1, W, P128, kLagged},
      {"+B, +wgmma x0.5, 6 st", kGemm, 128, 1, 6, 1, 0, 1, W / 2, P128},
      {"+B, +wgmma x1.5, 6 st, free before spin", kGemm, 128, 1, 6, 1, 0, 1, W * 3 / 2, P128, kBefore},
      {"+B 64 rows, +wgmma/2, 6 st", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 64},
      {"+B 64 rows, +wgmma/2, 9 st", kGemm, 128, 1, 9, 1, 0, 1, W, P128, kAfter, 64},
      {"+wgmma (no B), 6 st", kGemm, 128, 1, 6, 1, 0, 0, W, P128},
      {"+wgmma (no B), 12 st", kGemm, 128, 1, 12, 1, 0, 0, W, P128},
      {"+wgmma (no B), 12 st, free before spin", kGemm, 128, 1, 12, 1, 0, 0, W, P128, kBefore},
      {"GEMM order, 6 stages", kGemm, 128, 1, 6, 1, 0, 0, 0, P128},
      {"+B, +wgmma, 6 st (again, last)", kGemm, 128, 1, 6, 1, 0, 1, W, P128},
  };
  // Set "steal": are the slowest CTAs the kernel's tail, and does handing out the last k-blocks
  // of every tile dynamically (to the 4 idle SMs and to whoever finishes first) shorten it?
  std::vector<Case> steal = {
      {"GEMM order, 6 st", kGemm, 128, 1, 6, 1, 0, 0, 0, P128},
      {"GEMM order, 6 st, steal tail 8 by 4", kGemm, 128, 1, 6, 1, 0, 0, 0, P128, kAfter, 128, 8, 4},
      {"+B, +wgmma, 6 st", kGemm, 128, 1, 6, 1, 0, 1, W, P128},
      {"+B, +wgmma, 6 st, stream-K all SMs", kGemm, 128, 1, 6, 1, sms, 1, W, P128},
      {"+B, +wgmma, 6 st, steal tail 4 by 4", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 4, 4},
      {"+B, +wgmma, 6 st, steal tail 8 by 8", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 8, 8},
      {"+B, +wgmma, 6 st, steal tail 8 by 4", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 8, 4},
      {"+B, +wgmma, 6 st, steal tail 8 by 2", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 8, 2},
      {"+B, +wgmma, 6 st, steal tail 16 by 4", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 16, 4},
      {"+B, +wgmma, 6 st (again, last)", kGemm, 128, 1, 6, 1, 0, 1, W, P128},
  };
  // Set "desync": do the CTAs fall into lockstep (all spinning, then all waiting) once they spin?
  std::vector<Case> desync = {
      {"+B, +wgmma, 6 st", kGemm, 128, 1, 6, 1, 0, 1, W, P128},
      {"+B, +wgmma, 6 st, start skew 16 x 100 ns", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 0, 1, 100},
      {"+B, +wgmma, 6 st, start skew 16 x 300 ns", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 0, 1, 300},
      {"+B, +wgmma, 6 st, spin jitter +-25%", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 0, 1, 0, 0.5f},
      {"+B, +wgmma, 6 st, spin jitter +-50%", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 0, 1, 0, 1.0f},
      {"+B, +wgmma, 6 st, skew 300 + jitter 50%", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 0, 1, 300, 1.0f},
      {"+B, 6 st", kGemm, 128, 1, 6, 1, 0, 1, 0, P128},
      {"+B, +wgmma x0.75, 6 st", kGemm, 128, 1, 6, 1, 0, 1, W * 3 / 4, P128},
      {"+B, +wgmma, 6 st (again, last)", kGemm, 128, 1, 6, 1, 0, 1, W, P128},
  };
  // Set "oob": does TMA's zero fill cost anything? (64x8192x4096's 128-row cooperative builds,
  // whose A has 64 rows, run 50% slower than its 64-row tiles: docs/decisions.)
  std::vector<Case> oob = {
      {"+B, 6 st", kGemm, 128, 1, 6, 1, 0, 1, 0, P128},
      {"+B box of 128 rows, 64 exist, 6 st", kGemm, 128, 1, 6, 1, 0, 1, 0, P128, kAfter, 128, 0, 1, 0, 0, 64},
      {"+B box of 64 rows, 6 st", kGemm, 128, 1, 6, 1, 0, 1, 0, P128, kAfter, 64},
      {"+B box of 128 rows, 64 exist, +wgmma, 6 st", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 128, 0, 1, 0, 0, 64},
      {"+B box of 64 rows, +wgmma/2, 6 st", kGemm, 128, 1, 6, 1, 0, 1, W, P128, kAfter, 64},
      {"+B, 6 st (again, last)", kGemm, 128, 1, 6, 1, 0, 1, 0, P128},
  };
  if (set == "oob") cases = oob;
  if (set == "desync") cases = desync;
  if (set == "consumer") cases = consumer;
  if (set == "steal") cases = steal;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::printf("A %d x %d fp16 (%.1f MB), %d SMs; 20 back-to-back launches per event pair, median of 5\n", rows, K,
              a_bytes / 1e6, sms);
  unsigned long long* stats;
  CHECK(cudaMalloc(&stats, size_t(4096) * kStats * 8));
  constexpr int kCounters = 1 << 16;  // one zeroed claim counter per launch
  unsigned* counters;
  CHECK(cudaMalloc(&counters, kCounters * sizeof(unsigned)));
  CHECK(cudaMemset(counters, 0, kCounters * sizeof(unsigned)));
  int launches = 0;
  std::printf("%-46s %5s %9s %8s %6s %7s %7s %8s %7s %7s\n", "case", "CTAs", "us", "TB/s", "GHz", "c.wait", "p.wait",
              "CTA us", "ends", "span");
  for (const Case& c : cases) {
    Params p{};
    p.box_m = c.box_m;
    p.kb = c.kb;
    p.m_tiles = rows / c.box_m;
    p.k_blocks = K / (64 * c.kb);
    p.splits = c.splits;
    p.streamk = c.streamk_ctas > 0;
    p.stages = c.stages;
    p.order = c.order;
    p.with_b = c.with_b;
    p.consume = c.consume * c.box_m / 128 * c.kb * c.b_rows / 128;
    p.release = c.release;
    p.b_rows = c.b_rows;
    p.stats = stats;
    p.steal_tail = c.steal_tail;
    p.steal_chunk = c.steal_chunk;
    p.skew_ns = c.skew_ns;
    p.jitter = c.jitter;
    CUtensorMap a_map = c.order == kGemm ? make_map(encode, a, K, rows, c.box_m, c.promo)
                                         : make_map(encode, a, 64, a_bytes / 128, c.box_m, c.promo);
    CUtensorMap b_map = make_map(encode, b, K, c.b_valid, c.b_rows, c.promo);
    int ctas = p.streamk ? c.streamk_ctas : c.steal_tail > 0 ? sms : p.m_tiles * c.splits;
    p.stage_bytes = ((c.box_m * 128 * c.kb + (c.with_b ? c.b_rows * 128 * c.kb : 0) + 1023) / 1024) * 1024;
    size_t smem = size_t(p.stage_bytes) * c.stages + 1024;
    if (smem > 226 * 1024) { std::printf("%-46s does not fit (%zu B)\n", c.note, smem); continue; }
    auto launch = [&] {
      if (launches == kCounters) { std::printf("out of claim counters\n"); std::exit(1); }
      p.counter = counters + launches++;
      stream<<<ctas, 64, smem>>>(a_map, b_map, p);
    };
    for (int i = 0; i < 3; ++i) launch();
    CHECK(cudaDeviceSynchronize());
    std::vector<float> per_launch;
    for (int g = 0; g < 5; ++g) {
      CHECK(cudaEventRecord(e0));
      for (int i = 0; i < 20; ++i) launch();
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      per_launch.push_back(ms * 1000.f / 20);
    }
    CHECK(cudaGetLastError());
    std::sort(per_launch.begin(), per_launch.end());
    float us = per_launch[2];
    // The last launch's per-CTA record: medians of the SM clock, of the share of its run the
    // consumer waited for data and the producer waited for a free stage, and the CTA's run time.
    std::vector<unsigned long long> st(size_t(ctas) * kStats);
    CHECK(cudaMemcpy(st.data(), stats, st.size() * 8, cudaMemcpyDeviceToHost));
    std::vector<double> ghz, cwait, pwait, cta_us;
    double first_start = 1e30, first_end = 1e30, last_end = 0;
    for (int b = 0; b < ctas; ++b) {
      const unsigned long long* r = &st[size_t(b) * kStats];
      double clk = double(r[kClk1] - r[kClk0]), ns = double(r[kNs1] - r[kNs0]);
      if (ns <= 0 || clk <= 0) continue;
      ghz.push_back(clk / ns);
      cwait.push_back(r[kConsumerWait] / clk);
      pwait.push_back(r[kProducerWait] / clk);
      cta_us.push_back(ns / 1e3);
      first_start = std::min(first_start, double(r[kNs0]));
      first_end = std::min(first_end, double(r[kNs1]));
      last_end = std::max(last_end, double(r[kNs1]));
    }
    auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v.empty() ? 0.0 : v[v.size() / 2]; };
    // ends: from the first CTA's end to the last's; span: first start to last end (us)
    std::printf("%-46s %5d %9.2f %8.2f %6.2f %6.0f%% %6.0f%% %8.2f %7.2f %7.2f\n", c.note, ctas, us, a_bytes / us / 1e6,
                median(ghz), 100 * median(cwait), 100 * median(pwait), median(cta_us), (last_end - first_end) / 1e3,
                (last_end - first_start) / 1e3);
  }
  return 0;
}
