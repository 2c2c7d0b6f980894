"""CPU seconds and peak resident memory of a process tree during a run, by who spent them.

Shared by the Ray benches (bench/pipeline.py, bench/scale.py): a pipeline's cost is spread over the
driver, the engine actors, Ray Data's read / write workers and Ray's own processes, and only sampling
every process of the tree tells them apart.
"""

from __future__ import annotations

import os
import re
import threading

import psutil


class ProcessAccount:
    """Samples the tree under `root_pid` (default: this process, the driver) from a thread, since Ray
    Data kills a stage's actors once it is done. A process is booked under its title at the time of the
    sample (pooled Ray workers change title with every task); the root is "driver".

    `seconds`: CPU seconds of the driver, the engine actors (Ray actors whose title is one of
    `engine_stages`' map workers), Ray's other processes (read / tokenize / write workers, Ray Data's
    bookkeeping actors, raylet, GCS, agents: the root's descendants when it started the Ray session) and
    everything else on the machine (other users' jobs). `by_process`: CPU seconds per title.
    `peak_rss`: the largest resident set (bytes) any process of a title had at a sample."""

    def __init__(self, engine_stages: tuple[str, ...] = (), interval_s: float = 0.25,
                 root_pid: int | None = None) -> None:
        self.engine_titles = tuple(f"MapWorker(MapBatches({stage}))" for stage in engine_stages)
        self.interval_s = interval_s
        self.root_pid = root_pid or os.getpid()
        self.by_process: dict[str, float] = {}
        self.peak_rss: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-account", daemon=True)

    def __enter__(self) -> ProcessAccount:
        self._machine_start = _busy_seconds(psutil.cpu_times())
        self._sample(record=False)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(record=True)
        self.seconds = {"driver": 0.0, "engine_actors": 0.0, "other_ray": 0.0}
        for name, seconds in self.by_process.items():
            role = ("driver" if name == "driver" else
                    "engine_actors" if name in self.engine_titles else "other_ray")
            self.seconds[role] += seconds
        ours = sum(self.seconds.values())
        self.seconds["other_users"] = max(0.0, _busy_seconds(psutil.cpu_times()) - self._machine_start - ours)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample(record=True)

    def _sample(self, record: bool) -> None:
        try:
            root = psutil.Process(self.root_pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:  # the root (a subprocess driver) has exited
            return
        for proc in tree:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    rss = proc.memory_info().rss
                    cmdline = proc.cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            name = "driver" if proc.pid == self.root_pid else _process_name(cmdline)
            self.peak_rss[name] = max(self.peak_rss.get(name, 0), rss)
            total = times.user + times.system
            spent = total - self._last.get(proc.pid, 0.0 if record else total)  # new since start: all of it
            self._last[proc.pid] = total
            if record and spent > 0:
                self.by_process[name] = self.by_process.get(name, 0.0) + spent


def cpu_text(seconds: dict[str, float]) -> str:
    return "CPU-s " + ", ".join(f"{who} {spent:.1f}" for who, spent in seconds.items())


def _process_name(cmdline: list[str]) -> str:
    """'ray::MapWorker(MapBatches(Decode)).submit' -> 'MapWorker(MapBatches(Decode))',
    'ray::KVOwner.put' -> 'KVOwner', '.../python -u .../raylet/raylet ...' -> 'raylet',
    'ray::ReadX->SplitBlocks(13)' -> 'ReadX' (the split factor changes with the input's size)."""
    title = " ".join(cmdline)
    if title.startswith("ray::"):
        name = re.sub(r"->SplitBlocks\(\d+\)", "", title[len("ray::"):].split(" ")[0])
        head, cut, _ = name.rpartition(").")
        return head + ")" if cut else name.split(".")[0]
    script = next((arg for arg in cmdline[1:] if arg.endswith(".py")), cmdline[0] if cmdline else "?")
    return os.path.basename(script)


def _busy_seconds(times) -> float:
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)
