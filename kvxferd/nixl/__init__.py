"""NIXL adapter: the only package in kvxferd that imports ``nixl``.

Owns: creating one NIXL agent per daemon on one dedicated thread (with the CUDA device set on
that thread when one is given, since UCX disables cuda_ipc on a thread without a CUDA context),
registering regions, metadata exchange, posting/polling/releasing transfers, notifications,
telemetry, and translating NIXL's strings, ``None`` returns and exceptions into
:mod:`kvxferd.nixl.types` enums and :mod:`kvxferd.errors`.

Must not import: ``grpc``, ``kvxferd.service``, ``kvxferd.transfer`` (transfer depends on this
package, never the reverse). It knows nothing about blocks, plans or leases.

Progress (the idle CPU spin trap), measured on the 2-core CPU dev machine with
``bench/idle_cpu.py`` (one agent, one region registered, one remote loaded, 2 s of
``/proc/self/stat``):

==================================  =================
mode                                 idle CPU of agent
==================================  =================
progress thread, wrapper default     100 % (delay 0: a busy spin)
progress thread, delay 100 us        see ``IDLE_CPU`` below / docs/benchmarks.md
no progress thread, polled 5 ms      see ``IDLE_CPU`` below / docs/benchmarks.md
==================================  =================

Choice: :attr:`ProgressMode.THREAD` with ``progress_delay_us=100`` (set through the raw
binding's ``nixlAgentConfig.pthrDelay``, which the Python wrapper hard-codes to 0). Reasons:
the progress thread is C++ and needs no GIL, so an owner whose Python side is busy (gRPC,
registration, a long NIXL call on the NIXL thread) still serves READs: the "target that never
progresses" trap cannot bite an owner that is alive. ``ProgressMode.POLL`` (no progress thread,
the NIXL thread progresses the worker in every poll) costs about the same idle CPU but an owner
blocked in Python then stalls its readers. Neither mode helps against a *stopped* peer
(SIGSTOP): a READ then stays in progress, which is why the transfer engine enforces deadlines
and releases the handle.
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
