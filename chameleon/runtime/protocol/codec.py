"""The one encoding of everything that crosses a process or host boundary: JSON and raw tensor bytes.

Messages between workers, node agents and the controller, generation specs, and the
job's config travel as frames this module writes and reads. A frame is a JSON
document followed by the raw bytes of any tensors it holds:

    ``b"CHM1"`` ‖ u32 length of the JSON ‖ JSON ‖ tensor bytes

and a frame whose JSON passes 64 KiB (a generation spec of thousands of devices) is
deflated whole: ``b"CHZ1"`` ‖ u32 inflated length ‖ zlib stream. It is encoded and
compressed once however many nodes it is sent to.

Values map to JSON as themselves (``None``, booleans, numbers, strings, lists) or
as one-key objects: ``{"t": [...]}`` a tuple, ``{"f": [...]}`` a frozenset,
``{"s": {...}}`` a dict with string keys, ``{"m": [[k, v], ...]}`` any other dict,
``{"c": name, "v": [...]}`` an instance of a registered dataclass (its fields in
order; ``{"c": name, "p": [...]}`` for one registered with a packing of plain JSON,
such as a plan, a manifest or a step's report), ``{"e": [name, value]}`` a member of
an enum a registered dataclass's field is typed with (other int and str enums go as
their values), ``{"x": [dtype, shape, offset]}`` a tensor.

Reading a frame only ever builds JSON values, tuples, dicts, tensors of an allowed
dtype, members of registered enums and instances of the dataclasses registered here by name: nothing read can
name a function, a module or a class of its own choosing, so nothing read executes
code (unlike a pickle). An unregistered name, an unknown tag or a malformed frame
raises :class:`CodecError`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
import typing
import zlib
from collections.abc import Callable, Mapping

import torch

MAGIC, ZMAGIC = b"CHM1", b"CHZ1"
_HEAD = _ZHEAD = struct.Struct("<4sI")
COMPRESS_FROM = 1 << 16  # a JSON part this large is deflated (a generation spec of thousands of devices)
MAX_INFLATED = 1 << 31
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8,
    torch.bool,
)}
_CLASSES: dict[str, type] = {}
_ENUMS: dict[str, type[enum.Enum]] = {}  # the enums registered classes' fields are typed with, sent by value
_PACKED: dict[str, tuple[Callable, Callable]] = {}


class CodecError(ValueError):
    """A frame that is malformed, or names something this codec does not build."""


def register(*classes: type) -> None:
    """Allow instances of ``classes`` (dataclasses) in frames; each name must be unique."""
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        known = _CLASSES.setdefault(cls.__name__, cls)
        if known is not cls:
            raise TypeError(f"two classes named {cls.__name__} cannot both be registered")
        for hint in typing.get_type_hints(cls).values():
            for kind in _types_in(hint):
                if isinstance(kind, type) and issubclass(kind, enum.Enum) and _ENUMS.setdefault(kind.__name__, kind) is not kind:
                    raise TypeError(f"two enums named {kind.__name__} cannot both be registered")


def register_packed(cls: type, *, pack: Callable[[object], list], unpack: Callable[[list], object]) -> None:
    """Allow ``cls`` in frames as ``pack(value)``, plain JSON (lists, numbers, strings), rebuilt by ``unpack``:
    for a large value whose every field would otherwise be tagged (a plan of thousands of stages)."""
    register(cls)
    _PACKED[cls.__name__] = (pack, unpack)


def register_tree(root: type) -> None:
    """Register ``root`` and every dataclass its fields' type hints reach (a config schema)."""
    todo, seen = [root], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        register(cls)
        for hint in typing.get_type_hints(cls).values():
            todo.extend(t for t in _types_in(hint) if dataclasses.is_dataclass(t))


def _types_in(hint) -> list:
    return [hint] + [t for arg in typing.get_args(hint) for t in _types_in(arg)]


def encode(value: object, *, packs: Mapping[type, Callable[[object], list]] | None = None) -> bytes:
    """One frame holding ``value``; ``packs``: packings to use instead of registered classes' own, in the same
    format (one that shares work between frames)."""
    blobs: list[bytes] = []
    size = [0]

    def enc(v):
        if isinstance(v, enum.Enum) and _ENUMS.get(type(v).__name__) is type(v):
            return {"e": [type(v).__name__, v.value]}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [enc(x) for x in v]
        if isinstance(v, tuple):
            return {"t": list(v) if all(type(x) is int for x in v) else [enc(x) for x in v]}
        if isinstance(v, dict):
            if all(isinstance(k, str) for k in v):
                return {"s": {k: enc(x) for k, x in v.items()}}
            return {"m": [[enc(k), enc(x)] for k, x in v.items()]}
        if isinstance(v, frozenset):
            return {"f": [enc(x) for x in sorted(v)]}
        if isinstance(v, torch.Tensor):
            return {"x": _tensor(v, blobs, size)}
        cls = type(v)
        if _CLASSES.get(cls.__name__) is not cls:
            raise CodecError(f"cannot encode a {cls.__module__}.{cls.__qualname__}: register it with the codec")
        if cls.__name__ in _PACKED:
            pack = packs.get(cls) if packs else None
            return {"c": cls.__name__, "p": (pack or _PACKED[cls.__name__][0])(v)}
        return {"c": cls.__name__, "v": [enc(getattr(v, f.name)) for f in dataclasses.fields(v)]}

    doc = json.dumps(enc(value), separators=(",", ":")).encode()
    frame = b"".join([_HEAD.pack(MAGIC, len(doc)), doc, *blobs])
    if len(doc) >= COMPRESS_FROM:  # a large generation spec: sent to every node, encoded (and compressed) once
        return _ZHEAD.pack(ZMAGIC, len(frame)) + zlib.compress(frame, 1)
    return frame


def _tensor(t: torch.Tensor, blobs: list[bytes], size: list[int]) -> list:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CodecError(f"tensors of dtype {t.dtype} are not encoded")
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    blobs.append(data)
    offset, size[0] = size[0], size[0] + len(data)
    return [name, list(t.shape), offset]


def decode(frame: bytes | memoryview) -> object:
    """The value in ``frame``.

    Raises:
        CodecError: the frame is malformed or names a class, tag or dtype this codec does not build.
    """
    view = memoryview(frame)
    if len(view) >= _ZHEAD.size and bytes(view[:4]) == ZMAGIC:
        view = memoryview(_inflate(view))
    if len(view) < _HEAD.size:
        raise CodecError("a frame shorter than its header")
    magic, length = _HEAD.unpack_from(view)
    if magic != MAGIC or _HEAD.size + length > len(view):
        raise CodecError("not a frame of this codec (bad magic or length)")
    blobs = view[_HEAD.size + length:]
    try:
        doc = json.loads(bytes(view[_HEAD.size:_HEAD.size + length]))
    except ValueError as err:
        raise CodecError(f"a frame's JSON is malformed: {err}") from None

    def dec(v):
        if not isinstance(v, (dict, list)):
            return v
        if isinstance(v, list):
            return [dec(x) for x in v]
        if "c" in v:
            cls = _CLASSES.get(v["c"])
            if cls is not None and set(v) == {"c", "p"} and v["c"] in _PACKED:
                return _PACKED[v["c"]][1](v["p"])
            if cls is None or set(v) != {"c", "v"} or v["c"] in _PACKED:
                raise CodecError(f"a frame names {v['c']!r}, which is not a registered class")
            return cls(*(dec(x) for x in v["v"]))
        if len(v) != 1:
            raise CodecError(f"an untagged object in a frame: {sorted(v)[:3]}")
        tag, body = next(iter(v.items()))
        if tag == "t":
            return tuple(dec(x) for x in body)
        if tag == "s":
            return {k: dec(x) for k, x in body.items()}
        if tag == "m":
            return {dec(k): dec(x) for k, x in body}
        if tag == "f":
            return frozenset(dec(x) for x in body)
        if tag == "x":
            return _untensor(body, blobs)
        if tag == "e" and body[0] in _ENUMS:
            return _ENUMS[body[0]](body[1])
        raise CodecError(f"unknown tag {tag!r} in a frame")

    try:
        return dec(doc)
    except (TypeError, AttributeError, StopIteration, ValueError, LookupError) as err:
        raise CodecError(f"a frame does not describe a value: {err}") from None


def _inflate(view: memoryview) -> bytes:
    """The frame inside a compressed one, refusing one that would inflate past its stated size."""
    _, size = _ZHEAD.unpack_from(view)
    if size > MAX_INFLATED:
        raise CodecError(f"a compressed frame claims {size} bytes")
    inflater = zlib.decompressobj()
    try:
        frame = inflater.decompress(bytes(view[_ZHEAD.size:]), size + 1)
    except zlib.error as err:
        raise CodecError(f"a compressed frame is malformed: {err}") from None
    if len(frame) != size or inflater.unconsumed_tail:
        raise CodecError("a compressed frame does not inflate to its stated size")
    return frame


def _untensor(body: list, blobs: memoryview) -> torch.Tensor:
    name, shape, offset = body
    if name not in _DTYPES:
        raise CodecError(f"a frame holds a tensor of dtype {name!r}")
    dtype = _DTYPES[name]
    count = 1
    for n in shape:
        count *= n
    nbytes = count * dtype.itemsize
    if not 0 <= offset <= offset + nbytes <= len(blobs):
        raise CodecError("a tensor runs past the end of its frame")
    raw = torch.frombuffer(bytearray(blobs[offset:offset + nbytes]), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
