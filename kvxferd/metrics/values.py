"""Label values every enum-labelled series starts with (at zero), and histogram buckets."""

from __future__ import annotations

DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
DESC_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
BYTES_BUCKETS = tuple(float(1 << s) for s in range(16, 36, 2))
CHUNK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
STAGE_BUCKETS = (
    10e-6,
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
# Per peer: few buckets (each is one series per peer).
PEER_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10)

TERMINAL_STATES = ("DONE", "FAILED", "CANCELLED", "EXPIRED")
ACTIVE_STATES = ("PENDING", "HANDSHAKING", "CONFIRMING", "TRANSFERRING")
"""Pulls not yet terminal: waiting (the first three: the peer's handshake, the lease
confirmation) or running (TRANSFERRING: READs posted)."""
LINK_STATES = ("NEW", "HANDSHAKING", "READY", "REFUSED", "UNREACHABLE", "STALE")
STRATEGIES = ("DIRECT", "STAGED", "KERNEL", "CMA")
PULL_STAGES = (
    "decode",
    "handshake",
    "plan",
    "build",
    "confirm",
    "post",
    "transfer",
    "publish",
    "notify",
)
"""A pull's stages in order (TransferStatus.stages; ``notify``, from the terminal status to its
WatchTransfers message, is only in the metric: the status is sent before it ends)."""
STAGED_STAGES = (
    "gather",
    "gather_rpc",
    "read",
    "scatter",
    "slot_wait",
    "control",
    "owner_start",
    "owner_slot_wait",
)
"""A STAGED pull's stages (StageTimes); the last three are observed only for pulls over a
Peer.Stage stream (StageTimes.stream)."""
RELEASE_REASONS = ("DONE", "EXPIRED", "CANCELLED", "ENGINE_DETACHED")
NOTIFICATION_RESULTS = ("counted", "stray", "undecodable")
DETACH_CAUSES = ("detach", "session", "no_session", "shutdown")
HANDSHAKE_RESULTS = {"client": ("ok", "refused", "failed"), "server": ("ok", "refused")}
