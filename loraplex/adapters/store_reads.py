"""Background reads of stored adapters into host memory: the store -> host move.

A read re-reads and re-validates an adapter's stored files on a loader thread (a slow
disk never holds the manager's lock); its result waits in a future until the manager
collects it into the host cache on its next call. A failed read is kept per version and
raised once, to the next caller that asks for that adapter (``take_error``).

Not thread-safe on its own: the ``AdapterManager`` calls every method under its lock,
except ``read`` (the loader threads' job, which touches no state here).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from loraplex.adapters.host_cache import HostAdapterCache
from loraplex.adapters.peft_weights import AdapterWeights
from loraplex.adapters.registry import AdapterEntry
from loraplex.adapters.spec import BaseModelSpec
from loraplex.adapters.store import AdapterStore

logger = logging.getLogger(__name__)


class StoreReads:
    """The reads in flight from the adapter store, and the errors of those that failed."""

    def __init__(
        self,
        store: AdapterStore,
        spec: BaseModelSpec,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        num_threads: int,
    ) -> None:
        self._store = store
        self._spec = spec
        self._max_lora_rank = max_lora_rank
        self._dtype = dtype
        self._device = device
        self._num_threads = num_threads
        self._futures: dict[str, Future[AdapterWeights]] = {}  # version -> read in flight
        self._errors: dict[str, BaseException] = {}  # version -> failed read, not raised yet
        self._executor: ThreadPoolExecutor | None = None  # started by the first read
        self.num_reads = 0
        """Adapters read from the store into host memory since start-up (host-cache misses)."""

    @property
    def num_in_flight(self) -> int:
        """Reads queued or running."""
        return len(self._futures)

    def in_flight(self, version: str) -> bool:
        """Whether a read of ``version`` is queued or running."""
        return version in self._futures

    def failed(self, version: str) -> bool:
        """Whether a read of ``version`` failed and nobody was told yet."""
        return version in self._errors

    def take_error(self, version: str) -> BaseException | None:
        """The failed read of ``version`` (forgotten once taken), or None."""
        return self._errors.pop(version, None)

    def forget(self, version: str) -> None:
        """Drop what is known of ``version``'s reads (its adapter was removed)."""
        self._errors.pop(version, None)

    def pin(self, weights: AdapterWeights) -> AdapterWeights:
        """Weights in page-locked memory where the device is CUDA (its copies then overlap)."""
        if self._device.type == "cuda" and torch.cuda.is_available():
            return weights.pin_memory()
        return weights

    def read(self, entry: AdapterEntry) -> AdapterWeights:
        """Re-read and re-validate ``entry``'s stored files (any thread; no state touched)."""
        parsed = self._store.load(
            entry.folder, self._spec, self._max_lora_rank, self._dtype, entry.identity.version
        )
        return self.pin(parsed.weights)

    def submit(self, entry: AdapterEntry) -> None:
        """Queue a background read of ``entry`` (no-op if one is in flight)."""
        version = entry.identity.version
        if version in self._futures:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._num_threads, thread_name_prefix="adapter-loader")
        self._futures[version] = self._executor.submit(self.read, entry)
        logger.debug("prefetching adapter %d from %s", entry.identity.adapter_id, entry.folder)

    def cancel_except(self, wanted: Collection[str]) -> int:
        """Cancel the reads still queued for versions not in ``wanted``; how many were."""
        cancelled = [v for v, f in self._futures.items() if v not in wanted and f.cancel()]
        for version in cancelled:
            del self._futures[version]
        return len(cancelled)

    def collect(self, host: HostAdapterCache, live_versions: Collection[str]) -> int:
        """Move finished reads into ``host``; keep the errors; drop reads of removed adapters.
        How many reads finished (news for a waiting request, a failure too)."""
        finished = 0
        for version, future in list(self._futures.items()):
            if not future.done():
                continue
            del self._futures[version]
            finished += 1
            if version not in live_versions:
                continue  # removed while loading
            error = future.exception()
            if error is not None:
                logger.warning("background load of adapter version %s failed: %s", version[:12], error)
                self._errors[version] = error
            else:
                host.put(version, future.result())
                self.num_reads += 1
        return finished

    def pending(self) -> list[Future[AdapterWeights]]:
        """The reads in flight (to wait on without the manager's lock)."""
        return list(self._futures.values())

    @staticmethod
    def wait_any(pending: list[Future[AdapterWeights]], timeout: float) -> bool:
        """Block until one of ``pending`` finishes, at most ``timeout`` seconds; True if one did."""
        if not pending:
            return False
        done, _ = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        return bool(done)

    def read_now(self, entry: AdapterEntry) -> AdapterWeights:
        """``entry``'s weights at once: the read in flight's result, else a read on this thread.

        Raises what the read raised. The loader threads never take the manager's lock, so
        the manager may wait here holding it.
        """
        version = entry.identity.version
        future = self._futures.pop(version, None)
        weights = future.result() if future is not None else self.read(entry)
        self.num_reads += 1
        self._errors.pop(version, None)
        return weights

    def detach_executor(self) -> ThreadPoolExecutor | None:
        """Hand over the loader threads, to be shut down without the owner's lock held (a
        caller waiting on the lock must not wait for a slow read too); a later read starts
        new ones."""
        executor, self._executor = self._executor, None
        return executor
