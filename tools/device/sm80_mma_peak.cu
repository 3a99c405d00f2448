// Ceilings for the sm80 GEMM path's inner loop on the GPU at hand (issue 6; tools/bench/NOTES.md).
//
// Build and run on the device:  nvcc -O3 -gencode=arch=compute_80,code=sm_90 -o /tmp/mma_peak \
//                                 tools/device/sm80_mma_peak.cu && /tmp/mma_peak
//
// Each warp owns a 64×64 fp32 accumulator tile (32 m16n8 tiles, 128 registers a thread) like the
// schedule in tvmfuse/rules/gemm_sm80.py, blocks of 4 warps, 2 blocks per SM, no global
// memory in the loop. Two kernels:
//   hmma: per k16 step 32 × mma.sync.m16n8k16 (f32 += f16·f16) on register fragments: the
//         mma.sync issue ceiling.
//   ldsm: the same plus the 8 ldmatrix.x4 a 64×64 warp tile needs per k16 step (4 for A, 4 for
//         B), double-buffered like the schedule, from a padded (72-half rows) shared tile: the
//         ceiling of the GEMM's inner loop without global loads and barriers.
// Prints TFLOP/s = 2·16·8·16 FLOPs per mma × count / time (CUDA events, best of 5).
#include <cstdio>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void ldsm_x4(unsigned* r, const half* p) {
  unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 64×64 warp tile: 4 m16 × 8 n8 accumulators.
__global__ void __launch_bounds__(128, 2) hmma(float* out, int iters) {
  float acc[4][8][4] = {};
  unsigned a[4][4], b[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      a[i][j] = threadIdx.x * 131 + i * 7 + j;
      b[i][j] = threadIdx.x * 17 + i * 5 + j;
    }
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) mma16816(acc[i][j], a[i], &b[j / 2][(j % 2) * 2]);
  }
  float s = 0.f;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 8; ++j)
      for (int q = 0; q < 4; ++q) s += acc[i][j][q];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

constexpr int ROW = 72;  // halves per shared row: 64 + 8 padding, as the schedule
__global__ void __launch_bounds__(128, 2) ldsm(float* out, int iters) {
  extern __shared__ half smem[];  // per warp: A 64 rows, B 64 rows, 64 + 8 halves each
  half* a_s = smem + (threadIdx.x / 32) * 2 * 64 * ROW;
  half* b_s = a_s + 64 * ROW;
  for (int i = threadIdx.x % 32; i < 2 * 64 * ROW; i += 32)
    a_s[i] = __float2half(0.001f * (i % 13));
  __syncwarp();
  int lane = threadIdx.x % 32;
  // ldmatrix.x4 row addresses: lanes 0-15 rows 0-15 at k 0, lanes 16-31 rows 0-15 at k 8.
  const half* a_row = a_s + (lane % 16) * ROW + (lane / 16) * 8;
  const half* b_row = b_s + (lane % 16) * ROW + (lane / 16) * 8;
  float acc[4][8][4] = {};
  unsigned a[2][4][4], b[2][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    ldsm_x4(a[0][i], a_row + i * 16 * ROW);
    ldsm_x4(b[0][i], b_row + i * 16 * ROW);
  }
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // four k16 steps of a 64-wide K tile
      int cur = k % 2, nxt = 1 - cur, kn = ((k + 1) % 4) * 16;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        ldsm_x4(a[nxt][i], a_row + i * 16 * ROW + kn);
        ldsm_x4(b[nxt][i], b_row + i * 16 * ROW + kn);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) mma16816(acc[i][j], a[cur][i], &b[cur][j / 2][(j % 2) * 2]);
    }
  }
  float s = 0.f;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 8; ++j)
      for (int q = 0; q < 4; ++q) s += acc[i][j][q];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int blocks = sms * 2, threads = 128;
  const size_t smem = 4 * 2 * 64 * ROW * sizeof(half);
  CHECK(cudaFuncSetAttribute(ldsm, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  float* out;
  CHECK(cudaMalloc(&out, blocks * threads * sizeof(float)));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  printf("%s, %d SMs\n", prop.name, sms);
  for (int which = 0; which < 2; ++which) {
    // hmma: 32 mma per iteration; ldsm: 4 k16 steps × 32 mma per iteration.
    const int iters = which == 0 ? 40000 : 10000;
    const double mmas = double(blocks) * (threads / 32) * iters * 32 * (which == 0 ? 1 : 4);
    float best = 1e30f;
    for (int rep = 0; rep < 6; ++rep) {
      CHECK(cudaEventRecord(t0));
      if (which == 0)
        hmma<<<blocks, threads>>>(out, iters);
      else
        ldsm<<<blocks, threads, smem>>>(out, iters);
      CHECK(cudaEventRecord(t1));
      CHECK(cudaEventSynchronize(t1));
      CHECK(cudaGetLastError());
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, t0, t1));
      if (rep > 0 && ms < best) best = ms;  // rep 0 warms up
    }
    printf("%-5s %d blocks x 4 warps (2 blocks/SM), 64x64 warp tile: %.3f ms, %.1f TFLOP/s\n",
           which == 0 ? "hmma" : "ldsm", blocks, best, mmas * 4096.0 / best / 1e9);
  }
  return 0;
}
