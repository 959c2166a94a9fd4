"""The one encoding of the control plane: every message survives a round trip, and nothing read executes code."""

from __future__ import annotations

import json
import pickle
import random
import struct
from dataclasses import replace

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from chameleon.config import CONF_DIR, Backend, Device, Dtype, register_configs, to_config
from chameleon.faults.spec import FaultKind, FaultSpec
from chameleon.layout.plan import Reroute, even_plan
from chameleon.layout.relayout import Manifest, manifest_parts, relayout
from chameleon.model.config import ModelConfig
from chameleon.model.spec import spec_of
from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.messages import (
    Commit,
    CommitOrder,
    Dying,
    FinalShards,
    GenerationSpec,
    Hello,
    Moves,
    NodeSynced,
    Positions,
    Publish,
    Synced,
    parcel,
    sample_ranges,
)
from chameleon.runtime.protocol.position import Position


def roundtrip(value):
    return codec.decode(codec.encode(value))


def test_messages_specs_and_manifests_survive_a_round_trip():
    model = ModelConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=20, multiple_of=8)
    old = even_plan(dp=2, pp=2, tp=2, n_layers=4, global_batch=8, micro_batch=2)
    new = even_plan(dp=1, pp=2, tp=2, n_layers=4, global_batch=8, micro_batch=2)
    manifest = relayout(spec_of(model).layout(model, old), spec_of(model).layout(model, new), survivors=range(6))
    spec = GenerationSpec(3, new, tuple(range(6)), 7, None, None, (0, 1), moves=True)
    messages = [
        Publish(spec), GenerationSpec(3, new, (5, 0, 1, 2), 7, manifest, "ckpt/3", (2, 1, 0), moves=True),
        Moves(3, manifest_parts(manifest, lambda d: d // 4)[0]),
        Commit(3, 7, CommitOrder(save=True, switch_to=4), 1.5, 1.25e9),
        NodeSynced(1, 3, 7, (4, 5), 0.75, sample_ranges([5, 4, 7, 6, 9]), 0.2, None, 1.0),
        NodeSynced(1, 3, 7, (4, 5), float("inf"), ((8, 9),), 0.2, 2.5, 1.0, (5,), ((4, 2**40), (5, 7)),
                   ((4, 0.1), (5, 0.2))),
        Synced(4, 3, 7, 0.5, ((4, 8), (9, 10)), 0.2, 1.5, False, 2**31, 0.125), Synced(4, 3, 7, 0.5, (), 0.2),
        Dying(5, 3, FaultSpec("node_kill", None, 1, 3, "backward"), 2.0, Position(3, 7, "backward", 2, -1)),
        Positions(1, 2, {4: (Position(3, 7, "sync", 0, -2), 0.5)}),
        Commit(0, 0, CommitOrder(), float("inf"), float("nan")),
    ]
    for message in messages[:-1]:
        assert roundtrip(message) == message
    last = roundtrip(messages[-1])
    assert last.grad_norm == float("inf") and last.t_published != last.t_published  # nan survives as nan
    assert roundtrip(manifest) == manifest
    assert sample_ranges([5, 4, 7, 6, 9]) == ((4, 8), (9, 10)) and sample_ranges([1, 1, 2]) == ((1, 2), (1, 3))


def test_a_spec_of_thousands_of_devices_reaches_each_node_in_a_few_kilobytes():
    """Each generation's spec goes to every node: its plan's devices, its members and its writers travel as runs of
    consecutive ids (a plan keeps devices where they were: a few runs), not as one number each; any order and any
    TP width survive, and a frame whose runs do not fill its stages is refused."""
    plan = even_plan(dp=1024, pp=8, tp=1, n_layers=32, global_batch=8192, micro_batch=1)
    replan = replace(plan, pipelines=plan.pipelines[:-1])  # the last node lost: 8,184 devices in 1,023 pipelines
    spec = GenerationSpec(5, replan, replan.devices, 40, writers=replan.pipelines[0].devices, evaluated=39)
    frame = codec.encode(Publish(spec))
    assert len(frame) < 4096, f"{len(frame)} bytes to each of 1,023 nodes"
    assert codec.decode(frame) == Publish(spec)
    shuffled = even_plan(dp=3, pp=2, tp=2, n_layers=4, global_batch=12, micro_batch=2)
    order = random.Random(0).sample(range(12), 12)
    pipelines = tuple(replace(p, stages=tuple(replace(st, devices=tuple(order[d] for d in st.devices))
                                              for st in p.stages)) for p in shuffled.pipelines)
    scrambled = replace(shuffled, pipelines=pipelines, reroutes=(Reroute(1, 0, (0, 2)),))
    assert roundtrip(GenerationSpec(1, scrambled, tuple(order), 0)) == GenerationSpec(1, scrambled, tuple(order), 0)
    doc = json.loads(codec.encode(GenerationSpec(1, scrambled, (), 0))[8:])
    for runs in ([0, 11], [0, 13], [0, 12, 20, 0], [0, 1 << 30]):
        doc["p"][1][3] = runs
        body = json.dumps(doc).encode()
        with pytest.raises(codec.CodecError):
            codec.decode(struct.pack("<4sI", b"CHM1", len(body)) + body)


def test_each_nodes_moves_are_encoded_together_and_decode_to_its_part_of_the_manifest():
    """A re-plan onto fewer pipelines with a TP change (regions cut, 1-D and 2-D): every node's frame decodes to the
    Moves of its part (:func:`manifest_parts`); a node with no part gets an empty one, its rounds kept."""
    model = ModelConfig(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=40, multiple_of=8)
    old = even_plan(dp=4, pp=4, tp=4, n_layers=8, global_batch=16, micro_batch=1)
    new = even_plan(dp=7, pp=4, tp=2, n_layers=8, global_batch=14, micro_batch=1)
    layout = spec_of(model).layout
    manifest = relayout(layout(model, old), layout(model, new), survivors=range(56))
    parts = manifest_parts(manifest, lambda d: d // 8)
    assert len(manifest.rounds) > 1 and {len(m.region) for m in manifest.moves} == {1, 2}
    assert any(not moves for part in parts.values() for moves in part.rounds), "a node idle in some round"
    parcels = parcel(manifest, generation=5, nodes=range(9), node_of=lambda d: d // 8)
    assert parcels.generation == 5 and sorted(parcels.sends) == list(range(9)) and 8 not in parts
    empty = Manifest((), tuple(() for _ in manifest.rounds), {}, {})
    for node, (moves, payload) in parcels.sends.items():
        assert moves == Moves(5, parts.get(node, empty)) and codec.decode(payload) == moves
    assert roundtrip(manifest) == manifest


def test_tensors_travel_as_raw_bytes_with_their_dtype_and_shape():
    shards = {"w": ((( 0, 2), (0, 3)), torch.arange(6, dtype=torch.float32).reshape(2, 3)),
              "b": (((0, 4),), torch.tensor([1.5, -2.0, 0.0, 3.0], dtype=torch.bfloat16)),
              "e": (((0, 0),), torch.empty(0))}
    got = roundtrip(FinalShards(2, 1, shards)).shards
    for name, (region, tensor) in shards.items():
        assert got[name][0] == region and got[name][1].dtype == tensor.dtype and torch.equal(got[name][1], tensor)


def test_the_typed_config_travels_whole():
    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["failure=schedule", "failure.faults=[{kind:kill,rank:1,step:3}]",
                                           "parallel.pipelines=[{layers:[2,2],micro_batches:2}]"])
    config = to_config(cfg)
    hello = Hello(1, (4, 5), 123, "127.0.0.2", "host/boot", config)
    assert roundtrip(hello) == hello
    assert isinstance(roundtrip(hello).config.failure.faults[0], FaultSpec)
    assert OmegaConf.to_object(cfg) == config
    back = roundtrip(hello).config  # each vocabulary's member arrives as itself, not as its string
    assert type(back.train.dtype) is Dtype and type(back.failure.faults[0].kind) is FaultKind
    assert type(back.launcher.device) is Device and back.launcher.device.backend is Backend.gloo


def frame(doc: object, blobs: bytes = b"") -> bytes:
    text = json.dumps(doc).encode()
    return struct.pack("<4sI", b"CHM1", len(text)) + text + blobs


@pytest.mark.parametrize("doc, why", [
    ({"c": "os.system", "v": ["echo owned"]}, "not a registered class"),
    ({"c": "Commit", "v": [0], "z": 1}, "not a registered class"),
    ({"q": [1]}, "unknown tag"),
    ({"t": [1], "s": {}}, "untagged"),
    ({"c": "Commit", "v": [0]}, "does not describe"),
    ({"x": ["object", [1], 0]}, "dtype"),
    ({"x": ["float32", [4], 0]}, "past the end"),
    ({"c": "Manifest", "p": [[], [], [0, 9, 1, 2, 3], [0, []], [], [], [], []]}, "does not describe"),  # no name 0
    ({"c": "NodeSynced", "p": [1, 3, 7, [4], 0.5, [8, 9, 10], 0.2, None, 1.0, [], [], []]}, "does not describe"),
    ({"c": "Synced", "p": [4, 3, 7]}, "does not describe"),
])
def test_a_frame_can_only_build_registered_values(doc, why):
    with pytest.raises(codec.CodecError, match=why):
        codec.decode(frame(doc))


def test_a_pickle_or_a_truncated_frame_is_refused_not_loaded():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('executed')",))

    for data in (pickle.dumps(Boom()), codec.encode(Commit(0, 0, CommitOrder(), None, 0.0))[:-3], b""):
        with pytest.raises(codec.CodecError):
            codec.decode(data)


def test_only_dataclasses_are_registered_and_names_are_unique():
    with pytest.raises(TypeError, match="not a dataclass"):
        codec.register(dict)

    class Commit:  # noqa: F811 - a different class under a registered name
        pass

    import dataclasses

    with pytest.raises(TypeError, match="two classes named Commit"):
        codec.register(dataclasses.dataclass(Commit))
    with pytest.raises(codec.CodecError, match="register it"):
        codec.encode(object())


def test_a_large_spec_travels_deflated_and_a_lying_one_is_refused():
    plan = even_plan(dp=512, pp=8, tp=1, n_layers=32, global_batch=4096, micro_batch=1)
    spec = GenerationSpec(1, plan, plan.devices, 0, writers=plan.pipelines[0].devices)
    frame = codec.encode(Publish(spec))
    assert frame[:4] == b"CHZ1" and len(frame) < len(json.dumps(plan.devices)) * 3
    assert codec.decode(frame) == Publish(spec)
    for bad in (frame[:4] + struct.pack("<I", 10) + frame[8:], frame[:4] + struct.pack("<I", 0xFFFFFFFF) + frame[8:],
                frame[:-10]):
        with pytest.raises(codec.CodecError):
            codec.decode(bad)
