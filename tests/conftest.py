import os

# Tests run the engine beside Ray actors and server processes on two cores: OpenMP threads that
# busy-wait for work lose their core at every small op. Set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Engines that tests build take the planner's fixed settings (BATCHGEN_PLAN=0): planning profiles each new model
# shape for seconds and the tests build dozens of shapes and configs. tests/test_planner.py plans for real, as does
# the split job of `engine_actors` in tests/test_pipeline.py. Inherited by Ray workers and server subprocesses.
os.environ.setdefault("BATCHGEN_PLAN", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run on CPU tensors through the interpreter; it must be set before triton is imported.
# On a CUDA host it stays off (the kernels compile for the GPU there) and the tests marked triton_cpu,
# which hand Triton CPU tensors, are skipped: `-m gpu` runs the same kernels on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    # long end-to-end tests first, handed out one at a time (the Makefile's --maxschedchunk 1) to whichever xdist
    # worker is free: the longest-first order leaves the workers at most one short test apart at the end
    items.sort(key=lambda item: "slow" not in item.keywords)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="runs Triton on CPU tensors, which needs TRITON_INTERPRET=1 (off on CUDA hosts)")
    for item in items:
        if "triton_cpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def threads(request):
    """torch's thread count set to the test's parameter (indirect parametrize), put back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


IDLE_WORKERS = 16  # 4 logical CPUs / the 0.25 CPU of a read, tokenize or write task


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray runtime for every test that needs one (its start-up dominates those tests).

    Four logical CPUs on any machine: engine actors take fractions of them, so read, tokenize and
    write tasks always find room. Yields the GCS address, for drivers started in subprocesses.

    Idle workers are kept for reuse (Ray's default keeps about one per CPU and kills the others soon
    after they go idle): Ray Data runs up to 16 quarter-CPU tasks at once, and each job would otherwise
    start and import a fresh batch of Python workers, a fifth of a short job's CPU time on 2 cores.
    """
    import ray

    if not ray.is_initialized():
        # address="local": always a runtime of our own, never one another test's cluster happens to run
        ray.init(address="local", num_cpus=4, include_dashboard=False,
                 _system_config={"num_workers_soft_limit": IDLE_WORKERS})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_moe_dir() -> str:
    """The "tiny-moe" preset checkpoint (built once into the preset cache), as a local directory."""
    from batchgen.connectors.presets import build_preset

    return build_preset("tiny-moe")
