"""Scenarios that drive real daemons: what ``kvxferd demo`` and ``kvxferd bench`` share.

* :mod:`.daemons` starts ``kvxferd serve`` processes (``127.0.0.1:0``, engine sockets in a
  temporary directory), waits for their ready files and always stops them (SIGTERM, then
  SIGKILL);
* :mod:`.client` plays the scheduler and the engine over the real gRPC API: Describe, Hold,
  StartPull, one WatchTransfers stream for every pull, WatchReleases, Checksum;
* :mod:`.mix` builds the demo's request mix and allocates block IDs like an engine would
  (pure, seeded);
* :mod:`.report` has the progress line, percentiles and plain-text tables;
* :mod:`.machine` says what a run ran on (CPU, GPUs, versions, transports);
* :mod:`.naive` is the benchmark's baseline: two processes with raw NIXL agents posting one
  descriptor per (layer, block), as :mod:`bench.dataplane` does, on DRAM or VRAM.

Nothing here is imported by the daemon itself.
"""
