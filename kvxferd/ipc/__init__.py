"""Same-host pulls at memory speed: CUDA IPC mappings, the KERNEL strategy, transport truth.

When a reader and an owner run on one host with their pools in VRAM, NIXL/UCX would move each
descriptor with one copy-engine copy (or, on a GPU without NVLink and a default environment,
over TCP loopback: docs/nixl.md §7). Here the reader instead maps the owner's registered
regions over CUDA IPC and copies a whole pull with SM kernels in one launch.

* :mod:`.host`: host identity (who can open whose handles), GPU UUIDs, and the UCX
  environment the daemon sets before NIXL starts;
* :mod:`.publish`: the owner's CUDA IPC handles of its registered regions, as the handshake
  carries them (``HandshakePayload.cuda_ipc``), exported once per pool generation;
* :mod:`.mapping`: the reader's mappings of one peer generation, opened once, dropped when the
  peer's instance or generation changes, when the peer is invalidated (dead, restarted,
  evicted), when this daemon's pool goes away, or after they go unused;
* :mod:`.eligibility`: why a pull cannot be KERNEL (pure);
* :mod:`.reader`: :class:`~.reader.KernelReader`, the KERNEL pull (``pull() -> TransferResult``
  like :class:`~kvxferd.staging.reader.StagedReader`): bounds checked against the mapped sizes,
  one launch on a side stream, completion through a CUDA event: polled between event-loop turns
  for a small pull (:mod:`.completion`), waited on in a worker thread for a big one;
* :mod:`.transport`: which UCX transport serves READs from a peer (a timed probe READ at
  connect), and the refusal of a VRAM-to-VRAM link that runs at TCP speed.

Must not import: ``grpc``, :mod:`kvxferd.service`, :mod:`kvxferd.daemon` (the daemon calls
this package, never the reverse).
"""
