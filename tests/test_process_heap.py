import json
import subprocess
import sys

import pytest

# a step's activations, alive together and then freed: what an engine step does with torch's CPU allocations
SCRIPT = r'''
import json, resource, sys, torch
from batchgen.engine.process_heap import keep_freed_memory

took = keep_freed_memory() if sys.argv[1] == "keep" else None

def step():
    live = [torch.empty(2**20).fill_(1.0) for _ in range(10)]  # ten 4 MiB tensors
    del live

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(json.dumps({"took": took, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
'''


def faults(mode: str) -> dict:
    """In a process of its own: the C heap's settings are per process and cannot be put back."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_kept_freed_memory_serves_the_next_step_without_faulting_its_pages_in_again():
    default, kept = faults("default"), faults("keep")
    assert kept["took"] is True
    step_pages = 5 * 10 * 2**22 // 4096  # five steps of 40 MiB in 4 KiB pages
    assert default["faults"] > step_pages // 2, default  # glibc's own thresholds hand the freed pages back
    assert kept["faults"] < default["faults"] // 4, (kept, default)
