"""Engine actors of a node lending their threads while idle: the policy, the files, the engine loop's hook, and
two real Ray actors of one node."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pipeline_helpers import ENGINE, SAMPLING, workload

from batchgen.engine import EngineLoop, Request, SamplingParams
from batchgen.engine.process_identity import process_start
from batchgen.operators.engine_factory import load_engine
from batchgen.operators.thread_lending import (
    ENDED_AGE_S,
    IDLE_S,
    PREFIX,
    Peer,
    ThreadLending,
    lent_threads,
    remove_ended_jobs,
)

NOW = 1000.0
LONG_IDLE = NOW - IDLE_S - 1


@pytest.fixture
def own_threads():
    """ThreadLending sets this process's torch threads: put them back for the next test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_busy_engine_borrows_the_threads_of_peers_idle_long_enough():
    assert lent_threads(1, [], cores=8, now=NOW) == 1
    assert lent_threads(1, [Peer(1, LONG_IDLE)], cores=8, now=NOW) == 2
    assert lent_threads(1, [Peer(1, None)], cores=8, now=NOW) == 1  # the peer computes
    assert lent_threads(1, [Peer(3, NOW - IDLE_S / 2)], cores=8, now=NOW) == 1  # between two batches
    # two busy engines share two idle ones' four threads; an odd thread is not split
    assert lent_threads(2, [Peer(2, LONG_IDLE), Peer(2, LONG_IDLE), Peer(2, None)], cores=16, now=NOW) == 4
    assert lent_threads(1, [Peer(3, LONG_IDLE), Peer(1, None)], cores=16, now=NOW) == 2
    assert lent_threads(2, [Peer(8, LONG_IDLE)], cores=4, now=NOW) == 4  # never more than the node's cores


@pytest.fixture
def processes():
    """A live process and the pid of one that ended, to stand for peer engine actors."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    yield live.pid, ended.pid
    if live.poll() is None:
        live.kill()
        live.wait()


def peer_file(directory, pid, granted, idle_since, started=None):
    since = "-" if idle_since is None else idle_since
    (directory / str(pid)).write_text(f"{granted} {since} {started or process_start(pid)}")


def test_threads_follow_the_peers_files(tmp_path, processes, own_threads):
    live, ended = processes
    torch.set_num_threads(1)
    lending = ThreadLending(tmp_path, granted=1, cores=2)
    assert (tmp_path / str(os.getpid())).read_text().split()[:2] == ["1", "-"]  # busy while its engine loads
    peer_file(tmp_path, live, 1, time.time() - IDLE_S - 1)
    assert lending.busy() == 2 and torch.get_num_threads() == 2 and lending.changes == 1
    assert (tmp_path / str(os.getpid())).read_text().split()[1] == "-"  # published as busy
    peer_file(tmp_path, live, 1, None)  # the peer got work: the next recount gives its thread back
    lending._checked = 0.0
    assert lending.busy() == 1 and lending.changes == 2
    lending.idle()
    assert float((tmp_path / str(os.getpid())).read_text().split()[1]) <= time.time()
    lending.close()
    assert not (tmp_path / str(os.getpid())).exists()


def test_a_peer_that_ended_lends_its_grant_only_if_it_ran_beside_this_engine(tmp_path, processes, own_threads):
    live, ended = processes
    peer_file(tmp_path, ended, 1, None)  # an engine of an earlier pipeline: forgotten, its file removed
    torch.set_num_threads(1)
    lending = ThreadLending(tmp_path, granted=1, cores=2)
    assert lending.busy() == 1 and not (tmp_path / str(ended)).exists()
    peer_file(tmp_path, live, 1, None)  # a peer computing beside this engine, whose stage then ends
    lending._checked = 0.0
    assert lending.busy() == 1
    os.kill(live, 9)
    os.waitpid(live, 0)
    lending._checked = 0.0
    assert lending.busy() == 2 and (tmp_path / str(live)).exists()
    # a new engine actor (the dead one's replacement, on its CPUs) removes that file as it starts: no peer lends
    # the dead one's grant beside it while it loads
    replacement = ThreadLending(tmp_path, granted=1, cores=2)
    assert not (tmp_path / str(live)).exists()
    lending._checked = 0.0
    assert lending.busy() == 1
    replacement.close()


def test_a_file_whose_pid_now_names_another_process_is_an_ended_engines(tmp_path, processes, own_threads):
    live, _ = processes
    torch.set_num_threads(1)
    lending = ThreadLending(tmp_path, granted=1, cores=2)
    peer_file(tmp_path, live, 1, time.time() - IDLE_S - 1)  # an idle peer lends its thread
    # an engine killed while it computed left its file, and the system has since given its pid to another process
    reused = os.getppid()
    peer_file(tmp_path, reused, 1, None, started=str(int(process_start(reused)) + 1))
    assert lending.busy() == 2  # counted as computing, it would take half of the idle peer's thread
    assert not (tmp_path / str(reused)).exists()


def test_the_lending_directories_of_ended_jobs_are_removed(tmp_path, processes):
    live, ended = processes
    now = time.time()

    def job(name, pids, age=2 * ENDED_AGE_S, text=None, partial=None):
        directory = tmp_path / name
        directory.mkdir()
        for pid in pids:
            peer_file(directory, pid, 1, None)
        if text is not None:
            (directory / "7").write_text(text)
        if partial is not None:  # an engine killed inside _publish, between creating its .tmp and replacing
            (directory / f"{live}.tmp").write_text(partial)
        os.utime(directory, (now - age, now - age))
        return directory

    ended_job = job(f"{PREFIX}01-a", [ended])
    ended_empty = job(f"{PREFIX}02-a", [])
    running = job(f"{PREFIX}03-a", [ended, live])  # one engine left, another still computes
    recent = job(f"{PREFIX}04-a", [ended], age=ENDED_AGE_S / 2)  # an engine may be starting in it
    unreadable = job(f"{PREFIX}05-a", [ended], text="being written")
    own = job(f"{PREFIX}06-a", [ended])
    other = job("someone-elses", [ended])
    killed_writing = job(f"{PREFIX}07-a", [ended], partial="")  # the .tmp's name is no matter: a live pid here
    killed_half_way = job(f"{PREFIX}08-a", [], partial="2 -")
    assert sorted(remove_ended_jobs(tmp_path, keep=own, now=now)) == [ended_job, ended_empty, killed_writing,
                                                                        killed_half_way]
    assert not any(d.exists() for d in (ended_job, ended_empty, killed_writing, killed_half_way))
    assert all(d.exists() for d in (running, recent, unreadable, own, other))
    assert len(list(running.iterdir())) == 2  # nothing removed from a directory that stays


def test_the_engine_loop_says_when_it_computes_and_when_it_runs_out_of_work(tiny_moe_dir):
    states: list[bool] = []
    engine = load_engine(tiny_moe_dir, **ENGINE)
    loop = EngineLoop(lambda: engine, on_work=states.append)
    params = SamplingParams.from_dict(SAMPLING)
    requests = [Request(f"r{i}", prompt=p, sampling=params) for i, p in enumerate(workload(3))]

    results = asyncio.run(loop.run([r.request_id for r in requests], lambda engine, i: engine.add_request(requests[i])))
    deadline = time.time() + 10
    while (not states or states[-1]) and time.time() < deadline:  # the loop goes idle after the last step
        time.sleep(0.01)
    loop.close()
    assert all(r.error is None for r in results)
    assert states[0] is False  # idle before the first request
    steps = states.count(True)
    assert steps >= max(len(r.outputs[0].token_ids) for r in results)  # once before every step
    assert states[-1] is False


def test_a_failing_on_work_hook_costs_the_lending_not_the_engine(tiny_moe_dir):
    """The hook writes files (a full disk, a cleaned /tmp): its error ended the engine thread and every request
    waited for good."""
    engine = load_engine(tiny_moe_dir, **ENGINE)
    calls = []

    def failing(busy: bool) -> None:
        calls.append(busy)
        raise OSError(28, "No space left on device")

    loop = EngineLoop(lambda: engine, on_work=failing)
    params = SamplingParams.from_dict(SAMPLING)
    requests = [Request(f"r{i}", prompt=p, sampling=params) for i, p in enumerate(workload(2))]
    results = asyncio.run(asyncio.wait_for(
        loop.run([r.request_id for r in requests], lambda engine, i: engine.add_request(requests[i])), 60))
    loop.close()
    assert all(r.error is None and r.outputs[0].token_ids for r in results) and True in calls


def test_engine_actors_of_a_node_lend_their_threads(ray_cluster, tmp_path):
    import ray

    from batchgen.operators.thread_lending import lend_threads

    @ray.remote(num_cpus=0.5)
    class Actor:
        def __init__(self, directory: str):
            torch.set_num_threads(1)
            joined = lend_threads(1, {})
            self.shared = joined.directory.name
            joined.close()
            # the lending itself in this test's own directory: the suite's other engine actors share the Ray job
            self.lending = ThreadLending(Path(directory), 1)

        def directory(self) -> str:
            return self.shared

        def work(self, busy: bool) -> int:
            self.lending.on_work(busy)
            return torch.get_num_threads()

        def group_rank_lends(self) -> bool:
            return lend_threads(1, {"ep_size": 2}) is not None

        def recount(self) -> int:
            self.lending._checked = 0.0
            return self.lending.busy()

    first, second = Actor.remote(str(tmp_path)), Actor.remote(str(tmp_path))
    # the engine actors of one Ray job and node meet in one directory
    assert ray.get(first.directory.remote()) == ray.get(second.directory.remote())
    assert ray.get_runtime_context().get_job_id() in ray.get(first.directory.remote())
    assert ray.get(second.work.remote(False)) == 1
    time.sleep(IDLE_S + 0.1)
    cores = min(2, os.cpu_count() or 1)
    assert ray.get(first.work.remote(True)) == cores  # the idle one's thread
    assert ray.get(second.work.remote(True)) == 1
    assert ray.get(first.recount.remote()) == 1  # given back at the next recount
    assert not ray.get(first.group_rank_lends.remote())  # each rank of an engine group has its fixed share
    ray.kill(first)
    ray.kill(second)
    assert lend_threads(1, {}) is None  # the driver is no engine actor
