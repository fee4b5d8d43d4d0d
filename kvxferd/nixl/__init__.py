"""NIXL adapter: the only package in kvxferd that imports ``nixl``.

Owns: creating one NIXL agent per daemon on one dedicated thread (with the CUDA device set on
that thread when one is given, since UCX disables cuda_ipc on a thread without a CUDA context),
registering regions, metadata exchange, posting/polling/releasing transfers, notifications,
telemetry, and translating NIXL's strings, ``None`` returns and exceptions into
:mod:`kvxferd.nixl.types` enums and :mod:`kvxferd.errors`.

Must not import: ``grpc``, ``kvxferd.service``, ``kvxferd.transfer`` (transfer depends on this
package, never the reverse). It knows nothing about blocks, plans or leases.

The NIXL and UCX behaviour this package is built around (polling, stalled and restarted peers,
descriptor cost, transports) is summarised in docs/nixl.md.

Progress (the idle CPU spin trap, docs/nixl.md §2), measured with ``python -m bench.idle_cpu``
on the 2-core CPU dev machine (one agent, one region registered, one live peer loaded, 2 s of
/proc/self/stat):

==================================================  ==================
mode                                                idle CPU of agent
==================================================  ==================
progress thread, delay 0 (NIXL's Python default)    101 % of a core
progress thread, delay 100 us (kvxferd default)     4.0 %
progress thread, delay 1000 us                      3.5 %
no progress thread, NIXL thread polls every 5 ms    1.5 %
no progress thread, NIXL thread polls every 1 ms    5.0 %
==================================================  ==================

Choice: :attr:`ProgressMode.THREAD` with ``progress_delay_us=100``, set through the raw
binding's ``nixlAgentConfig.pthrDelay`` (the Python wrapper hard-codes 0; kvxferd swaps the
wrapper's binding module for a proxy only while constructing, under a lock). Reasons: the
progress thread is C++ and needs no GIL, so an owner whose Python side is busy (gRPC, a long
registration on the NIXL thread) still serves its readers: the "target that never progresses"
trap cannot bite a live owner. ``ProgressMode.POLL`` (no progress thread; the NIXL thread drains
notifications, which progresses the worker, every ``idle_poll_s``) is slightly cheaper when idle
but an owner blocked in Python then stalls every reader. Neither mode helps against a *stopped*
peer: on CPU loopback a READ whose connection the stopped owner never finished stays in progress
forever (large CMA reads of an already connected peer still complete: the kernel serves them),
so the transfer engine enforces deadlines and releases the handle.

Descriptor strategy (``python -m bench.descriptors``, random 64 KiB blocks, 2-core CPU): building
a request per call (``initialize_xfer`` from N x 3 arrays) costs 0.06 ms at 16 descriptors,
0.38 ms at 1,024 and 6.5 ms at 16,384; ``make_prepped_xfer`` on per-block lists prepared once
costs 0.013 / 0.054 / 0.52 ms, but needs lists of every (layer, block) of the pool per side
(memory growing with blocks x layers, re-prepared at every re-handshake). Posting and moving the
data dominate either way (0.3 ms at 16, 34 ms at 1,024, 380-440 ms at 16,384 descriptors), so
kvxferd builds each request from arrays (work proportional to the request) and coalesces
ranges before posting, which removes far more than the creation difference.
"""

from kvxferd.nixl.agent import AgentOptions, NixlAgent, Registration, XferHandle
from kvxferd.nixl.types import MemType, ProgressMode, XferOp, XferState, XferTelemetry

__all__ = [
    "AgentOptions",
    "MemType",
    "NixlAgent",
    "ProgressMode",
    "Registration",
    "XferHandle",
    "XferOp",
    "XferState",
    "XferTelemetry",
]
