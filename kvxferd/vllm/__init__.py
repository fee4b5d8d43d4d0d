"""kvxferd beside vLLM: a KV connector (V1 API) backed by the local kvxferd daemon.

vLLM loads :class:`kvxferd.vllm.connector.KvxferdConnector` by module path (docs/vllm.md);
that module is the only one here that imports vLLM, so ``import kvxferd.vllm`` and its pure
parts work without it:

* :mod:`kvxferd.vllm.spec`: vLLM's ``KVCacheConfig`` -> a kvxferd spec and where each region
  sits in vLLM's backing buffer;
* :mod:`kvxferd.vllm.params`: the ``kv_transfer_params`` ticket and block pairing;
* :mod:`kvxferd.vllm.memory`: the KV allocation in shared memory the daemon imports (CPU);
* :mod:`kvxferd.vllm.tensors` and :mod:`kvxferd.vllm.gpu`: on a GPU, vLLM's own CUDA KV tensors
  described as a spec, exported over CUDA IPC and attached IMPORTED VRAM (KERNEL pulls);
* :mod:`kvxferd.vllm.host`: on the CPU, that allocation attached IMPORTED host memory at the
  worker's TP position;
* :mod:`kvxferd.vllm.worker` and :mod:`kvxferd.vllm.holds`: one worker rank's pulls and
  reports, and the scheduler's holds on every TP rank's daemon (one daemon per rank);
* :mod:`kvxferd.vllm.daemon`: the Engine and Scheduler calls to the local daemon;
* :mod:`kvxferd.vllm.engine_proc` and :mod:`kvxferd.vllm.tiny_model`: what
  ``kvxferd demo --engine vllm`` runs.
"""
