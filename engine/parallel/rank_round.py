"""One round of an engine group: the leader's calls for every rank, then (optionally) one step of all ranks.

Every rank runs the same rounds in the same order, so the steps' MoE collectives line up: a round is the
unit of lockstep. The leader broadcasts the round, each rank runs its own calls on its Engine, steps it if
the round says so, and the leader gathers one reply per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchgen.engine.engine_load import EngineLoad
from batchgen.engine.errors import InvalidRequestError
from batchgen.engine.parallel.partition import RankEngines
from batchgen.engine.parallel.rank_group import RankGroup
from batchgen.engine.request import Result

# Engine methods the leader may call on a rank (nothing else runs from a round).
RANK_METHODS = frozenset({
    "add_request", "abort", "add_prefilled", "check_prefilled", "import_request", "export_request", "export_straggler",
    "snapshot_request", "suspended_requests", "movable_requests",
})
# RankEngines methods: a straggler PARTITIONed over every rank (engine/parallel/partition.py), and metrics
PARTITION_METHODS = frozenset({"start_partition", "end_partition", "partition_error", "metrics", "completion_times"})


@dataclass(frozen=True)
class RankCall:
    method: str
    args: tuple
    request_id: str | None = None  # the request a failed call answers for, with an error Result


@dataclass(frozen=True)
class Round:
    calls: list[list[RankCall]]  # per rank
    step: bool


@dataclass
class RankReply:
    values: list[tuple[bool, Any]] = field(default_factory=list)  # per call: (True, value) or (False, error)
    results: list[Result] = field(default_factory=list)
    load: EngineLoad = EngineLoad(0, 0, 0.0)
    unfinished: bool = False


def run_round(engines: RankEngines, calls: list[RankCall], step: bool) -> RankReply:
    """A rank's share of a round: calls on its Engine (an abort while a straggler is partitioned: on the
    partition's), then a step of the partition's engine if there is one, else of its own. A call the engine
    refuses (InvalidRequestError) is answered with the error. Anything else raises: it may have left the rank
    part-way through a step's collectives, so the group is broken (a rank process exits, which fails the
    others' pending collectives at once instead of at their timeout)."""
    reply = RankReply()
    for call in calls:
        if call.method in PARTITION_METHODS:
            target = engines
        elif call.method in RANK_METHODS:
            target = engines.active if call.method == "abort" else engines.engine
        else:
            raise ValueError(f"engine group: {call.method!r} is not a rank method")
        try:
            reply.values.append((True, getattr(target, call.method)(*call.args)))
        except InvalidRequestError as exc:
            reply.values.append((False, exc))
    engine = engines.active
    if step:
        reply.results = engine.step()
    reply.load, reply.unfinished = engine.load(), engine.has_unfinished()
    return reply


def broadcast_round(group: RankGroup, message: Round | None) -> Round | None:
    """The leader sends `message` (None: the group stops); the other ranks receive it."""
    return group.channel.broadcast(message)


def gather_replies(group: RankGroup, reply: RankReply) -> list[RankReply] | None:
    """Every rank's reply, in rank order, at the leader (None elsewhere)."""
    return group.channel.gather(reply)
