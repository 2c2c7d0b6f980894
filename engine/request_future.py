"""The future of one request's Result: what EngineLoop hands its callers, one per request.

A job of short rows submits thousands of requests a second. concurrent.futures.Future builds a Condition (a lock
and a waiter list) per instance for blocking waits that callers here rarely make (they wait for a whole batch, or
take a callback), and building them was ~5 % of BatchGen's host time on 4-16-token rows. This one keeps a state,
a value and its callbacks, settled and read under one lock that every instance shares (each holds it for a few
instructions); a blocking `result(timeout)` makes its own event. Like concurrent.futures, it settles once, and a
callback that raises is logged, not propagated into the engine thread that settled it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_PENDING, _DONE, _FAILED, _CANCELLED = range(4)


class RequestFuture:
    __slots__ = ("_state", "_value", "_callbacks")

    def __init__(self) -> None:
        self._state = _PENDING
        self._value: Any = None
        self._callbacks: list[Callable[[RequestFuture], object]] | None = []

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def result(self, timeout: float | None = None) -> Any:
        """The Result, once settled (waiting up to `timeout` seconds; None: for as long as it takes); raises the
        engine's failure, CancelledError, or TimeoutError."""
        self._wait(timeout)
        if self._state == _DONE:
            return self._value
        raise self._error()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        if self._state in (_DONE, _FAILED):
            return self._value if self._state == _FAILED else None
        raise self._error()

    def add_done_callback(self, fn: Callable[[RequestFuture], object]) -> None:
        """`fn(self)` once settled: now, on this thread, if it already is; else on the thread that settles it."""
        with _LOCK:
            if self._state == _PENDING:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def set_result(self, result: Any) -> bool:
        return self._settle(_DONE, result)

    def set_exception(self, exc: BaseException) -> bool:
        return self._settle(_FAILED, exc)

    def cancel(self) -> bool:
        return self._settle(_CANCELLED, None)

    def _settle(self, state: int, value: Any) -> bool:
        """False, changing nothing, if it was settled before."""
        with _LOCK:
            if self._state != _PENDING:
                return False
            self._state, self._value = state, value
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks:
            self._call(fn)
        return True

    def _wait(self, timeout: float | None) -> None:
        with _LOCK:
            if self._state != _PENDING:
                return
            settled = threading.Event()
            self._callbacks.append(lambda _future: settled.set())
        if not settled.wait(timeout):
            raise TimeoutError(f"the request has not finished within {timeout} s")

    def _call(self, fn: Callable[[RequestFuture], object]) -> None:
        try:
            fn(self)
        except Exception:  # as concurrent.futures: a caller's bug must not break the engine thread
            logger.exception("exception calling a request future's callback %r", fn)

    def _error(self) -> BaseException:
        return self._value if self._state == _FAILED else CancelledError()
