import json
import subprocess
import sys

import pytest

# a step's activations, alive together and then freed, as an engine step does with torch's CPU allocations.
# "initial": glibc's initial thresholds, held fixed (its dynamic raise of them depends on where the process's
# other allocations landed, so it cannot be a baseline): every 4 MiB block is a fresh mapping, faulted in again.
SCRIPT = r'''
import ctypes, json, resource, sys, torch
from batchgen.engine.process_heap import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, keep_freed_memory

if sys.argv[1] == "keep":
    took = keep_freed_memory()
else:
    mallopt = ctypes.CDLL(None).mallopt
    took = bool(mallopt(M_MMAP_THRESHOLD, 128 * 1024)) and bool(mallopt(M_TRIM_THRESHOLD, 128 * 1024))

def step():
    live = [torch.empty(2**20).fill_(1.0) for _ in range(10)]  # ten 4 MiB tensors
    del live

for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(json.dumps({"took": took, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
'''
STEP_PAGES = 10 * 2**22 // 4096  # ten 4 MiB tensors in 4 KiB pages


def faults(mode: str) -> dict:
    """In a process of its own: the C heap's settings are per process and cannot be put back."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_kept_freed_memory_serves_the_next_steps_without_faulting_their_pages_in_again():
    initial, kept = faults("initial"), faults("keep")
    assert initial["took"] is True and kept["took"] is True
    assert initial["faults"] >= 10 * STEP_PAGES * 9 // 10, initial  # the probe sees every step's pages fault
    assert kept["faults"] < 10 * STEP_PAGES // 20, kept


def test_a_frozen_heap_is_skipped_by_the_collector_and_its_objects_counted():
    """In a subprocess: a frozen heap is the process's for good (the test process builds and drops engines)."""
    script = (
        "import gc, json; import torch; from batchgen.engine.process_heap import freeze_heap\n"
        "before = gc.get_freeze_count(); frozen = freeze_heap(); gc.collect()\n"
        "print(json.dumps({'before': before, 'frozen': frozen, 'after': gc.get_freeze_count(),"
        " 'tracked': len(gc.get_objects())}))"
    )
    out = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["before"] == 0 and out["frozen"] > 50_000 and out["after"] == out["frozen"]
    assert out["tracked"] < out["frozen"] // 10  # the collector's generations hold only what came after
