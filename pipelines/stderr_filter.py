"""Keeps Ray's known-harmless log lines out of a `batchgen` user's terminal, and lets everything else through.

Ray's C++ core worker writes some lines at error level straight to the driver process's stderr, past Python's
logging and `log_to_driver`. One comes with every job: engine actors restart after a crash (max_restarts), and
Ray Data passes every actor pool's map function by object reference, so each pool's creation prints "Actor with
class name ... has constructor arguments in the object store and max_restarts > 0" -- about a reference the job
keeps alive for its whole run. `batchgen run` and `batchgen demo` (without --verbose) run the job with file
descriptor 2 drained through a thread that drops lines matching HARMLESS and passes every other line on as it
arrives, so a real error still reaches the terminal.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

HARMLESS = (
    re.compile(rb"core_worker\.cc:\d+: Actor with class name: .* has constructor arguments in the object store and "
               rb"max_restarts > 0"),
)
JOIN_S = 5.0  # for the drain thread after the job: a child process still holding the pipe must not hang the CLI


@contextmanager
def filtered_stderr(harmless: tuple[re.Pattern, ...] = HARMLESS) -> Iterator[TextIO]:
    """Inside, file descriptor 2 (every writer of this process, C++ included) goes through the filter; yields a
    text stream on the original stderr for output that must not wait for a line's end (a progress bar)."""
    sys.stderr.flush()
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    drain = threading.Thread(target=_drain, args=(read_end, terminal, harmless), daemon=True, name="stderr-filter")
    drain.start()
    stream = os.fdopen(os.dup(terminal), "w", buffering=1)
    try:
        yield stream
    finally:
        stream.close()
        sys.stderr.flush()
        os.dup2(terminal, 2)  # the pipe's last write end in this process: the drain thread reads its end
        drain.join(JOIN_S)
        os.close(terminal)


def _drain(read_end: int, terminal: int, harmless: tuple[re.Pattern, ...]) -> None:
    pending = b""
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not any(p.search(line) for p in harmless))
            if kept:
                _write_all(terminal, kept)
    if pending and not any(p.search(pending) for p in harmless):
        _write_all(terminal, pending)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
