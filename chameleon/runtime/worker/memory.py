"""Memory the devices offer (for fail-fast validation; what a plan needs is :mod:`chameleon.layout.memory`)."""

from __future__ import annotations

import os

from chameleon.runtime.worker.device import device_module


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
    per = device_module(launcher.device).get_device_properties(0).total_memory
    return per, per * launcher.nnodes * launcher.nproc_per_node
