"""One-off studies behind design decisions (run as ``python -m bench.studies.<name>``).

* :mod:`.attachment` (with :mod:`.cuda_vmm`): how an engine's KV memory reaches the daemon's
  NIXL agent (docs/attachment.md);
* :mod:`.gpu_staging` and :mod:`.gpu_nixl`: the staging kernels and the GPU descriptor schemes
  behind STAGED (docs/benchmarks.md).
"""
