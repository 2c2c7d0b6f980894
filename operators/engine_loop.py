"""One engine driven by one background thread, fed by async callers.

The engine is not thread-safe, and Ray Data calls an async UDF from an event loop with several
batches in flight. So one thread owns the engine: it admits whatever callers submitted, steps the
engine, and resolves each request's future as its Result comes back. Every batch in flight lands
in the same engine, which is what lets it over-subscribe (more sequences than it runs at once)
and COMBINE across batches. An engine exception fails every pending and later request: a broken
engine must not silently drop rows.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from batchgen.engine import Engine, Result

_Submission = tuple[Callable[[Engine], None], dict[str, Future]]


class EngineLoop:
    def __init__(self, make_engine: Callable[[], Engine]) -> None:
        """Build the engine on the loop's own thread: loading the model there keeps the model's
        OpenMP team on the thread that runs every step (a second team makes each small op pay a
        wake-up). A construction error is raised here, in the caller."""
        self._inbox: queue.SimpleQueue[_Submission] = queue.SimpleQueue()
        self._pending: dict[str, Future] = {}
        self._failure: BaseException | None = None
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(make_engine, ready), name="batchgen-engine",
                                        daemon=True)
        self._thread.start()
        self.engine: Engine = ready.result()

    async def run(self, request_ids: list[str], admit: Callable[[Engine], None]) -> list[Result]:
        """Call `admit(engine)` on the engine thread (it adds the requests), then await their Results."""
        futures = {rid: Future() for rid in request_ids}
        if len(futures) != len(request_ids):
            raise ValueError("duplicate request ids in one submission")
        self._inbox.put((admit, futures))
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures.values())))

    def _run(self, make_engine: Callable[[], Engine], ready: Future) -> None:
        try:
            self.engine = make_engine()
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(self.engine)
        while True:
            failed = self._failure is not None
            self._admit(block=failed or not self.engine.has_unfinished())
            if failed or self._failure is not None:
                continue
            try:
                finished = self.engine.step()
            except BaseException as exc:  # handed to every waiting caller
                self._fail(exc)
                continue
            for result in finished:
                future = self._pending.pop(result.request_id, None)
                if future is not None:
                    future.set_result(result)

    def _admit(self, block: bool) -> None:
        while True:
            try:
                admit, futures = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if self._failure is not None:
                for future in futures.values():
                    future.set_exception(self._failure)
                continue
            self._pending.update(futures)
            try:
                admit(self.engine)
            except BaseException as exc:
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self._failure = RuntimeError(f"the engine failed: {exc!r}")
        self._failure.__cause__ = exc
        for future in self._pending.values():
            future.set_exception(self._failure)
        self._pending.clear()
