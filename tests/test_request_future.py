"""engine/request_future.py: what EngineLoop's callers rely on of a request's future, as concurrent.futures gives."""

import threading
from concurrent.futures import CancelledError

import pytest

from batchgen.engine.request_future import RequestFuture


def test_settles_once_and_runs_callbacks_before_and_after():
    future, seen = RequestFuture(), []
    future.add_done_callback(lambda f: seen.append(("early", f.result())))
    assert not future.done()
    assert future.set_result("r") is True
    assert future.set_exception(RuntimeError("late")) is False and future.cancel() is False  # settled once
    future.add_done_callback(lambda f: seen.append(("late", f.result())))
    assert seen == [("early", "r"), ("late", "r")] and future.exception() is None and not future.cancelled()


def test_failure_cancel_and_a_raising_callback(caplog):
    failed = RequestFuture()
    failed.add_done_callback(lambda f: 1 / 0)  # logged; the settling thread goes on
    failed.set_exception(RuntimeError("the engine failed"))
    assert isinstance(failed.exception(), RuntimeError)
    with pytest.raises(RuntimeError, match="the engine failed"):
        failed.result()
    assert "ZeroDivisionError" in caplog.text
    cancelled = RequestFuture()
    assert cancelled.cancel() and cancelled.cancelled()
    with pytest.raises(CancelledError):
        cancelled.result()


def test_result_blocks_until_another_thread_settles_it_or_times_out():
    future = RequestFuture()
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)
    timer = threading.Timer(0.05, future.set_result, args=("done",))
    timer.start()
    assert future.result(timeout=10) == "done"
    timer.join()
