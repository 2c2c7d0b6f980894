"""Offline generation over any engine's add_request / has_unfinished / step (one rank or a group of them)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from batchgen.engine.request import Request, Result


class Generates:
    def generate(self, requests: Iterable[Request]) -> list[Result]:
        """Every request's Result, in request order; a request whose id an earlier one of the call has gets an
        error Result in its place (results are matched to requests by id). On an engine with no unfinished
        requests: those added before would finish inside this call, their Results taken by it."""
        if self.has_unfinished():
            raise RuntimeError("generate runs on an engine with no unfinished requests: requests added before are "
                               "still running (take their Results from step() or stream())")
        requests = list(requests)
        results: list[Result | None] = [None] * len(requests)
        first: dict[str, int] = {}
        for i, request in enumerate(requests):
            if request.request_id in first:
                results[i] = Result(request.request_id, [], error=f"duplicate request_id {request.request_id!r}: "
                                                                  f"an earlier request of this call has it")
            else:
                first[request.request_id] = i
        for result in self.stream([requests[i] for i in first.values()]):
            results[first[result.request_id]] = result
        return results

    def stream(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Results as requests finish."""
        for request in requests:
            self.add_request(request)
        while self.has_unfinished():
            yield from self.step()
