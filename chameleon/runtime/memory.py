"""Memory the devices offer (for fail-fast validation; what a plan needs is :mod:`chameleon.layout.memory`)."""

from __future__ import annotations

import os

from chameleon.runtime.device import import_torch_npu


def device_memory_bytes(launcher) -> tuple[int, int]:
    """(bytes one device offers, bytes all ``nnodes · nproc_per_node`` devices offer together).

    CPU workers share their host's RAM; accelerators each have their own memory.
    ``launcher.memory_per_device_gb`` overrides what is detected.
    """
    if launcher.memory_per_device_gb:
        per = int(launcher.memory_per_device_gb * 2**30)
        return per, per * launcher.nnodes * launcher.nproc_per_node
    if launcher.device == "cpu":
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return host, host * launcher.nnodes
    import torch

    if launcher.device == "npu":
        import_torch_npu()
    elif not torch.cuda.is_available():
        raise RuntimeError("launcher.device=cuda but no CUDA device is visible: use launcher.device=cpu")
    backend = torch.cuda if launcher.device == "cuda" else torch.npu
    per = backend.get_device_properties(0).total_memory
    return per, per * launcher.nnodes * launcher.nproc_per_node
