"""Device selection per worker: CPU (gloo), CUDA (nccl) or Ascend NPU (hccl via torch_npu)."""

from __future__ import annotations

import torch

from chameleon.runtime.errors import DeviceFault


def import_torch_npu() -> None:
    """Import torch_npu (it registers the ``npu`` device and hccl) only when an NPU is asked for.

    Raises:
        RuntimeError: naming ``launcher.device`` and the install when torch_npu or CANN is missing.
    """
    try:
        import torch_npu  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            f"launcher.device=npu needs torch_npu matching torch {torch.__version__} and the Ascend CANN "
            f"toolkit (pip install 'chameleon[npu]'): {err}"
        ) from err


def prepare_device(kind: str, *, local_rank: int) -> torch.device:
    """Bind this worker to its device; torch_npu is imported only when ``kind == "npu"``.

    Raises:
        RuntimeError: naming ``launcher.device`` when the backend is not available.
    """
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("launcher.device=cuda but no CUDA device is visible: use launcher.device=cpu")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if kind == "npu":
        import_torch_npu()
        index = local_rank % torch.npu.device_count()
        torch.npu.set_device(index)
        return torch.device("npu", index)
    raise RuntimeError(f"launcher.device={kind!r}: use cpu, cuda or npu")


def is_device_fault(error: BaseException) -> bool:
    """True when ``error`` says this worker's own device is broken (handled as the loss of that device).

    That is an injected :class:`DeviceFault` or an accelerator error (``torch.AcceleratorError``:
    a CUDA/NPU fault such as an illegal access or an uncorrectable ECC error). Out-of-memory and
    every other error are the run's own and stop it.
    """
    accelerator = getattr(torch, "AcceleratorError", ())
    return isinstance(error, DeviceFault) or bool(accelerator) and isinstance(error, accelerator)
