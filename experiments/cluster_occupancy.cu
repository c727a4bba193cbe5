// How many thread-block clusters of each shape can be resident at once on this GPU, as the
// driver reports it (cudaOccupancyMaxActiveClusters), for a kernel that, like our cute_sm90
// builds, takes one CTA per SM (384 threads, ~209 KB of shared memory).
//
// Why: a cluster's CTAs must sit in one GPC, and the H100/H200 GPCs do not all have the same
// number of SMs, so 132 SMs need not hold 33 clusters of 4. A persistent GEMM whose tile count
// exceeds (resident clusters x cluster size) runs a second wave (docs/decisions).
//
//   nvcc -O2 -gencode arch=compute_90a,code=sm_90a -o /tmp/cluster_occ experiments/cluster_occupancy.cu
#include <cstdio>
#include <cuda_runtime.h>

__global__ void one_cta_per_sm() {}

int main() {
  int device = 0, sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);
  int const threads = 384;
  int const smem = 214016;  // the 64x256 pingpong 5-stage build's shared storage
  if (cudaFuncSetAttribute(one_cta_per_sm, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
      cudaFuncSetAttribute(one_cta_per_sm, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    std::printf("cudaFuncSetAttribute failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  std::printf("%s, %d SMs; %d threads, %d bytes of shared memory per CTA\n", prop.name, sms, threads, smem);
  std::printf("cluster  CTAs  resident clusters  resident CTAs  SMs left idle\n");
  int const shapes[][2] = {{1, 1}, {2, 1}, {1, 2}, {4, 1}, {2, 2}, {1, 4}, {8, 1}, {16, 1}};
  for (auto const& s : shapes) {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = s[0];
    attr.val.clusterDim.y = s[1];
    attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(s[0], s[1], 1);
    config.blockDim = dim3(threads, 1, 1);
    config.dynamicSmemBytes = smem;
    config.attrs = &attr;
    config.numAttrs = 1;
    int clusters = 0;
    cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, one_cta_per_sm, &config);
    int const size = s[0] * s[1];
    if (err != cudaSuccess) {
      std::printf("%2dx%-2d   %4d  error: %s\n", s[0], s[1], size, cudaGetErrorString(err));
      cudaGetLastError();
      continue;
    }
    std::printf("%2dx%-2d   %4d  %17d  %13d  %13d\n", s[0], s[1], size, clusters, clusters * size,
                sms - clusters * size);
  }
  return 0;
}
