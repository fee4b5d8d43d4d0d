"""The harness: what ``kvxferd demo``, ``kvxferd bench``, the benchmarks under ``bench/`` and
the tests share to drive real daemons and real NIXL agents.

* :mod:`.daemons` starts ``kvxferd serve`` processes (``127.0.0.1:0``, engine sockets in a
  temporary directory), waits for their ready files and always stops them (SIGTERM, then
  SIGKILL);
* :mod:`.client` plays the scheduler and the engine over the real gRPC API, on top of the
  public :mod:`kvxferd.client`: Describe, Hold, StartPull, one WatchTransfers stream for every
  pull, WatchReleases, Checksum; :mod:`.digests` turns Checksum answers into a verdict;
* :mod:`.puller` times one pull through two daemons (Hold, StartPull, terminal status, release);
* :mod:`.owner` is the separate owner process with a raw NIXL agent, driven over a pipe, and
  :mod:`.pattern` the byte pattern it fills and the per-block digests that check copies;
* :mod:`.naive` is the benchmark's baseline: one descriptor per (layer, block) between two
  processes with raw NIXL agents, on DRAM or VRAM;
* :mod:`.mix` builds the demo's request mix and allocates block IDs like an engine would
  (pure, seeded);
* :mod:`.demo` is ``kvxferd demo``'s scenario, with :mod:`.demo_pairs` (the daemons and the
  refusal), :mod:`.demo_pools` (the engines' block IDs) and :mod:`.demo_results` (the report);
  :mod:`.vllm_engines`, :mod:`.vllm_pair` and :mod:`.vllm_report` are ``--engine vllm``'s;
* :mod:`.bench_cells`, :mod:`.bench_local` and :mod:`.bench_daemons` are ``kvxferd bench``'s
  workload, results table and measuring phases;
* :mod:`.report` has the progress line, percentiles and plain-text tables;
* :mod:`.machine` says what a run ran on (CPU, GPUs, versions, transports).

Nothing here is imported by the daemon itself.
"""
