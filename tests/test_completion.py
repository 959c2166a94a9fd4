"""Completion polling as NCCL/HCCL need it, exercised on real gloo groups (two ranks, one per thread).

A gloo all-reduce completes on gloo's own threads, as an NCCL op completes on its
stream; a gloo receive whose sender never sends never completes, as an NCCL op whose
peer died — so both paths of :func:`wait_polled` run for real here.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from chameleon.runtime.worker.completion import Collective, polls_completion, post_p2p, wait_polled

TIMEOUT = timedelta(seconds=30)


class Fault(RuntimeError):
    pass


def pair() -> list[dist.ProcessGroup]:
    store = dist.HashStore()
    groups: list[dist.ProcessGroup | None] = [None, None]

    def connect(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2, TIMEOUT)

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


def test_a_completed_op_returns_its_result():
    groups = pair()
    tensors = [torch.full((4,), float(r + 1)) for r in range(2)]
    works = [g.allreduce([t]) for g, t in zip(groups, tensors)]
    for work in works:
        wait_polled(work, lambda: None, interval_s=0.005)
    assert all(torch.equal(t, torch.full((4,), 3.0)) for t in tensors)


def test_an_op_that_never_completes_ends_with_the_fault_check():
    groups = pair()
    flagged_at = time.monotonic() + 0.2
    received = torch.empty(4)
    work = post_p2p("nccl", groups[0].recv, received, 1, 0, True)  # the peer never sends

    def check() -> None:
        if time.monotonic() >= flagged_at:
            raise Fault("a peer failed")

    with pytest.raises(Fault):
        wait_polled(work, check, interval_s=0.005)
    assert time.monotonic() - flagged_at < 0.5
    groups[1].send([torch.zeros(4)], 0, 0).wait()  # release the receive so the groups can go


def test_only_accelerator_backends_are_polled():
    assert polls_completion("nccl") and polls_completion("hccl") and not polls_completion("gloo")


def test_a_gloo_collective_is_waited_for_in_slices_through_a_late_peer():
    """Rank 1 joins the all-reduce after many slices of rank 0's wait: the slices time out, each checks for a fault,
    and the sum still arrives whole (a timed-out gloo collective can be waited for again)."""
    groups = pair()
    tensors = [torch.full((4,), float(r + 1)) for r in range(2)]
    work = Collective(groups[0].allreduce([tensors[0]]))
    checks = []
    late = threading.Timer(0.3, lambda: groups[1].allreduce([tensors[1]]).wait())
    late.start()
    work.wait(lambda: checks.append(time.monotonic()), interval_s=0.01)
    late.join()
    assert len(checks) >= 10 and all(torch.equal(t, torch.full((4,), 3.0)) for t in tensors)


def test_a_gloo_collective_whose_peer_never_comes_ends_with_the_fault_check():
    groups = pair()
    flagged_at = time.monotonic() + 0.2
    work = Collective(groups[0].allreduce([torch.ones(4)]))  # rank 1 never joins

    def check() -> None:
        if time.monotonic() >= flagged_at:
            raise Fault("a peer failed")

    with pytest.raises(Fault):
        work.wait(check, interval_s=0.01)
    assert time.monotonic() - flagged_at < 0.5
    groups[1].allreduce([torch.ones(4)]).wait()  # release the all-reduce so the groups can go
    work.wait(lambda: None, interval_s=0.01)
