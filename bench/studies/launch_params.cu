// How long cudaLaunchKernel takes on the host for a kernel whose parameter is a 3,840-byte
// struct (copy_group_inline_kernel's table, cuda/copy_ranges.cu) against an 8-byte one, and
// how long cudaEventRecord / cudaEventQuery take (session 16's question: the launch of a
// 16-block KERNEL pull's copy takes ~70 us in the daemon). Build and run on the GPU machine:
//   nvcc -O2 -arch=sm_90 -o /tmp/launch_params bench/studies/launch_params.cu && /tmp/launch_params
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

struct Big { int64_t v[480]; };

__global__ void big_kernel(const __grid_constant__ Big b, int64_t* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && b.v[7] == -1) out[0] = 1;
}
__global__ void small_kernel(const int64_t* table, int64_t* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && table == nullptr) out[0] = 1;
}

template <typename F>
double per_call_us(F f, int n) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
}

int main() {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  int64_t* out;
  cudaMalloc(&out, 64);
  Big b{};
  for (int i = 0; i < 480; ++i) b.v[i] = i;
  cudaEvent_t ev;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  for (int round = 0; round < 3; ++round) {
    double big = 0, small = 0, rec = 0, query = 0, sync_big = 0, sync_small = 0;
    const int n = 200;
    for (int k = 0; k < 5; ++k) {
      big += per_call_us([&] { big_kernel<<<64, 256, 0, s>>>(b, out); }, n);
      cudaStreamSynchronize(s);
      small += per_call_us([&] { small_kernel<<<64, 256, 0, s>>>(out, out); }, n);
      cudaStreamSynchronize(s);
      rec += per_call_us([&] { cudaEventRecord(ev, s); }, n);
      query += per_call_us([&] { cudaEventQuery(ev); }, n);
      cudaStreamSynchronize(s);
      // One launch on an idle stream, as a pull does (the queue empty before it).
      sync_big += per_call_us([&] { big_kernel<<<64, 256, 0, s>>>(b, out); cudaStreamSynchronize(s); }, 50);
      sync_small += per_call_us([&] { small_kernel<<<64, 256, 0, s>>>(out, out); cudaStreamSynchronize(s); }, 50);
    }
    std::printf("round %d: launch, 3840-byte param %.2f us; 8-byte param %.2f us; event record %.2f us;"
                " query %.2f us; launch+sync on an idle stream: big %.2f us, small %.2f us\n",
                round, big / 5, small / 5, rec / 5, query / 5, sync_big / 5, sync_small / 5);
  }
  std::printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
