"""Fault-safe, resharding checkpoints without collectives.

DCP's save and load are collectives: a worker killed mid-save wedges the
survivors, and gloo cannot abort a blocked collective. Here
every writer device saves its own file from a background thread, and the
controller makes the checkpoint valid only once every writer reported its file
done, by writing ``metadata.json`` and then a ``COMPLETE`` marker. Readers see
only directories with the marker, so a crashed save is never loaded.

On disk, under ``root``::

    step_00000120/
        gen2_device_3.pt    {kind: {name: local shard}} (kinds: param, exp_avg, ...)
        gen2_device_3.json  that file's index: regions, dtypes, committed_steps, a CRC-32 of every tensor
        metadata.json    the whole checkpoint's index, written by the controller
        COMPLETE         written last; its mtime dates the checkpoint

Each tensor is stored exactly once: one device per distinct shard of the first
holder (:func:`chameleon.layout.geometry.writers`), so the stored regions tile
every tensor. A loader asks for any regions (any TP degree, any pipeline split)
and :func:`load_regions` assembles each one from the stored shards it intersects.

Every file is written to a temporary name, fsynced and renamed into place, so a
file is either whole or absent. What happens to it afterwards (bit rot, a bad copy)
is caught by the checksums: every tensor a reader takes is checked against its
CRC-32 first, and :func:`whole_checkpoint` passes over a damaged checkpoint to the
newest whole one, naming what was damaged. File names carry the writer's generation, so a
stale writer (a fenced node that wakes up) can never replace a file a checkpoint
of a newer generation lists. The root must be visible to every writer and to
the controller (a shared file system on multi-node jobs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from chameleon.layout.spec import (
    Region,
    contains,
    intersect,
    local_slices,
    region_numel,
    region_shape,
)

FORMAT = 2
"""Version of the on-disk format, recorded in ``metadata.json`` (2: a checksum per tensor; 1 has none)."""

COMPLETE = "COMPLETE"
METADATA = "metadata.json"
_STEP_DIR = re.compile(r"step_(\d+)")

Shards = Mapping[str, Mapping[str, Tensor]]
"""Per kind (``param``, ``exp_avg``, ``exp_avg_sq``), the local shard of every tensor name."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, committed or read; the message names the file or tensor."""


class DamagedCheckpoint(CheckpointError):
    """A complete checkpoint whose files changed since they were written: unreadable, missing or not their checksum."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint.

    Attributes:
        path: its directory.
        step: the step it was saved at (the directory's number).
        committed_steps: committed optimizer steps in the saved state (AdamW's ``step``).
        age_s: seconds since it was committed, from the ``COMPLETE`` marker's mtime.
        config_digest: :func:`config_digest` of the config it was committed with.
    """

    path: Path
    step: int
    committed_steps: int
    age_s: float
    config_digest: str


def checkpoint_root(ckpt, run_dir: str | Path) -> Path:
    """Where a run's checkpoints live: ``ckpt.dir`` (of a ``CheckpointConfig``), else ``<run dir>/checkpoints``."""
    return Path(ckpt.dir).expanduser() if ckpt.dir else Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    """The directory of the checkpoint saved at ``step``."""
    return Path(root) / f"step_{step:08d}"


def shard_file(device: int, generation: int) -> str:
    """The file a writer device saves its shards to in ``generation``."""
    return f"gen{generation}_device_{device}.pt"


def config_digest(config: Mapping[str, Any]) -> str:
    """SHA-256 of a JSON-serialisable config, independent of key order."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


class CheckpointWriter:
    """One device's writer: snapshots its shards and writes them in a daemon thread.

    At most one write is in flight; a new save first waits for the previous one.
    Call :meth:`wait` before the process exits, or the daemon thread dies with it
    and leaves only a temporary file, which readers ignore.
    """

    def __init__(self, root: Path, *, device: int, generation: int = 0) -> None:
        self.root = Path(root)
        self.device, self.generation = device, generation
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pinned: dict[tuple[str, str], Tensor] = {}  # per (kind, name): the host buffer of an accelerator's shard

    @property
    def pending(self) -> bool:
        """True while a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def save_async(
        self, step: int, shards: Shards, *, regions: Mapping[str, Region], committed_steps: int
    ) -> Path:
        """Snapshot ``shards`` now and write them to ``step_dir(root, step)`` in the background.

        Args:
            step: the step being saved; names the directory.
            shards: per kind, the local shard of every tensor in ``regions``; copied
                before returning (from an accelerator: queued on its stream into pinned
                buffers, the writer waiting for them), so training may update them at once.
            regions: the global region of each tensor this device writes (its part of
                :func:`chameleon.layout.geometry.writers`).
            committed_steps: committed optimizer steps in this state.

        Returns:
            The path the shards will have once written.

        Raises:
            CheckpointError: the previous write failed, the step is already complete,
                or a shard does not match its region.
        """
        self.wait()
        directory = step_dir(self.root, step)
        if (directory / COMPLETE).exists():
            raise CheckpointError(f"{directory} is already complete: a committed checkpoint is never rewritten")
        snapshot: dict[str, dict[str, Tensor]] = {}
        for kind, tensors in shards.items():
            if tensors.keys() != regions.keys():
                raise CheckpointError(
                    f"device {self.device}: shards[{kind!r}] holds {sorted(tensors)} but regions name {sorted(regions)}"
                )
            for name, tensor in tensors.items():
                if tuple(tensor.shape) != region_shape(regions[name]):
                    raise CheckpointError(
                        f"device {self.device}: {kind} of {name} has shape {tuple(tensor.shape)}, "
                        f"but its region {regions[name]} has shape {region_shape(regions[name])}"
                    )
            snapshot[kind] = {name: self._host_copy((kind, name), t.detach()) for name, t in tensors.items()}
        copied = _copies_done(shards)
        index = {
            "device": self.device,
            "step": step,
            "committed_steps": committed_steps,
            "regions": {name: [list(r) for r in region] for name, region in regions.items()},
            "dtypes": {kind: {name: _dtype_name(t.dtype) for name, t in ts.items()} for kind, ts in snapshot.items()},
        }
        path = directory / shard_file(self.device, self.generation)
        self._thread = threading.Thread(
            target=self._write, args=(path, snapshot, index, copied), name=f"checkpoint-device-{self.device}",
            daemon=True,
        )
        self._thread.start()
        return path

    def wait(self) -> None:
        """Block until the pending write, if any, is on disk.

        Raises:
            CheckpointError: the write failed (the original error is its cause).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"device {self.device}: writing its checkpoint failed: {error}") from error

    def _host_copy(self, key: tuple[str, str], tensor: Tensor) -> Tensor:
        """A host copy of ``tensor``: a clone of a CPU tensor; from an accelerator, an asynchronous copy into a pinned
        buffer kept for the next save (:meth:`save_async` waits for the write that reads it first), ordered on the
        device's stream before any later update of ``tensor``."""
        if tensor.device.type == "cpu":
            return tensor.to("cpu", copy=True, memory_format=torch.contiguous_format)
        buffer = self._pinned.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._pinned[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return buffer.copy_(tensor, non_blocking=True)

    def _write(self, path: Path, snapshot: dict[str, dict[str, Tensor]], index: dict,
               copied: torch.Event | None) -> None:
        try:
            if copied is not None:
                copied.synchronize()  # the asynchronous device → host copies have landed
            index["checksums"] = {kind: {name: checksum(t) for name, t in ts.items()} for kind, ts in snapshot.items()}
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, lambda f: torch.save(snapshot, f))
            _atomic_write(path.with_suffix(".json"), lambda f: f.write(json.dumps(index).encode()))
        except Exception as error:  # handed to wait(), which raises it in the caller's thread
            self._error = error


def _copies_done(shards: Shards) -> torch.Event | None:
    """An event on the accelerator's current stream after the snapshot's copies were queued (None on a CPU)."""
    device = next((t.device for tensors in shards.values() for t in tensors.values()), None)
    if device is None or device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record()
    return event


def commit_checkpoint(
    root: Path,
    step: int,
    *,
    expected_devices: Collection[int],
    shapes: Mapping[str, tuple[int, ...]],
    config: Mapping[str, Any],
    keep: int = 2,
    generation: int = 0,
) -> Path:
    """Make the checkpoint at ``step`` valid, then prune older ones.

    Called by the controller once every writer reported its file done. Writes
    ``metadata.json`` and then ``COMPLETE``; keeps the newest ``keep`` complete
    checkpoints and removes incomplete directories older than ``step`` (crashed
    saves; newer ones may still be in flight).

    Args:
        root: the checkpoint root.
        step: the step being committed.
        expected_devices: every writer of this step (the keys of :func:`chameleon.layout.geometry.writers`).
        generation: the generation the writers saved in (it names their files).
        shapes: global shape of every tensor; the stored regions must tile each exactly.
        config: JSON-serialisable config the state belongs to, stored with its digest.
        keep: complete checkpoints to keep, at least 1.

    Returns:
        The committed directory.

    Raises:
        ValueError: ``keep`` < 1.
        CheckpointError: a writer's file is missing, writers disagree on the
            committed steps, kinds or dtypes, or the regions do not tile a tensor.
    """
    if keep < 1:
        raise ValueError(f"keep={keep}: the newest complete checkpoint is always kept, so keep must be ≥ 1")
    directory = step_dir(root, step)
    files = {}
    for device in sorted(expected_devices):
        shard = directory / shard_file(device, generation)
        index_path = shard.with_suffix(".json")
        if not index_path.exists() or not shard.exists():
            raise CheckpointError(f"cannot commit {directory}: device {device} has not written {shard.name}")
        files[shard.name] = json.loads(index_path.read_text())
    metadata = _metadata(step, files, shapes, config)
    _atomic_write(directory / METADATA, lambda f: f.write(json.dumps(metadata, indent=1).encode()))
    _atomic_write(directory / COMPLETE, lambda f: f.write(f"{step}\n".encode()))
    _prune(Path(root), committed=step, keep=keep)
    return directory


def latest_checkpoint(root: Path) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``root``, or ``None`` when there is none.

    Raises:
        CheckpointError: its ``metadata.json`` is unreadable.
    """
    complete = _complete_dirs(Path(root))
    return _info(*complete[-1]) if complete else None


def whole_checkpoint(root: Path, shapes: Mapping[str, tuple[int, ...]]) -> tuple[CheckpointInfo | None,
                                                                                  list[tuple[Path, str]]]:
    """The newest complete checkpoint of a model of ``shapes`` whose every file is whole, and each newer one with
    why it is not (naming the damaged file), newest first.

    Raises:
        CheckpointError: the newest readable checkpoint belongs to another model.
    """
    damaged = []
    for step, directory in reversed(_complete_dirs(Path(root))):
        try:
            info = _info(step, directory)
            verify_checkpoint(info, shapes)
        except DamagedCheckpoint as err:
            damaged.append((directory, str(err)))
            continue
        return info, damaged
    return None, damaged


def set_aside(directory: Path) -> Path:
    """Rename a damaged checkpoint's directory out of the checkpoints' way (``…/step_N.damaged``), kept for a look:
    no reader takes it, and the step can be saved again."""
    target = directory.with_name(f"{directory.name}.damaged")
    if target.exists():
        shutil.rmtree(target)
    directory.rename(target)
    return target


def checkpoint_at(root: Path, step: int) -> CheckpointInfo:
    """The complete checkpoint saved at ``step`` under ``root``.

    Raises:
        DamagedCheckpoint: it is not complete, or its ``metadata.json`` is unreadable.
    """
    directory = step_dir(Path(root), step)
    if not (directory / COMPLETE).exists():
        raise DamagedCheckpoint(f"{directory} is no longer a complete checkpoint (its {COMPLETE} marker is gone)")
    return _info(step, directory)


def _complete_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every checkpoint directory under ``root`` with its ``COMPLETE`` marker, oldest first."""
    return [(step, directory) for step, directory in _step_dirs(root) if (directory / COMPLETE).exists()]


def _info(step: int, directory: Path) -> CheckpointInfo:
    metadata = _read_metadata(directory)
    return CheckpointInfo(
        path=directory,
        step=step,
        committed_steps=metadata["committed_steps"],
        age_s=time.time() - (directory / COMPLETE).stat().st_mtime,
        config_digest=metadata["config_digest"],
    )


def load_regions(info: CheckpointInfo, needs: Mapping[str, Region]) -> dict[str, dict[str, Tensor]]:
    """Assemble every needed region, of every stored kind, from the checkpoint's shards.

    A needed region may cut across several stored shards (a different TP degree or
    pipeline split); only files holding part of some need are opened, each once,
    memory-mapped, so only the needed bytes are read.

    Args:
        info: a complete checkpoint, from :func:`latest_checkpoint`.
        needs: the global region of every tensor wanted.

    Returns:
        Per kind, a tensor holding exactly ``needs[name]`` for every name.

    Raises:
        CheckpointError: some part of a needed region is not stored; names the tensor.
        DamagedCheckpoint: a file read is unreadable or a stored tensor is not its checksum; names the file.
    """
    metadata = _read_metadata(info.path)
    reads = _plan_reads(metadata, needs)
    dtypes = metadata["dtypes"]
    out = {
        kind: {name: torch.empty(region_shape(need), dtype=_dtype(dtypes[kind][name])) for name, need in needs.items()}
        for kind in metadata["kinds"]
    }
    for file, pieces in reads.items():
        stored = _read_shards(info.path / file, metadata["files"][file], names={name for name, _ in pieces})
        held = metadata["files"][file]["regions"]
        for name, piece in pieces:
            source = local_slices(piece, _region(held[name]))
            target = local_slices(piece, needs[name])
            for kind in out:
                out[kind][name][target] = stored[kind][name][source]
        del stored
    return out


def verify_checkpoint(info: CheckpointInfo, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Check a checkpoint loads for a model of ``shapes``: same tensors and shapes, every file readable.

    Every file is read whole and every tensor checked against its checksum.

    Raises:
        CheckpointError: naming the foreign tensor.
        DamagedCheckpoint: naming the damaged file.
    """
    metadata = _read_metadata(info.path)
    stored = {name: tuple(shape) for name, shape in metadata["shapes"].items()}
    for name in sorted(set(stored) | set(shapes)):
        if stored.get(name) != tuple(shapes.get(name, ())) or name not in shapes:
            raise CheckpointError(
                f"{info.path} belongs to another model: tensor {name} is {stored.get(name, 'absent')} there but "
                f"{tuple(shapes[name]) if name in shapes else 'absent'} in this one: resume with the model it was saved with"
            )
    for file, entry in metadata["files"].items():
        _read_shards(info.path / file, entry, names=entry["regions"])


def _read_shards(path: Path, entry: Mapping[str, Any], *, names: Collection[str]) -> dict[str, dict[str, Tensor]]:
    """A shard file, memory-mapped, with every kind of each of ``names`` checked against its checksum
    (a format-1 file, which has none, only has to load)."""
    try:
        stored = torch.load(path, mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to open means a damaged file
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DamagedCheckpoint(f"{path} is missing or damaged ({reason})") from None
    for kind, sums in entry.get("checksums", {}).items():
        for name in names:
            if checksum(stored[kind][name]) != sums[name]:
                raise DamagedCheckpoint(f"{path} is damaged: its {kind} of {name} does not match the checksum it "
                                        "was written with")
    return stored


def checksum(tensor: Tensor, value: int = 0) -> int:
    """CRC-32 of a tensor's bytes, continuing ``value``: it catches bit rot and bad copies, at several GB/s
    (zlib's hardware CRC); a tensor on an accelerator is copied to the host first."""
    return zlib.crc32(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), value)


def _read_metadata(directory: Path) -> dict[str, Any]:
    path = directory / METADATA
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DamagedCheckpoint(f"{path} is unreadable ({err}): the checkpoint is damaged") from None


def _plan_reads(metadata: Mapping[str, Any], needs: Mapping[str, Region]) -> dict[str, list[tuple[str, Region]]]:
    """Per stored file, the pieces ``(name, region)`` of the needs it supplies.

    Stored regions are disjoint (checked at commit), so a need is covered exactly
    when its pieces add up to its size.
    """
    reads: dict[str, list[tuple[str, Region]]] = {}
    for name, need in needs.items():
        found = 0
        for file, entry in metadata["files"].items():
            held = entry["regions"].get(name)
            piece = intersect(need, _region(held)) if held is not None else None
            if piece is not None:
                reads.setdefault(file, []).append((name, piece))
                found += region_numel(piece)
        if found != region_numel(need):
            stored = metadata["shapes"].get(name)
            what = f"its stored shape is {tuple(stored)}" if stored is not None else "it is not in the checkpoint"
            raise CheckpointError(
                f"checkpoint {metadata['step']} lacks part of tensor {name}: {region_numel(need) - found} of the "
                f"{region_numel(need)} elements of region {need} are not stored ({what})"
            )
    return reads


def _metadata(
    step: int, files: Mapping[str, Mapping[str, Any]], shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]
) -> dict[str, Any]:
    """The checkpoint's index from the writers' indexes, after checking they form one whole state."""
    committed = {entry["committed_steps"] for entry in files.values()}
    if len(committed) != 1:
        raise CheckpointError(f"step {step}: writers saved different committed_steps {sorted(committed)}")
    kinds = {tuple(sorted(entry["dtypes"])) for entry in files.values()}
    if len(kinds) != 1:
        raise CheckpointError(f"step {step}: writers saved different kinds {sorted(kinds)}")
    dtypes: dict[str, dict[str, str]] = {}
    regions: dict[str, list[Region]] = {name: [] for name in shapes}
    for file, entry in files.items():
        for name, region in entry["regions"].items():
            if name not in regions:
                raise CheckpointError(f"step {step}: {file} holds {name}, which is not in the model's shapes")
            regions[name].append(_region(region))
        for kind, names in entry["dtypes"].items():
            for name, dtype in names.items():
                if dtypes.setdefault(kind, {}).setdefault(name, dtype) != dtype:
                    raise CheckpointError(f"step {step}: writers saved {kind} of {name} with different dtypes")
    for name, shape in shapes.items():
        _check_tiling(name, tuple(shape), regions[name])
    return {
        "format": FORMAT,
        "step": step,
        "committed_steps": committed.pop(),
        "kinds": sorted(dtypes),
        "shapes": {name: list(shape) for name, shape in shapes.items()},
        "dtypes": dtypes,
        "files": {file: {"device": e["device"], "regions": e["regions"], "checksums": e["checksums"]}
                  for file, e in files.items()},
        "config": config,
        "config_digest": config_digest(config),
    }


def _check_tiling(name: str, shape: tuple[int, ...], regions: list[Region]) -> None:
    """Raise unless ``regions`` cover the whole of ``shape`` exactly once."""
    whole = tuple((0, n) for n in shape)
    for i, region in enumerate(regions):
        if not contains(whole, region):
            raise CheckpointError(f"tensor {name}: stored region {region} lies outside its shape {shape}")
        for other in regions[:i]:
            if intersect(region, other):
                raise CheckpointError(f"tensor {name}: stored regions {other} and {region} overlap")
    stored = sum(region_numel(r) for r in regions)
    if stored != region_numel(whole):
        raise CheckpointError(
            f"tensor {name}: the writers stored {stored} of its {region_numel(whole)} elements; "
            "pass every device of writers(layout) as expected_devices"
        )


def _prune(root: Path, *, committed: int, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop incomplete ones older than ``committed``."""
    dirs = _step_dirs(root)
    complete = [d for _, d in dirs if (d / COMPLETE).exists()]
    stale = complete[:-keep] + [d for s, d in dirs if s < committed and d not in complete]
    for directory in stale:
        (directory / COMPLETE).unlink(missing_ok=True)  # first, so a crash mid-removal leaves it incomplete
        shutil.rmtree(directory)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_*`` directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = ((_STEP_DIR.fullmatch(p.name), p) for p in root.iterdir() if p.is_dir())
    return sorted((int(m[1]), p) for m, p in found if m)


def _atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` through a temporary file, fsynced and renamed, so it is whole or absent."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _region(ranges: list[list[int]]) -> Region:
    return tuple((start, stop) for start, stop in ranges)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
