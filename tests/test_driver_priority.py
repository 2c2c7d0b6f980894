import json
import subprocess
import sys

SCRIPT = r'''
import json, os, threading
from batchgen.pipelines.driver_priority import driver_yields_cpu

release = threading.Event()
earlier = threading.Thread(target=release.wait)
earlier.start()
base = os.getpriority(os.PRIO_PROCESS, 0)
inside = {}
with driver_yields_cpu(10):
    inside["caller"] = os.getpriority(os.PRIO_PROCESS, 0)
    inside["earlier thread"] = os.getpriority(os.PRIO_PROCESS, earlier.native_id)
    later = threading.Thread(target=lambda: inside.__setitem__("later thread", os.getpriority(os.PRIO_PROCESS, 0)))
    later.start()
    later.join()
after = {"caller": os.getpriority(os.PRIO_PROCESS, 0),
         "earlier thread": os.getpriority(os.PRIO_PROCESS, earlier.native_id)}
release.set()
print(json.dumps({"base": base, "inside": inside, "after": after, "root": os.geteuid() == 0}))
'''


def test_the_driver_threads_yield_for_the_job_and_get_their_niceness_back():
    """In a process of its own: niceness is per thread on Linux and, unprivileged, cannot be lowered back."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    lowered = max(seen["base"], 10)
    assert seen["inside"] == {"caller": lowered, "earlier thread": lowered, "later thread": lowered}
    expected_after = seen["base"] if seen["root"] else lowered
    assert seen["after"] == {"caller": expected_after, "earlier thread": expected_after}
