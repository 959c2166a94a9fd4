"""Device selection per worker: CPU (gloo), CUDA (nccl) or Ascend NPU (hccl via torch_npu)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from chameleon.runtime.protocol.errors import DeviceFault
from chameleon.runtime.protocol.position import Phase


def device_module(kind: str):
    """``torch.cuda`` or ``torch.npu`` once the device kind is found; torch_npu is imported only for ``npu``.

    Raises:
        RuntimeError: naming ``launcher.device`` and the fix when no such device or its install is missing.
    """
    if kind not in ("cuda", "npu"):
        raise RuntimeError(f"launcher.device={kind!r}: use cpu, cuda or npu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("launcher.device=cuda but no CUDA device is visible: use launcher.device=cpu")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device and hccl)
        except ImportError as err:
            raise RuntimeError(
                f"launcher.device=npu needs torch_npu matching torch {torch.__version__} and the Ascend CANN "
                f"toolkit (pip install 'chameleon[npu]'): {err}"
            ) from err
    return getattr(torch, kind)


def prepare_device(kind: str, *, local_rank: int, own_device: bool = False) -> torch.device:
    """Bind this worker to its device; torch_npu is imported only when ``kind == "npu"``.

    Workers take the visible devices in turn (``local_rank`` modulo their count: gloo lets
    several share one). With ``own_device`` (NCCL, HCCL: a device per worker) a worker past the
    visible devices is refused instead of wrapped onto another worker's.

    Raises:
        RuntimeError: naming ``launcher.device`` when the backend is not available, or
            ``launcher.nproc_per_node`` when this worker has no device of its own.
    """
    if kind == "cpu":
        return torch.device("cpu")
    module = device_module(kind)
    count = module.device_count()
    if own_device and local_rank >= count:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES" if kind == "cuda" else "ASCEND_RT_VISIBLE_DEVICES")
        raise RuntimeError(
            f"launcher.nproc_per_node: worker {local_rank} of this node needs a {kind} device of its own and "
            f"{count} are visible" + (f" (visible devices: {hidden})" if hidden is not None else "") +
            f": use launcher.nproc_per_node={count}, or launcher.backend=gloo to share devices")
    index = local_rank % count
    module.set_device(index)
    return torch.device(kind, index)


def allocator_peaks(device: torch.device) -> tuple[int, int]:
    """The bytes an accelerator's allocator handed out and held at most (``max_memory_allocated``,
    ``max_memory_reserved``) on ``device``; (0, 0) on a CPU, whose peak is the process's resident memory."""
    if device.type == "cpu":
        return 0, 0
    module = device_module(device.type)
    return module.max_memory_allocated(device), module.max_memory_reserved(device)


def is_device_fault(error: BaseException, phase: Phase) -> bool:
    """True when ``error``, met in ``phase``, loses this worker's device (handled as the loss of that device).

    That is an injected :class:`DeviceFault`, an accelerator error (``torch.AcceleratorError``: a
    CUDA/NPU fault such as an illegal access or an uncorrectable ECC error), or an out-of-memory
    while the device rebuilds its groups or moves state for a recovery (its old state, the new
    shards and the packed buffers at once: the recovery is decided again without it). Every other
    error, and an out-of-memory while training (a plan that does not fit would meet it again), is
    the run's own and stops it.
    """
    accelerator = getattr(torch, "AcceleratorError", ())
    if isinstance(error, DeviceFault) or bool(accelerator) and isinstance(error, accelerator):
        return True
    return isinstance(error, torch.OutOfMemoryError) and phase in (Phase.rebuild, Phase.transfer)


def compute_clock(device: torch.device) -> Callable[[], float]:
    """The clock a device's own compute is timed on. On a CPU it is the driving thread's time on a core: a host
    shared by more workers than cores makes no device look slow (waiting for a core is not computing), nor do
    the process's other threads (communication, checkpoint writes). On an accelerator it is the host's clock
    (the self-test waits for its kernels)."""
    return time.thread_time if device.type == "cpu" else time.perf_counter


SELF_TEST_SIDE = 128  # the self-test multiplies matrices this wide (a tenth of a millisecond on a CPU core)
SELF_TEST_RUNS = 20  # ... this many times, the fastest kept: a run's warm-up or a busy host's blip never reads as slow


def self_test(device: torch.device, pace: Callable[[float], float] | None = None) -> float:
    """Seconds of a fixed piece of work on ``device`` (:func:`compute_clock`): the fastest of ``SELF_TEST_RUNS`` runs
    of four matmuls, each paced by ``pace(seconds)`` as a forward is (a slow fault stretches it). An idle device's
    speed, against its own at start (timed the same way: the fastest of three read 1.2–1.3 × its start's fastest of
    twenty on this host, 1.8 × under load, and an idle device was found slow that was not)."""
    clock = compute_clock(device)
    a = torch.randn(SELF_TEST_SIDE, SELF_TEST_SIDE, device=device)
    best = float("inf")
    for _ in range(SELF_TEST_RUNS):
        start = clock()
        b = a
        for _ in range(4):
            b = b @ a
        if device.type != "cpu":
            getattr(torch, device.type).synchronize(device)
        took = clock() - start
        best = min(best, took if pace is None else pace(took))
    return best
