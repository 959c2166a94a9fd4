"""What "done" means per communication backend, and how a broken accelerator communicator is left.

- **gloo** (the CPU path): ``Work.wait()`` blocks the calling thread until the op is
  complete. A collective's wait may be given a timeout and, timed out, waited for
  again: :class:`Collective` waits on the calling thread in slices, checking the
  fault flag between them (no thread handoff per TP all-reduce or gradient bucket).
  A point-to-point op's ``is_completed()`` only turns true inside ``wait()``, and a
  timed-out wait closes its pair, so :class:`~chameleon.runtime.worker.comm.Generation`
  runs those waits on a helper thread while it polls the fault flag. Gloo reads a point-to-point
  tensor's memory as host memory, so a CUDA tensor (workers sharing one GPU over
  gloo) travels through a host copy (:func:`post_p2p`); its all-reduce takes CUDA
  tensors itself.
- **NCCL / HCCL**: an op is enqueued on the backend's own stream; ``Work.wait()``
  only makes the *current stream* wait for it and returns at once, so a wait on a
  dead peer's op would "succeed" and the hang would surface later, in some
  unrelated host sync. ``Work.is_completed()`` queries the op's device event without
  blocking: :func:`wait_polled` polls it between fault-flag checks and calls
  ``wait()`` only once the op is done, to order the current stream after it. An op
  whose peer died never completes: :func:`abort` aborts the generation's
  communicators (``ncclCommAbort`` underneath) so the device is released instead of
  spinning in the kernel.
- **Who handles a failed op**: Chameleon, not the library. Left to its defaults,
  ProcessGroupNCCL's watchdog tears the whole process down when an op fails or
  times out (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``), taking every survivor of a
  peer's death with it before the controller decided anything. :data:`LIBRARY_POLICY`
  is set in every worker before its first group: the watchdog only aborts the
  failed communicator and the error is raised in the worker, which keeps running.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

POLLED = frozenset({"nccl", "hccl"})
LIBRARY_POLICY = {
    "nccl": {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort the failed communicator, raise, keep the process
        "TORCH_NCCL_ENABLE_MONITORING": "0",  # no heartbeat monitor killing a worker whose watchdog is stuck: it fences
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",  # no flight-recorder dump blocking the watchdog on a timeout
    },
    "hccl": {"HCCL_ASYNC_ERROR_HANDLING": "0"},  # torch-npu documents 0 and 1 only; 1 tears the process down
}
SPIN_S = 20e-6  # between completion queries: a device op's latency is microseconds, not the fault poll's


def polls_completion(backend: str) -> bool:
    """True for backends whose ``Work.wait()`` does not block the host (NCCL, HCCL)."""
    return backend in POLLED


def apply_library_policy(backend: str) -> None:
    """Set ``backend``'s error handling to :data:`LIBRARY_POLICY` in this process (read as a group is built)."""
    os.environ.update(LIBRARY_POLICY.get(backend, {}))


def wait_polled(work: dist.Work, check: Callable[[], None], *, interval_s: float) -> None:
    """Poll ``work.is_completed()`` (cheap: an event query) every ``SPIN_S``, and ``check`` (which raises on a
    fault; a shared-memory read) every ``interval_s``; then ``wait()``."""
    next_check = time.monotonic() + interval_s
    while not work.is_completed():
        if time.monotonic() >= next_check:
            check()
            next_check = time.monotonic() + interval_s
        time.sleep(SPIN_S)
    work.wait()


class Collective:
    """A gloo collective's work, waited for on the calling thread in slices (see the module doc)."""

    def __init__(self, work: dist.Work):
        self.work = work

    def wait(self, check: Callable[[], None], *, interval_s: float) -> None:
        """Wait in slices of ``interval_s``, calling ``check`` (which raises on a fault) between them; the op's own
        error is raised as is."""
        while True:
            try:
                self.work.wait(timedelta(seconds=interval_s))
                return
            except RuntimeError:
                if self.work.is_completed():  # failed, or done just after the slice ran out: raises or returns
                    self.work.wait()
                    return
            check()


def abort(groups: Iterable[dist.ProcessGroup]) -> None:
    """Abort every communicator of ``groups`` (pending ops end, nothing is waited on)."""
    for group in groups:
        group.abort()


class HostStaged:
    """A point-to-point op whose device tensor went through host memory; ``wait()`` copies a receive back."""

    def __init__(self, work: dist.Work, host: torch.Tensor, target: torch.Tensor | None):
        self.work, self.host, self.target = work, host, target

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        done = self.work.wait()
        if self.target is not None:
            self.target.copy_(self.host)
        return done


def post_p2p(backend: str, op: Callable, tensor: torch.Tensor, peer: int, tag: int, receive: bool):
    """Post ``op([tensor], peer, tag)`` (a group's ``send`` or ``recv``), through host memory where gloo needs it."""
    if backend != "gloo" or tensor.device.type == "cpu":
        return op([tensor], peer, tag)
    host = torch.empty_like(tensor, device="cpu") if receive else tensor.to("cpu")
    return HostStaged(op([host], peer, tag), host, tensor if receive else None)
