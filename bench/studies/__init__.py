"""One-off studies behind design decisions (run as ``python -m bench.studies.<name>``).

* :mod:`.attachment` (with :mod:`.cuda_vmm`): how an engine's KV memory reaches the daemon's
  NIXL agent (docs/attachment.md);
* :mod:`.gpu_staging` and :mod:`.gpu_nixl`: the staging kernels and the GPU descriptor schemes
  behind STAGED (docs/benchmarks.md);
* :mod:`.nixl_thread`: what a hand-off to the NIXL thread costs, and that a post releases the
  GIL (docs/nixl.md §1); ``copy_unroll.cu``: the KERNEL copy's loop with more bytes in flight
  per thread (docs/benchmarks.md, "Session 20").
"""
