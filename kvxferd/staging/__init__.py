"""The STAGED strategy: one staging ring per daemon, owner-side gathers, the reader pipeline.

Owns: the ring geometry and chunking (:mod:`.chunks`, pure), the ring buffer and its free slots
(:mod:`.ring`), the owner side that gathers leased blocks into granted slots and takes slots
back from readers that die (:mod:`.owner`), the reader pipeline that gathers, READs and
scatters chunk by chunk (:mod:`.reader`), and the per-pull decision and its wiring
(:mod:`.setup`). The cost model lives in :mod:`kvxferd.staging.strategy` (pure).

Must not import: ``nixl`` (NIXL work goes through :class:`kvxferd.transfer.TransferEngine`),
:mod:`kvxferd.service`, :mod:`kvxferd.daemon` (the daemon calls this package, not the reverse).
This ``__init__`` imports nothing, so the pure modules stay cheap to import.
"""
