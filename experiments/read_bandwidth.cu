// Read-bandwidth ceiling for the skinny GEMM shapes (METHOD.md: measure the ceiling first).
//
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/read_bw experiments/read_bandwidth.cu && /tmp/read_bw
//
// A memory-bound GEMM streams its big operand once. How fast can the GPU read that many
// bytes, (a) contiguously, and (b) in the order a GEMM reads them: each CTA owns ROWS rows
// of a row-major matrix and walks along them in CHUNK-byte pieces (a TMA box of TILE_K
// halves is 2*TILE_K bytes per row), so the DRAM sees ROWS far-apart short runs at once?
// The answer says whether a skinny GEMM at ~3.3-3.5 TB/s is at the ceiling or has room,
// and whether longer runs per row (a wider TILE_K) should pay.
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); std::exit(1); } } while (0)

constexpr int kThreads = 256;
constexpr int kUnroll = 16;  // 16 x 16 B in flight per thread: 64 KB per CTA

// Grid-stride contiguous read, 16-byte loads, kUnroll loads in flight per thread.
__global__ void read_contig(const uint4* __restrict__ p, size_t n16, unsigned* sink) {
  unsigned acc = 0;
  size_t stride = size_t(gridDim.x) * kThreads;
  for (size_t base = size_t(blockIdx.x) * kThreads + threadIdx.x; base < n16; base += stride * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      size_t i = base + size_t(u) * stride;
      v[u] = i < n16 ? __ldg(p + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads alive; never true for our data
}

// GEMM-order read: CTA b owns rows [b*rows, (b+1)*rows) of a (total_rows x row_bytes)
// matrix and reads them chunk by chunk along the row (all its rows' chunk k, then k+1, ...).
__global__ void read_tiles(const char* __restrict__ p, int rows, size_t row_bytes, int chunk, unsigned* sink) {
  unsigned acc = 0;
  const int per_chunk = rows * chunk / 16;  // 16-byte pieces of one chunk-column of the tile
  const int vec_per_row = chunk / 16;
  const size_t n_chunks = row_bytes / chunk;
  const char* tile = p + size_t(blockIdx.x) * rows * row_bytes;
  const size_t total = n_chunks * per_chunk;  // pieces in this CTA's slab, in GEMM order
  for (size_t base = threadIdx.x; base < total; base += size_t(kThreads) * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      size_t i = base + size_t(u) * kThreads;
      if (i < total) {
        size_t k = i / per_chunk;
        int r = int(i % per_chunk) / vec_per_row, c = int(i % per_chunk) % vec_per_row;
        v[u] = __ldg(reinterpret_cast<const uint4*>(tile + size_t(r) * row_bytes + k * chunk) + c);
      } else {
        v[u] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

template <class Launch>
float median_us(Launch launch, int reps = 15) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.f);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t max_bytes = size_t(512) << 20;
  char* buf;
  unsigned* sink;
  CHECK(cudaMalloc(&buf, max_bytes));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(buf, 0x5a, max_bytes));
  // A 256 MB buffer written between timed launches would be the L2 flush; here every case
  // reads at least 64 MB (> 50 MB L2) once per launch, so a warm L2 can hold little of it.
  std::printf("SMs %d; median of 15 event-timed launches; GB/s = bytes read / time\n", sms);
  std::printf("%-62s %10s %10s\n", "case", "us", "GB/s");
  for (size_t mb : {64, 128, 512}) {
    size_t bytes = mb << 20;
    for (int blocks_per_sm : {2, 4}) {
      int grid = sms * blocks_per_sm;
      float us = median_us([&] { read_contig<<<grid, kThreads>>>(reinterpret_cast<uint4*>(buf), bytes / 16, sink); });
      char name[64];
      std::snprintf(name, sizeof name, "contig %zu MB, %d CTAs", mb, grid);
      std::printf("%-62s %10.2f %10.0f\n", name, us, bytes / us / 1e3);
    }
  }
  // The skinny shapes' big operands: 64x8192x4096 reads B = 8192 x 8 KB (64 MB);
  // 16384x128x4096 reads A = 16384 x 8 KB (128 MB); 128x16384x16384 reads B = 16384 x 32 KB (512 MB).
  struct Case { int total_rows; size_t row_bytes; int rows_per_cta; };
  for (Case c : {Case{8192, 8192, 128}, Case{8192, 8192, 64}, Case{16384, 8192, 128}, Case{16384, 32768, 128},
                 Case{16384, 32768, 256}}) {
    for (int chunk : {128, 256, 512}) {
      int grid = c.total_rows / c.rows_per_cta;
      size_t bytes = size_t(c.total_rows) * c.row_bytes;
      float us = median_us([&] { read_tiles<<<grid, kThreads>>>(buf, c.rows_per_cta, c.row_bytes, chunk, sink); });
      char name[96];
      std::snprintf(name, sizeof name, "tiles %dx%zuB, %d rows/CTA (%d CTAs), %d B runs", c.total_rows, c.row_bytes,
                    c.rows_per_cta, grid, chunk);
      std::printf("%-62s %10.2f %10.0f\n", name, us, bytes / us / 1e3);
    }
  }
  CHECK(cudaFree(buf));
  return 0;
}
