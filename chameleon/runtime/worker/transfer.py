"""Execute a re-layout manifest: the only code that moves training state between devices.

Each parameter travels with its optimizer state: the state is given per *kind*
(``param``, ``exp_avg``, ``exp_avg_sq``, ...), and every move carries its region
of every kind. AdamW's step count and the learning rate follow from the global
step, the same on every device, so nothing else is moved. The state stays on its
device: on an accelerator, sends, receive buffers and new shards live there too.

Rounds run in manifest order. In a round a device packs everything it sends to
one peer into one buffer, and the round's sends and receives go as one batch
(a pair that sends both ways in a round is one group call on NCCL, which needs
that); a link appears in a single round, so no tags are needed. The old state
is only read, never released, until the whole manifest is done.

Batches go through ``links`` (the runtime's
:class:`~chameleon.runtime.worker.comm.Generation`), whose waits poll for faults: a
fault abandons the transfer at once, and the caller keeps its old state. Every
buffer is stamped with the generation it belongs to; a receiver refuses state
stamped with another (it could only come from a stale peer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from chameleon.layout.relayout import Manifest, Move
from chameleon.layout.spec import Region, local_slices, region_numel, region_shape


class StaleTransfer(RuntimeError):
    """State arrived stamped with another generation than the receiver's."""

class PointToPoint(Protocol):
    """A batch of sends and receives between devices, waited for; the wait may raise to abandon."""

    def exchange(self, sends: Mapping[int, torch.Tensor], receives: Mapping[int, torch.Tensor]) -> None: ...


def execute_manifest(
    manifest: Manifest,
    *,
    me: int,
    state: Mapping[str, Mapping[str, torch.Tensor]],
    links: PointToPoint,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    stamp: int = 0,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Run this device's part of ``manifest`` and return its state in the new layout.

    Every device of the manifest must call this with the same manifest; a device
    with no moves returns at once.

    Args:
        manifest: the moves, from :func:`chameleon.layout.relayout.relayout`.
        me: this device's id in the manifest.
        state: per kind, the local shard of every tensor this device holds now
            (exactly ``manifest.before[me]``, or anything it keeps when it is in
            ``manifest.kept``; empty for a new device). Every device passes the same kinds.
        links: sends and receives between devices; its ``wait`` raises to abandon.
        dtype: dtype of every state tensor.
        device: where the state lives; new shards and receive buffers are allocated
            there (an accelerator's state never takes a host round trip).
        stamp: the generation every buffer is stamped with and checked against.
        on_round: called with the round's index as each round this device takes part in starts.

    Returns:
        Per kind, a new local shard of every tensor in ``manifest.after[me]`` (the same tensors
        when ``me`` is in ``manifest.kept``).

    Raises:
        ValueError: ``state`` does not match ``manifest.before[me]``.
        StaleTransfer: a buffer came stamped with another generation.
    """
    kinds = sorted(state)
    if me not in manifest.before and me not in manifest.after:  # takes no part: sends, receives and keeps nothing
        return {kind: {} for kind in kinds}
    before = manifest.before.get(me, {})
    for kind in kinds:
        shapes = {name: tuple(t.shape) for name, t in state[kind].items()}
        expected = {name: region_shape(region) for name, region in before.items()}
        if me not in manifest.kept and shapes != expected or \
                any(t.dtype != dtype or t.device != torch.device(device) for t in state[kind].values()):
            raise ValueError(f"state[{kind!r}] of device {me} does not match the manifest's regions, {dtype} and {device}")
    after = manifest.after.get(me, {})
    if me in manifest.kept:  # its state stays as it is (and may be sent from)
        new = {kind: dict(state[kind]) for kind in kinds}
    else:
        new = {kind: {name: torch.empty(region_shape(region), dtype=dtype, device=device)
                      for name, region in after.items()} for kind in kinds}
    for move in manifest.local:
        if move.dst == me:
            for kind in kinds:
                _target(new[kind], after, move).copy_(_source(state[kind], before, move))
    for r, moves in enumerate(manifest.rounds):
        outgoing: dict[int, list[Move]] = {}
        incoming: dict[int, list[Move]] = {}
        for move in moves:
            if move.src == me:
                outgoing.setdefault(move.dst, []).append(move)
            elif move.dst == me:
                incoming.setdefault(move.src, []).append(move)
        if not outgoing and not incoming:
            continue
        if on_round is not None:
            on_round(r)
        _exchange(outgoing, incoming, state=state, new=new, before=before, after=after, links=links, dtype=dtype,
                  device=device, stamp=stamp)
    return new


def _exchange(outgoing: Mapping[int, list[Move]], incoming: Mapping[int, list[Move]], *, state, new, before, after,
              links: PointToPoint, dtype: torch.dtype, device: torch.device | str, stamp: int) -> None:
    """One round of a device: pack what it sends, exchange, unpack what it received into ``new``. Its buffers are
    freed on return, before the next round packs its own (one round's buffers at a time, as the memory model
    counts them)."""
    kinds = sorted(state)
    header = torch.tensor([float(stamp)], dtype=dtype, device=device)
    sends = {dst: torch.cat([header] + [_source(state[kind], before, m).reshape(-1) for m in out for kind in kinds])
             for dst, out in outgoing.items()}
    receives = {src: torch.empty(1 + sum(region_numel(m.region) for m in into) * len(kinds), dtype=dtype,
                                 device=device) for src, into in incoming.items()}
    links.exchange(sends, receives)
    for src, into in incoming.items():
        buffer = receives[src]
        if buffer[0].item() != stamp:
            raise StaleTransfer(f"device {src} sent state stamped generation {buffer[0].item():g}, not {stamp}")
        offset = 1
        for m in into:
            n = region_numel(m.region)
            for kind in kinds:
                _target(new[kind], after, m).copy_(buffer[offset : offset + n].view(region_shape(m.region)))
                offset += n


def _source(held: Mapping[str, torch.Tensor], before: Mapping[str, Region], move: Move) -> torch.Tensor:
    """The part of a held local shard that ``move`` sends."""
    return held[move.name][local_slices(move.region, before[move.name])]


def _target(new: Mapping[str, torch.Tensor], after: Mapping[str, Region], move: Move) -> torch.Tensor:
    """The part of a new local shard that ``move`` fills."""
    return new[move.name][local_slices(move.region, after[move.name])]
