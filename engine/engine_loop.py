"""One engine driven by one background thread, fed by any number of callers.

The engine is not thread-safe, while its callers are many: Ray Data calls an async UDF from an
event loop with several batches in flight, and the Batch API server feeds requests from its own
thread. So one thread owns the engine: between steps it runs what callers submitted (adding
requests, aborting them), steps the engine, and resolves each request's future as its Result comes
back. Everything in flight lands in the same engine, which is what lets it over-subscribe (more
sequences than it runs at once) and COMBINE across callers. An engine exception fails every
pending and later request: a broken engine must not silently drop work.

MIGRATE between engines goes through the loop too: `export` takes requests out of this engine (their
futures stay pending here, the caller's), `adopt` runs requests another engine exported and hands each
Result to a callback instead, `resolve` completes this loop's futures with Results that came back,
`rerun` runs an exported request here again (from a checkpoint, or from its prompt) when the engine
holding it died, and `snapshot` copies suspended requests out as checkpoints. `load` is the engine's
load as of its last step or command, readable from any thread without waiting for either.

Admission is bounded: `run` waits while the requests it has handed over and not yet got back would
exceed `max_outstanding` (by default twice the engine's `max_num_seqs`: one set running, one set
waiting to refill), so callers that keep many batches in flight get back-pressure instead of an
unbounded queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from batchgen.engine.engine import Engine
from batchgen.engine.engine_load import EngineLoad
from batchgen.engine.errors import InvalidRequestError
from batchgen.engine.migration import MigratedRequest
from batchgen.engine.parallel.group_engine import GroupEngine
from batchgen.engine.request import Request, Result
from batchgen.engine.request_future import RequestFuture

log = logging.getLogger(__name__)

LOAD_REFRESH_S = 0.05  # `load` is recounted after a step at most this often (it walks every request), and
# always after the step that leaves the engine idle

# what to run on the engine thread, and the futures it owns (failed with the engine)
_Command = tuple[Callable[[], None], list[Future | RequestFuture]]


class EngineLoop:
    def __init__(self, make_engine: Callable[[], Engine | GroupEngine], max_outstanding: int | None = None,
                 on_work: Callable[[bool], object] | None = None) -> None:
        """Build the engine on the loop's own thread: loading the model there keeps the model's
        OpenMP team on the thread that runs every step (a second team makes each small op pay a
        wake-up). A construction error is raised here, in the caller. `on_work(busy)` runs on that
        thread too: with True before each step, with False when the engine runs out of work (an engine
        actor lends its threads meanwhile: operators/thread_lending.py)."""
        self._on_work = on_work
        self._inbox: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._pending: dict[str, RequestFuture] = {}
        self._adopted: dict[str, Callable[[Result], None]] = {}  # foreign request id -> who gets its Result
        self._exported: dict[str, Request] = {}  # this loop's requests running elsewhere, to rerun if lost
        self.load = EngineLoad(0, 0, 0.0)
        self._load_at = 0.0
        self.failure: BaseException | None = None
        self._closed = False
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(make_engine, ready), name="batchgen-engine",
                                        daemon=True)
        self._thread.start()
        self.engine: Engine | GroupEngine = ready.result()
        self.load = self.engine.load()
        self.max_outstanding = max_outstanding or 2 * self.load.batch
        self._outstanding = 0  # requests handed over by `run` whose futures are not done
        self._room = threading.Condition()

    def submit(self, request_ids: list[str], add: Callable[[Engine, int], None]) -> list[RequestFuture]:
        """Add these requests on the engine thread (`add(engine, i)` adds the i-th); one future per request id.
        An id this loop already has running (here or moved elsewhere), or twice in one submission, is not added:
        its future gets a Result with the error, and the request running under that id goes on undisturbed (the
        engine's own check would fail the new one under the same id, taking the old one's future). An id this
        loop runs for another engine (`adopt`) is the same request, submitted again by a task Ray Data runs
        here after that engine died: its future gets the Result the running request ends with. An `add` the engine
        refuses (InvalidRequestError) fails its request alone."""
        futures = [RequestFuture() for _ in request_ids]

        def command() -> None:
            fresh = []
            for i, (rid, future) in enumerate(zip(request_ids, futures)):
                if rid in self._adopted and rid not in self._pending:
                    self._pending[rid] = future
                elif rid in self._pending or rid in self._exported or rid in self._adopted:
                    future.set_result(Result(rid, [], error=f"duplicate request_id {rid!r}: a request with this id "
                                                            f"is already running"))
                else:
                    self._pending[rid] = future
                    fresh.append(i)
            for i in fresh:
                try:
                    add(self.engine, i)
                except InvalidRequestError as exc:  # refused by the engine's checks: this request alone fails
                    self._pending.pop(request_ids[i]).set_result(Result(request_ids[i], [], error=str(exc)))
            self._refresh_load()

        self._inbox.put((command, futures, None))
        return futures

    async def run(self, request_ids: list[str], add: Callable[[Engine, int], None]) -> list[Result]:
        """Wait for room under `max_outstanding`, `submit`, then await the Results in request order. The
        caller's event loop is woken once, when the last of them is done: an asyncio future per request
        (and a wake-up per row) cost a job of short rows as much host time as the rest of the batch."""
        count = len(request_ids)
        reserving = asyncio.ensure_future(asyncio.to_thread(self._reserve, count))
        try:
            await asyncio.shield(reserving)
        except asyncio.CancelledError:  # the caller gave up waiting: the thread still reserves, so give them back
            reserving.add_done_callback(lambda done: not done.cancelled() and done.exception() is None
                                        and self._give_back(count))
            raise
        futures = self.submit(request_ids, add)
        loop = asyncio.get_running_loop()
        all_done = loop.create_future()
        remaining = [len(futures)]
        counting = threading.Lock()  # done callbacks run on the engine thread, or here if already done

        def one_done(future: RequestFuture) -> None:
            self._release(future)
            with counting:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last and not loop.is_closed():
                loop.call_soon_threadsafe(lambda: all_done.done() or all_done.set_result(None))

        for future in futures:
            future.add_done_callback(one_done)
        if futures:
            await all_done
        return [future.result() for future in futures]

    def _reserve(self, count: int) -> None:
        """Block until `count` more requests fit (a submission larger than the bound goes in alone)."""
        with self._room:
            while self._outstanding and self._outstanding + count > self.max_outstanding:
                self._room.wait()
            self._outstanding += count

    def _release(self, _future: RequestFuture) -> None:
        self._give_back(1)

    def _give_back(self, count: int) -> None:
        with self._room:
            self._outstanding -= count
            self._room.notify_all()

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests between two steps and free their KV; their futures are cancelled. One running
        elsewhere (exported) is forgotten: its Result is dropped, and it does not run here again if its holder
        dies. One run here for another engine (adopted) ends with an error Result to its owner."""
        def command() -> None:
            for rid in request_ids:
                self.engine.abort(rid)
                self._exported.pop(rid, None)
                owner = self._adopted.pop(rid, None)
                if owner is not None:
                    owner(Result(rid, [], error="aborted on the engine that ran it"))
                future = self._pending.pop(rid, None)
                if future is not None:
                    future.cancel()

        self._inbox.put((command, [], None))

    def export(self, tokens: int) -> Future:
        """Take requests with about `tokens` output tokens still to generate out of the engine
        (Engine.movable_requests), never one adopted from another engine (it moves once: its Result goes
        back along one hop); the future resolves to their MigratedRequests. Their Results come back
        through `resolve` (or `rerun`)."""
        def command() -> list[MigratedRequest]:
            ids = self.engine.movable_requests(tokens, keep=self._adopted)
            moved = [m for m in map(self.engine.export_request, ids) if m]
            self._exported.update((m.request.request_id, m.request) for m in moved)
            return moved

        return self._call(command)

    def adopt(self, migrated: list[MigratedRequest], on_result: Callable[[Result], None]) -> Future:
        """Continue requests another engine exported; `on_result(result)` runs on the engine thread as each
        finishes (a request this engine cannot run comes back as a Result with its error). The future
        resolves once they are in the engine. A request this loop runs already for another engine (its owner died,
        and the task rerun elsewhere moved it here again) is not started twice: its Result goes to `on_result`."""
        def command() -> None:
            for item in migrated:
                rid = item.request.request_id
                if rid in self._adopted:
                    self._adopted[rid] = on_result
                    continue
                try:
                    self.engine.import_request(item)
                except InvalidRequestError as exc:
                    on_result(Result(rid, [], error=str(exc)))
                    continue
                self._adopted[rid] = on_result

        def failed() -> None:  # their owners record the failure (a holder waiting for them would wait for good)
            for item in migrated:
                on_result(Result(item.request.request_id, [], error=str(self.failure)))

        return self._call(command, failed)

    def resolve(self, results: list[Result]) -> None:
        """Results of this loop's exported requests, finished by another engine."""
        def command() -> None:
            for result in results:
                if self._exported.pop(result.request_id, None) is not None:
                    self._finish(result)

        self._call(command)

    def rerun(self, lost: dict[str, MigratedRequest | None]) -> None:
        """Exported requests whose engine died: continue each here from its checkpoint, or run it again
        from its prompt (None)."""
        def command() -> None:
            for rid, checkpoint in lost.items():
                request = self._exported.pop(rid, None)
                if request is None:
                    continue
                try:
                    if checkpoint is None:
                        self.engine.add_request(request)
                    else:
                        self.engine.import_request(checkpoint)
                except InvalidRequestError as exc:
                    self._finish(Result(rid, [], error=str(exc)))

        self._call(command)

    def snapshot(self, skip: Callable[[str, int], bool]) -> Future:
        """Copies of the requests suspended in host pages (Engine.snapshot_request), but those for which
        `skip(request_id, tokens generated)` says a checkpoint is recent enough."""
        def command() -> list[MigratedRequest]:
            wanted = [rid for rid, generated in self.engine.suspended_requests().items() if not skip(rid, generated)]
            return [s for s in map(self.engine.snapshot_request, wanted) if s is not None]

        return self._call(command)

    def _call(self, fn: Callable[[], object], on_failure: Callable[[], None] | None = None) -> Future:
        """Run `fn` on the engine thread between two steps (then recount the load); a future of its value. Once
        the engine has failed, `fn` does not run: `on_failure` does (and the future raises the failure)."""
        done: Future = Future()

        def command() -> None:
            try:
                value = fn()
            except BaseException as exc:
                done.set_exception(exc)
                raise
            self._refresh_load()
            done.set_result(value)

        self._inbox.put((command, [done], on_failure))
        return done

    def close(self) -> None:
        """Stop the thread after the current step; unfinished requests stay unresolved. An engine spanning
        several ranks (engine/parallel) stops them too."""
        self._closed = True
        self._inbox.put(None)
        self._thread.join()
        if isinstance(self.engine, GroupEngine):
            self.engine.close()

    def _run(self, make_engine: Callable[[], Engine], ready: Future) -> None:
        try:
            self.engine = make_engine()
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(self.engine)
        while not self._closed:
            out_of_work = self.failure is not None or not self.engine.has_unfinished()
            if out_of_work:
                self._tell_work(False)
            if not self._run_commands(block=out_of_work):
                return
            if self.failure is not None or self._closed:
                continue
            if self.engine.has_unfinished():
                self._tell_work(True)
            try:
                finished = self.engine.step()
            except BaseException as exc:  # handed to every waiting caller
                self._fail(exc)
                continue
            if not self.engine.has_unfinished() or time.perf_counter() - self._load_at > LOAD_REFRESH_S:
                self._refresh_load()
            for result in finished:
                self._finish(result)

    def _refresh_load(self) -> None:
        self.load, self._load_at = self.engine.load(), time.perf_counter()

    def _finish(self, result: Result) -> None:
        callback = self._adopted.pop(result.request_id, None)
        if callback is not None:
            callback(result)
        future = self._pending.pop(result.request_id, None)  # (an adopted request's: submitted here again)
        if future is not None:
            future.set_result(result)

    def runs_for_another(self, request_id: str) -> bool:
        """Whether this loop runs `request_id` for another engine (adopted): a task submitting it again here
        gets its Result (`submit`)."""
        return request_id in self._adopted

    def _tell_work(self, busy: bool) -> None:
        """`on_work(busy)`, whose failure (thread lending's files: a full disk, a cleaned /tmp) costs the lending,
        not the engine thread: raised here, it ended the thread and left every future waiting."""
        if self._on_work is None:
            return
        try:
            self._on_work(busy)
        except Exception:  # noqa: BLE001
            log.warning("engine loop: the on_work hook failed; the engine goes on", exc_info=True)

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command (waiting for one when `block`); False once closed."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if item is None:
                return False
            block = False
            command, futures, on_failure = item
            if self.failure is not None:
                for future in futures:
                    future.set_exception(self.failure)
                if on_failure is not None:
                    on_failure()
                continue
            try:
                command()
            except BaseException as exc:
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.failure = RuntimeError(f"the engine failed: {exc!r}")
        self.failure.__cause__ = exc
        for future in self._pending.values():
            future.set_exception(self.failure)
        self._pending.clear()
        for rid, callback in self._adopted.items():  # their owners record the failure, not lose the rows
            callback(Result(rid, [], error=str(self.failure)))
        self._adopted.clear()
