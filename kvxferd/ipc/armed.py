"""Armed KERNEL launches: a pull's copy queued before its lease is confirmed, behind a gate.

A small KERNEL pull's host work is done while its lease confirmation is in flight
(:meth:`kvxferd.ipc.reader.KernelReader.ready`); with the gates it is also *launched* then. The
launch is queued on a stream of its own behind a wait for a word of pinned host memory (the
gate; ``cuda/gates.h``) and handed to a worker thread of the extension, so it costs the event
loop a few microseconds instead of the launch's 60-90 (docs/benchmarks.md, "Session 17"). At
the reader's one decision point (the confirmation succeeded, nothing cancelled the pull, the
owner's generation is the one the copy was built for) the daemon *opens* the gate: one store,
after which the GPU copies at once. On every other path it *aborts* it: the kernels still run,
read the gate, and return without reading a byte, so a pull that was refused never reads the
owner's blocks, exactly as when nothing had been launched.

:class:`Armed` is one armed pull; :class:`GateSlots` hands out a fixed number of slots (each a
gate, a stream and an event in the extension) and takes them back once their work has ended,
with the mappings the copy reads kept open until then. A pull finding no free slot is launched
after its confirmation, as before. On the CPU (tests, or no CUDA build) :class:`TwinGates` keeps
the same contract with the torch twin: an armed copy is run when its gate opens, dropped when
it is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvxferd.ipc.completion import wait_event
from kvxferd.kernels import BackendName, CheckedCopy, active_backend, run_copy
from kvxferd.logs import kv

log = logging.getLogger(__name__)

OPEN, ABORTED = 1, 2  # cuda/gates.h: kGateOpen, kGateAborted
# Pulls armed at once per reader: as many as commonly wait for their confirmation together; a
# pull finding none free launches after its confirmation.
ARMED_SLOTS = 4


class Gates(Protocol):
    """What the gates offer (``cuda/gates.h``; :class:`TwinGates`): ``arm`` queues a checked
    copy behind slot ``slot``'s closed gate ("" or why not), ``set`` opens or aborts it,
    ``poll`` says 1 once the slot's work ended, ``wait`` blocks until then, ``error`` says why
    an arming failed after it was accepted, ``close`` aborts everything and waits for it."""

    def slots(self) -> int: ...

    def arm(self, slot: int, copy: CheckedCopy, max_ctas: int) -> str: ...

    def set(self, slot: int, value: int) -> None: ...

    def poll(self, slot: int) -> int: ...

    def wait(self, slot: int) -> None: ...

    def error(self, slot: int) -> str: ...

    def close(self) -> None: ...


class CudaGates:
    """:class:`Gates` over the extension's ``Gates`` (``cuda/gates.cu``)."""

    def __init__(self, native: Any) -> None:
        self.native = native

    def slots(self) -> int:
        return int(self.native.slots())

    def arm(self, slot: int, copy: CheckedCopy, max_ctas: int) -> str:
        if not copy.cuda or copy.ranges is not None or not copy.groups:
            return "only grouped copies built for the CUDA kernels are armed"
        return str(
            self.native.arm(
                slot,
                [t.data_ptr() for t in copy.tables],  # copied before arm returns
                [t.numel() for t in copy.tables],
                [int(g.length.shape[0]) for g in copy.groups],
                [int(g.regions.shape[0]) for g in copy.groups],
                int(max_ctas),
            )
        )

    def set(self, slot: int, value: int) -> None:
        self.native.set(slot, value)

    def poll(self, slot: int) -> int:
        return int(self.native.poll(slot))

    def wait(self, slot: int) -> None:
        self.native.wait(slot)

    def error(self, slot: int) -> str:
        return str(self.native.error(slot))

    def close(self) -> None:
        self.native.close()


class TwinGates:
    """:class:`Gates` for the torch twin: an armed copy is kept, run when its gate opens and
    dropped when it is aborted; nothing runs in the background."""

    def __init__(self, slots: int = ARMED_SLOTS) -> None:
        self._n = slots
        self._armed: dict[int, CheckedCopy] = {}

    def slots(self) -> int:
        return self._n

    def arm(self, slot: int, copy: CheckedCopy, max_ctas: int) -> str:
        if slot in self._armed:
            return f"slot {slot} is still in use"
        self._armed[slot] = copy
        return ""

    def set(self, slot: int, value: int) -> None:
        copy = self._armed.pop(slot, None)
        if copy is not None and value == OPEN:
            run_copy(copy)

    def poll(self, slot: int) -> int:
        return 0 if slot in self._armed else 1

    def wait(self, slot: int) -> None:
        if slot in self._armed:
            raise RuntimeError(f"slot {slot} waits for its gate: open or abort it first")

    def error(self, slot: int) -> str:
        return ""

    def close(self) -> None:
        self._armed.clear()


class ArmedState(enum.Enum):
    ARMED = "armed"  # queued behind its closed gate
    OPEN = "open"  # the gate opened: the copy runs or ran
    ABORTED = "aborted"  # the gate was aborted: the kernels return without reading
    ENDED = "ended"  # its work ended and its slot and mappings went back


@dataclass(eq=False)
class Armed:
    """One armed pull: its slot, and the mappings its copy reads (``hold``, closed once the
    work ended). Polled like a CUDA event (:func:`kvxferd.ipc.completion.wait_event`)."""

    slots: GateSlots
    slot: int
    hold: contextlib.ExitStack
    state: ArmedState = ArmedState.ARMED

    def open(self) -> None:
        """Let the copy run (the decision point passed); no-op unless still armed."""
        if self.state is ArmedState.ARMED:
            self.state = ArmedState.OPEN
            self.slots.gates.set(self.slot, OPEN)

    def abort(self) -> None:
        """Make the kernels return without reading; no-op unless still armed."""
        if self.state is ArmedState.ARMED:
            self.state = ArmedState.ABORTED
            self.slots.gates.set(self.slot, ABORTED)

    def query(self) -> bool:
        return self.state is ArmedState.ENDED or self.slots.gates.poll(self.slot) == 1

    def synchronize(self) -> None:
        if self.state is ArmedState.ARMED:  # its gate is closed: the wait would never end
            raise RuntimeError("an armed pull was waited on before its gate opened or aborted")
        if self.state is not ArmedState.ENDED:
            self.slots.gates.wait(self.slot)

    @property
    def error(self) -> str:
        """Why the arming failed on the worker ("" when every launch was queued); its copy may
        not all have run then, and the pull copies again."""
        return self.slots.gates.error(self.slot)


@dataclass(eq=False)
class GateSlots:
    """A reader's slots: :meth:`arm` takes one, :meth:`finish` gives it back after its work
    ended, :meth:`reap` aborts one (unless opened) and finishes it once it ended."""

    gates: Gates
    _free: list[int] = field(default_factory=list)
    _live: set[Armed] = field(default_factory=set)
    _reaping: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._free = list(range(self.gates.slots()))

    @property
    def live(self) -> int:
        return len(self._live)

    def arm(self, copy: CheckedCopy, max_ctas: int, hold: contextlib.ExitStack) -> Armed | None:
        """Queue ``copy`` behind a closed gate; None (nothing queued, ``hold`` left to the
        caller) when no slot is free or the gates refused it."""
        if not self._free:
            return None
        slot = self._free.pop()
        why = self.gates.arm(slot, copy, max_ctas)
        if why:
            self._free.append(slot)
            log.debug("pull not armed", extra=kv(why=why))
            return None
        armed = Armed(self, slot, hold)
        self._live.add(armed)
        return armed

    def finish(self, armed: Armed) -> None:
        """Give back ``armed``'s slot and mappings; call once its work has ended."""
        if armed.state is ArmedState.ENDED:
            return
        armed.state = ArmedState.ENDED
        self._live.discard(armed)
        self._free.append(armed.slot)
        armed.hold.close()

    def reap(self, armed: Armed) -> None:
        """Abort ``armed`` unless its gate opened, and finish it once its work has ended: now
        when it already has, else in a task on the running loop."""
        if armed.state is ArmedState.ENDED:
            return
        armed.abort()
        if armed.query():
            self.finish(armed)
            return
        task = asyncio.get_running_loop().create_task(self._reap(armed))
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _reap(self, armed: Armed) -> None:
        await wait_event(armed)
        self.finish(armed)

    def close(self) -> None:
        """Abort every armed launch, wait for all of them (the extension's close) and give
        everything back."""
        for task in list(self._reaping):
            task.cancel()
        for armed in list(self._live):
            armed.abort()
        self.gates.close()
        for armed in list(self._live):
            self.finish(armed)


def gate_slots(device: torch.device, slots: int = ARMED_SLOTS) -> GateSlots | None:
    """The gates of a reader copying on ``device``: the extension's on a GPU with the CUDA
    kernels built, the twin's elsewhere; None (with a warning: pulls then launch after their
    confirmation) where the GPU's driver cannot queue the waits."""
    if device.type != "cuda" or active_backend().name is not BackendName.CUDA:
        return GateSlots(TwinGates(slots))
    from kvxferd.kernels.loader import cuda_module

    native = cuda_module().Gates(int(device.index or 0), slots)
    why = str(native.unusable())
    if why:
        log.warning("kernel pulls are not armed before their confirmation", extra=kv(why=why))
        return None
    return GateSlots(CudaGates(native))
