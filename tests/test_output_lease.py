"""One run at a time on an output folder: a second run is refused while the first holds the folder (and leaves its
temporary files alone), an ended holder is taken over, and of two runs claiming at once exactly one wins."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from pipeline_helpers import workload, write_input

from batchgen.engine.process_identity import pid_space, process_start
from batchgen.pipelines import output_lease
from batchgen.pipelines.output_lease import LEASE, LeaseHeld, OutputLease
from batchgen.pipelines.pipeline import JobConfig, JobError, plan_job


def write_record(folder, **fields) -> None:
    record = {"run": "0" * 32, "host": "elsewhere", "pid_space": "b", "pid": 1, "started": "1",
              "heartbeat": time.time()}
    (folder / LEASE).write_text(json.dumps({**record, **fields}))


def test_a_second_plan_on_a_held_output_is_refused_and_leaves_the_first_runs_files(tiny_moe_dir, tmp_path):
    write_input(str(tmp_path / "in"), workload(4), files=1)
    config = JobConfig(model=tiny_moe_dir, input=str(tmp_path / "in"), output=str(tmp_path / "out"))
    first = plan_job(config)
    writing = tmp_path / "out" / ".part-000000000000-000000000003.parquet.1234abcd.tmp"  # the first run, mid-write
    writing.write_bytes(b"PAR1")
    with pytest.raises(JobError, match=r"is being written by another run [0-9a-f]{8} \(pid \d+ on .+, last "
                                       r"heartbeat 0 s ago\)"):
        plan_job(config)
    assert writing.exists()
    first.lease.release()
    assert not (tmp_path / "out" / LEASE).exists()
    second = plan_job(config)  # the folder is free again: the leftover is a crashed run's, and goes
    assert not writing.exists() and (tmp_path / "out" / LEASE).exists()
    second.lease.release()


def test_a_holder_whose_process_ended_on_this_machine_is_taken_over_at_once(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(ended.stdout)
    write_record(tmp_path, host=socket.gethostname(), pid_space=pid_space(), pid=pid, started="1")
    lease = OutputLease(str(tmp_path))
    lease.acquire()
    assert json.loads((tmp_path / LEASE).read_text())["run"] == lease.holder.run
    lease.release()


def test_a_holder_in_another_pid_namespace_of_this_machine_is_judged_by_its_heartbeat(tmp_path):
    """Two containers of one host (host networking: one hostname, one boot) have pid namespaces of their own: the
    other's pid, missing from this one, said its live run had ended, and both wrote the folder."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    other = pid_space().rsplit("/", 1)[0] + "/pid:[1]"
    write_record(tmp_path, host=socket.gethostname(), pid_space=other, pid=int(ended.stdout), started="1")
    with pytest.raises(LeaseHeld, match="is being written by another run"):
        OutputLease(str(tmp_path)).acquire()


def test_a_live_process_of_this_machine_holds_the_output_however_old_its_heartbeat(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_record(tmp_path, host=socket.gethostname(), pid_space=pid_space(), pid=alive.pid,
                     started=process_start(alive.pid), heartbeat=time.time() - 10 * output_lease.STALE_S)
        with pytest.raises(LeaseHeld, match=rf"pid {alive.pid} on {socket.gethostname()}"):
            OutputLease(str(tmp_path)).acquire()
    finally:
        alive.kill()
        alive.wait()


def test_a_record_of_this_process_is_taken_over_once_its_run_let_go(tmp_path, monkeypatch):
    """A long-lived process (the Batch API server) whose run could not remove its record at the end: its process
    lives on, so the record held the output until the server restarted, whatever the refusal said of stale
    heartbeats. A run of this process that still holds the lease is refused as before."""
    first = OutputLease(str(tmp_path))
    first.acquire()
    with pytest.raises(LeaseHeld, match=rf"pid {os.getpid()} on .*taken over at once from its own machine once its "
                                        rf"process has ended, from any other once its heartbeat is 60 s old"):
        OutputLease(str(tmp_path)).acquire()
    monkeypatch.setattr(first.fs, "rm", lambda path: (_ for _ in ()).throw(OSError("store unreachable")))
    first.release()  # its record stays
    monkeypatch.undo()
    assert json.loads((tmp_path / LEASE).read_text())["run"] == first.holder.run
    second = OutputLease(str(tmp_path))
    second.acquire()
    assert json.loads((tmp_path / LEASE).read_text())["run"] == second.holder.run
    second.release()


def test_another_machines_holder_is_taken_over_only_once_its_heartbeat_is_stale(tmp_path):
    write_record(tmp_path, heartbeat=time.time() - output_lease.STALE_S / 2)
    with pytest.raises(LeaseHeld, match=r"run 00000000 \(pid 1 on elsewhere"):
        OutputLease(str(tmp_path)).acquire()
    write_record(tmp_path, heartbeat=time.time() - output_lease.STALE_S - 1)
    lease = OutputLease(str(tmp_path))
    lease.acquire()
    lease.release()
    assert not (tmp_path / LEASE).exists()


def test_of_two_runs_claiming_at_once_exactly_one_holds_the_output(tmp_path):
    leases = [OutputLease(str(tmp_path)) for _ in range(2)]
    start, outcomes = threading.Barrier(2), {}

    def claim(lease: OutputLease) -> None:
        start.wait()
        try:
            lease.acquire()
            outcomes[lease.holder.run] = "held"
        except LeaseHeld as exc:
            outcomes[lease.holder.run] = str(exc)

    threads = [threading.Thread(target=claim, args=(lease,)) for lease in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(v == "held" for v in outcomes.values()) == [False, True], outcomes
    winner = next(lease for lease in leases if outcomes[lease.holder.run] == "held")
    assert json.loads((tmp_path / LEASE).read_text())["run"] == winner.holder.run
    for lease in leases:
        lease.release()
    assert not (tmp_path / LEASE).exists()


def test_the_heartbeat_refreshes_the_lease_and_a_run_that_lost_it_leaves_the_new_holders(tmp_path, monkeypatch):
    monkeypatch.setattr(output_lease, "HEARTBEAT_S", 0.05)
    lease = OutputLease(str(tmp_path))
    lease.acquire()
    first = json.loads((tmp_path / LEASE).read_text())["heartbeat"]
    deadline = time.monotonic() + 10
    while json.loads((tmp_path / LEASE).read_text())["heartbeat"] == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert json.loads((tmp_path / LEASE).read_text())["heartbeat"] > first
    while not lease.lost and time.monotonic() < deadline:  # again if a beat in flight wrote over it
        write_record(tmp_path, run="f" * 32)  # another run took the folder over (this one seemed stale to it)
        time.sleep(0.2)
    assert lease.lost
    lease.release()
    assert json.loads((tmp_path / LEASE).read_text())["run"] == "f" * 32


def test_a_storage_error_of_any_kind_misses_a_heartbeat_and_the_next_one_refreshes_the_lease(tmp_path, monkeypatch):
    """An object store's errors are not all OSErrors (botocore's connection and credential errors): one ended the
    heartbeat thread, and another run took the folder over a minute later while this one still wrote."""
    monkeypatch.setattr(output_lease, "HEARTBEAT_S", 0.05)
    lease = OutputLease(str(tmp_path))
    lease.acquire()
    first = json.loads((tmp_path / LEASE).read_text())["heartbeat"]
    move, failures = lease.fs.mv, []

    def unreachable(*args, **kwargs):
        if len(failures) < 2:
            failures.append(1)
            raise RuntimeError("Could not connect to the endpoint URL")
        return move(*args, **kwargs)

    monkeypatch.setattr(lease.fs, "mv", unreachable)
    deadline = time.monotonic() + 10
    while json.loads((tmp_path / LEASE).read_text())["heartbeat"] == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(failures) == 2 and json.loads((tmp_path / LEASE).read_text())["heartbeat"] > first
    assert not lease.lost
    lease.release()
    assert not (tmp_path / LEASE).exists()
    assert not list(tmp_path.glob(".*.tmp"))  # the failed writes' temporary files removed


def test_a_heartbeat_replaces_the_lease_record_whole(tmp_path, monkeypatch):
    """Rewritten in place (truncated, then written), the record read as empty by a run checking the folder at that
    moment: that run took the folder for free and claimed it beside this one. Each write is a new file moved over
    the record (a new inode), so a reader sees the old record or the new one."""
    monkeypatch.setattr(output_lease, "HEARTBEAT_S", 0.05)
    lease = OutputLease(str(tmp_path))
    lease.acquire()
    try:
        first = (tmp_path / LEASE).stat().st_ino, json.loads((tmp_path / LEASE).read_text())["heartbeat"]
        deadline = time.monotonic() + 10
        while json.loads((tmp_path / LEASE).read_text())["heartbeat"] == first[1] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (tmp_path / LEASE).stat().st_ino != first[0]
    finally:
        lease.release()
    assert not list(tmp_path.glob(".*.tmp"))
