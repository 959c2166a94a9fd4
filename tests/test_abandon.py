"""Generations left behind let their groups go: one abandoned after a peer died lets its gloo connections go (no
thread of a survivor keeps spinning on the dead peer's connection for the rest of the run: real processes, a real
SIGKILL), and one left in good order shuts down the groups its successor does not keep."""

from __future__ import annotations

import os
import queue
import signal
import time
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chameleon.runtime.worker.comm import Generation, PeerFailure
from conftest import run_ranks

WORLD, VICTIM, AT, FAULT = 4, 1, 3, "fault"


def background_cpu_s() -> float:
    """CPU seconds the threads of this process other than the main one have used."""
    me, ticks = os.getpid(), 0
    for task in os.listdir(f"/proc/{me}/task"):
        if int(task) != me:
            with open(f"/proc/{me}/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def worker(rank: int, port: int, results) -> None:
    """All-reduce in a loop; the victim dies at iteration ``AT`` while the others reach it a moment later (the
    dead peer's connection already closed). Survivors abandon the generation and report their background CPU
    over the next two seconds."""
    torch.set_num_threads(1)
    client = partial(dist.TCPStore, "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    store = client()
    gen = Generation(connect_store=client, generation=0, me=rank, backend="gloo", timeout_s=30, host="127.0.0.1",
                     groups=[tuple(range(WORLD))], flagged=lambda: store.check([FAULT]))
    grads = torch.ones(1 << 22)
    outcome = "done"
    try:
        for i in range(100):
            if i == AT:
                if rank == VICTIM:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.5)
            gen.all_reduce(grads, tuple(range(WORLD)))
    except PeerFailure:
        outcome = "abandoned"
        gen.abandon()
    time.sleep(1.0)
    before = background_cpu_s()
    time.sleep(2.0)
    results.put((rank, outcome, background_cpu_s() - before))
    results.close()
    results.join_thread()
    os._exit(0)


def test_an_abandoned_generation_leaves_no_thread_spinning_on_a_dead_peer():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, store.port, results), daemon=True) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        procs[VICTIM].join(timeout=60)
        store.set(FAULT, "1")  # the controller's flag
        got = {}
        deadline = time.monotonic() + 60
        while len(got) < WORLD - 1:
            try:
                rank, outcome, cpu_s = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"survivors {sorted(set(range(WORLD)) - {VICTIM} - set(got))} did not report") from None
            got[rank] = outcome, cpu_s
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert procs[VICTIM].exitcode == -signal.SIGKILL
    assert all(outcome == "abandoned" for outcome, _ in got.values()), got
    assert all(cpu_s < 0.3 for _, cpu_s in got.values()), f"background CPU over 2 s, by survivor: {got}"


def sockets() -> int:
    """Sockets this process holds open."""
    fds, count = f"/proc/{os.getpid()}/fd", 0
    for fd in os.listdir(fds):
        try:
            count += os.readlink(f"{fds}/{fd}").startswith("socket:")
        except FileNotFoundError:  # the listing's own descriptor, closed since
            pass
    return count


def switching_worker(rank: int, world: int, port: int) -> None:
    """Generation 0 holds the world group and a pair group; generation 1, switched to in good order, keeps the pair:
    the world group is shut down and its connections close, and the pair it kept still sums."""
    torch.set_num_threads(1)
    client = partial(dist.TCPStore, "127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=30))
    store = client()
    pair, everyone = (0, 1), tuple(range(world))
    first = Generation(connect_store=lambda: store, generation=0, me=rank, backend="gloo", timeout_s=30,
                       host="127.0.0.1", groups=[everyone, pair])
    first.all_reduce(torch.ones(4), everyone)
    held = sockets()
    second = Generation(connect_store=lambda: store, generation=1, me=rank, backend="gloo", timeout_s=30,
                        host="127.0.0.1", groups=[pair], reuse=first)
    assert second.built == 0  # the pair was kept, nothing connected anew
    first.retire(second)
    deadline = time.monotonic() + 10
    while sockets() > held - (world - 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sockets() <= held - (world - 1), (held, sockets())  # the world group's connections closed
    if rank in pair:
        total = torch.full((4,), float(rank + 1))
        second.all_reduce(total, pair)
        assert torch.equal(total, torch.full((4,), 3.0))
    store.set(f"done{rank}", "1")  # the store's owner waits for everyone before it goes
    if rank == 0:
        store.wait([f"done{r}" for r in range(world)])


def test_a_generation_left_in_good_order_closes_the_groups_its_successor_does_not_keep():
    run_ranks(switching_worker, 3)
