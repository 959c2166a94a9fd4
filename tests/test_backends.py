"""Backend plumbing checked without an accelerator: plugin creators of either shape, the library's error
handling, a device per worker, and batched exchanges (two devices sending to each other in one batch)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chameleon.runtime.worker import device as device_module
from chameleon.runtime.worker.comm import Generation, build_group
from chameleon.runtime.worker.completion import LIBRARY_POLICY, apply_library_policy

CALLS: list[tuple] = []


def _plain(store, rank, size, timeout):
    CALLS.append(("plain", rank, size, timeout))
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _extended(options, backend_options):
    CALLS.append(("extended", options.group_rank, options.group_size, options.timeout, backend_options))
    return dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, options.timeout)


dist.Backend.register_backend("chameleon_plain", _plain, devices=["cpu"])
dist.Backend.register_backend("chameleon_extended", _extended, extended_api=True, devices=["cpu"])


@pytest.mark.parametrize("backend", ["chameleon_plain", "chameleon_extended"])
def test_a_plugin_backend_is_built_in_the_shape_it_registered(backend):
    """torch-npu's hccl registers ``(store, rank, size, timeout)`` in some builds, extended options in others."""
    CALLS.clear()
    timeout = timedelta(seconds=7)
    group = build_group(backend, dist.HashStore(), 0, 1, timeout, None, torch.device("cpu"))
    x = torch.ones(3)
    group.allreduce([x]).wait()
    assert torch.equal(x, torch.ones(3))
    assert CALLS[0][0] == backend.split("_")[1] and CALLS[0][1:4] == (0, 1, timeout)


def test_nccl_failures_raise_in_the_worker_instead_of_tearing_it_down(monkeypatch):
    for variables in LIBRARY_POLICY.values():
        for name in variables:
            monkeypatch.delenv(name, raising=False)
    apply_library_policy("gloo")
    assert not any(name in os.environ for variables in LIBRARY_POLICY.values() for name in variables)
    apply_library_policy("nccl")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: abort the communicator, raise
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"  # no monitor killing a worker Chameleon fences itself


def test_a_worker_without_a_device_of_its_own_is_refused(monkeypatch):
    """NCCL needs a GPU per worker: the third worker on two visible GPUs is refused, not wrapped onto GPU 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(RuntimeError, match=r"launcher.nproc_per_node: worker 2 .* 2 are visible \(visible devices: 4,5\)"):
        device_module.prepare_device("cuda", local_rank=2, own_device=True)


def _swap(rank: int, port: int, n: int, results) -> None:
    torch.set_num_threads(1)

    def client():
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))

    gen = Generation(connect_store=client, generation=0, me=rank, backend="gloo", timeout_s=30, groups=[(0, 1)])
    peer = 1 - rank
    mine = torch.full((n,), float(rank + 1))
    got = torch.empty(n)
    gen.exchange({peer: mine}, {peer: got})
    results.put((rank, bool(torch.equal(got, torch.full((n,), float(peer + 1))))))


def test_two_devices_send_to_each_other_in_one_batch():
    """Four million floats each way (16 MB, far past any buffer): both sides send first, and neither waits forever."""
    ctx = mp.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=_swap, args=(rank, server.port, 1 << 22, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: True, 1: True}
