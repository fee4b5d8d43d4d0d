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
//
//   Gates(device: int, slots: int)
//
// the armed launches of gates.h: unusable() -> str, slots() -> int, arm(slot, tables, numels,
// runs, regions, max_ctas) -> str, set(slot, value), poll(slot) -> int, wait(slot) (releases
// the GIL), error(slot) -> str, close() (releases the GIL).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "gates.h"

namespace kvxferd {
std::string copy_group_raw(int64_t table, int64_t numel, int64_t n_runs, int64_t n_regions,
                           int64_t device, int64_t max_ctas, int64_t stream);
}  // namespace kvxferd

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvxferd's CUDA kernels: hot-path launches as plain functions";
  m.def("copy_group_raw", &kvxferd::copy_group_raw,
        "copy_group from a host table's address (see cuda/bindings.cpp)");
  py::class_<kvxferd::Gates>(m, "Gates", "armed KERNEL launches (see cuda/gates.h)")
      .def(py::init<int64_t, int64_t>())
      .def("unusable", &kvxferd::Gates::unusable)
      .def("slots", &kvxferd::Gates::slots)
      .def("arm", &kvxferd::Gates::arm)
      .def("set", &kvxferd::Gates::set)
      .def("poll", &kvxferd::Gates::poll)
      .def("wait", &kvxferd::Gates::wait, py::call_guard<py::gil_scoped_release>())
      .def("error", &kvxferd::Gates::error)
      .def("close", &kvxferd::Gates::close, py::call_guard<py::gil_scoped_release>());
}
