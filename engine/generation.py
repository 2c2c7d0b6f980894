"""Offline generation over any engine's add_request / has_unfinished / step (one rank or a group of them)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from batchgen.engine.request import Request, Result


class Generates:
    def generate(self, requests: Iterable[Request]) -> list[Result]:
        """Every request's Result, in request order."""
        requests = list(requests)
        by_id = {r.request_id: r for r in self.stream(requests)}
        return [by_id[r.request_id] for r in requests]

    def stream(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Results as requests finish."""
        for request in requests:
            self.add_request(request)
        while self.has_unfinished():
            yield from self.step()
