import os

# Tests run the engine beside Ray actors and server processes on two cores: OpenMP threads that
# busy-wait for work lose their core at every small op. Set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run on CPU tensors through the interpreter; it must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray runtime for every test that needs one (its start-up dominates those tests).

    Four logical CPUs on any machine: engine actors take fractions of them, so read, tokenize and
    write tasks always find room. Yields the GCS address, for drivers started in subprocesses.
    """
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_moe_dir() -> str:
    """The "tiny-moe" preset checkpoint (built once into the preset cache), as a local directory."""
    from batchgen.connectors.presets import build_preset

    return build_preset("tiny-moe")
