"""The one thread every NIXL call runs on: a single-worker executor with poll hooks.

NIXL agents are not thread-safe without the listener's locking, and UCX only enables its
cuda_ipc transport on a thread that holds a CUDA context, so every call goes through
:meth:`NixlThread.submit` (or :meth:`NixlThread.call`, which runs inline when already on the
thread). Between tasks the thread runs its *pollers*: callables that check in-flight transfers
and notifications and return how long they are willing to wait before the next poll (``None``:
no preference). The wait is therefore adaptive: short while transfers are in flight, long when
idle, and cut short whenever a task is submitted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvxferd.errors import TransportError
from kvxferd.logs import kv

log = logging.getLogger(__name__)

T = TypeVar("T")
Poller = Callable[[], "float | None"]

_STOP = object()
_WAKE = object()  # wake(): no task, only the pollers' run


class NixlThread:
    """A dedicated thread with a task queue and poll hooks; starts nothing until :meth:`start`."""

    def __init__(
        self,
        name: str,
        *,
        cuda_device: int | None = None,
        idle_wait_s: float = 0.005,
    ) -> None:
        self._name = name
        self._cuda_device = cuda_device
        self._idle_wait_s = idle_wait_s
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pollers: list[Poller] = []
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    @property
    def on_thread(self) -> bool:
        return threading.get_ident() == self._ident

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            raise TransportError(f"NIXL thread {self._name} already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise TransportError(
                f"NIXL thread {self._name} failed to start: {self._start_error}",
                fix="check the CUDA device index and that torch sees a GPU",
            ) from self._start_error

    def add_poller(self, poller: Poller) -> None:
        """Run ``poller`` on the thread after every batch of tasks and every wait."""
        self.call(self._pollers.append, poller)

    def remove_poller(self, poller: Poller) -> None:
        def _remove() -> None:
            if poller in self._pollers:
                self._pollers.remove(poller)

        self.call(_remove)

    def wake(self) -> None:
        """Cut the thread's wait short: its pollers run now and say how long to wait next
        (any thread; one queue put, no future)."""
        self._queue.put(_WAKE)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)`` on the thread; the future can be awaited via asyncio.wrap_future."""
        fut: Future[T] = Future()
        if not self.running:
            fut.set_exception(
                TransportError(
                    f"NIXL thread {self._name} is not running",
                    fix="call NixlAgent.start() first (and not after close())",
                )
            )
            return fut
        self._queue.put((fut, fn, args))
        return fut

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread and wait for it (inline when already on it)."""
        if self.on_thread or self._thread is None:
            # Before start() nothing runs concurrently, so inline is safe as well.
            return fn(*args)
        return self.submit(fn, *args).result()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._thread is None:
            return
        if self.on_thread:
            raise TransportError("NixlThread.stop() called from the NIXL thread itself")
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error(
                "NIXL thread did not stop in time",
                extra=kv(thread=self._name, timeout_s=timeout_s),
            )

    def _run(self) -> None:
        self._ident = threading.get_ident()
        try:
            if self._cuda_device is not None:
                import torch

                torch.cuda.set_device(self._cuda_device)
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        wait = self._idle_wait_s
        while True:
            try:
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    self._fail_pending()
                    return
                if item is not _WAKE:
                    fut, fn, args = item
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn(*args))
                        except BaseException as exc:
                            fut.set_exception(exc)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            wait = self._poll()

    def _poll(self) -> float:
        wait = self._idle_wait_s
        for poller in list(self._pollers):
            try:
                want = poller()
            except Exception:
                log.exception("NIXL poller failed", extra=kv(thread=self._name))
                continue
            if want is not None:
                wait = min(wait, want)
        return max(wait, 0.0)

    def _fail_pending(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is _STOP or item is _WAKE:
                continue
            fut = item[0]
            if fut.set_running_or_notify_cancel():
                fut.set_exception(TransportError(f"NIXL thread {self._name} stopped"))
