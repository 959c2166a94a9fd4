"""Which node holds which device: devices are numbered node by node, ``per_node`` to a node."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    nnodes: int
    per_node: int

    @classmethod
    def of(cls, launcher) -> Topology:
        return cls(launcher.nnodes or 1, launcher.nproc_per_node)

    @property
    def world(self) -> int:
        return self.nnodes * self.per_node

    def node_of(self, device: int) -> int:
        return device // self.per_node

    def devices_of(self, node: int) -> tuple[int, ...]:
        return tuple(range(node * self.per_node, (node + 1) * self.per_node))
