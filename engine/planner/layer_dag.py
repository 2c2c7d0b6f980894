"""A layer's forward pass as a DAG of timed nodes, and its critical path.

Nodes run on streams (the compute stream, the copy stream); two nodes of one stream run in the order
they were added, so each stream is a chain of edges. A node starts when every predecessor is done: a
staged micro-batch's attention waits for its KV copy, the MoE waits for every attention micro-batch
(the COMBINE), and a prefetched copy overlaps whatever computes meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LayerDag:
    names: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    preds: list[list[int]] = field(default_factory=list)
    _last_on: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, seconds: float, stream: str, after: tuple[int, ...] = ()) -> int:
        """A node that runs for `seconds` on `stream` once every node in `after` (and the stream's previous
        node) is done; returns its id. Ids are a topological order by construction."""
        node = len(self.names)
        preds = list(after)
        if stream in self._last_on:
            preds.append(self._last_on[stream])
        if any(p >= node or p < 0 for p in preds):
            raise ValueError(f"node {name!r} depends on unknown nodes {preds}")
        self._last_on[stream] = node
        self.names.append(name)
        self.seconds.append(seconds)
        self.preds.append(preds)
        return node

    def critical_path(self) -> tuple[float, list[str]]:
        """(length, node names on it): the earliest finish of the last node, one pass over nodes and edges."""
        finish = [0.0] * len(self.names)
        via = [-1] * len(self.names)
        for node, preds in enumerate(self.preds):
            start = 0.0
            for p in preds:
                if finish[p] > start:
                    start, via[node] = finish[p], p
            finish[node] = start + self.seconds[node]
        if not finish:
            return 0.0, []
        node = max(range(len(finish)), key=finish.__getitem__)
        length, path = finish[node], []
        while node >= 0:
            path.append(self.names[node])
            node = via[node]
        return length, path[::-1]
