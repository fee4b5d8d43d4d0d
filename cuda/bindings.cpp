// The extension's Python module (kvxferd.kernels.loader imports it): launches a KERNEL pull
// makes on its hot path, bound as plain functions. The same work is registered as torch ops
// (copy_ranges.cu, staging.cu); an op call goes through the dispatcher (its schema, boxed
// arguments, dispatch keys), which costs ~2 us warm but 15-50 us with the CPU caches cold for
// it, as a daemon's are by the time a pull launches (docs/benchmarks.md, "Session 16"). A call
// here converts a few integers.
//
//   copy_group_raw(table: int, numel: int, n_runs: int, n_regions: int, device: int,
//                  max_ctas: int, stream: int) -> str
//
// is copy_group (copy_ranges.cu) with the table given as the address of its `numel` int64
// values in host memory (a contiguous CPU tensor's data_ptr(), kept alive by the caller for the
// call) and the device as an index; "" on success or the message, as the op returns.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace kvxferd {
std::string copy_group_raw(int64_t table, int64_t numel, int64_t n_runs, int64_t n_regions,
                           int64_t device, int64_t max_ctas, int64_t stream);
}  // namespace kvxferd

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvxferd's CUDA kernels: hot-path launches as plain functions";
  m.def("copy_group_raw", &kvxferd::copy_group_raw,
        "copy_group from a host table's address (see cuda/bindings.cpp)");
}
