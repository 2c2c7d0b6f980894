"""The split pipeline on a Ray cluster of three raylets on this machine (a head for the light stages,
one node for prefill, one for decode), each with its own object store: every prefill -> decode KV
hand-off crosses nodes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from pipeline_helpers import ENGINE, SAMPLING, engine_outputs, read_output, workload, write_input

pytestmark = pytest.mark.slow  # end to end on a Ray runtime

ROWS = 12
STORE_BYTES = 128 << 20  # per node; the blocks of this job are a few MiB


def test_prefill_and_decode_pinned_to_two_nodes_give_the_engines_outputs(tiny_moe_dir, tmp_path):
    from ray.cluster_utils import Cluster

    prompts = workload(ROWS, seed=5)
    input_dir, output = str(tmp_path / "in"), str(tmp_path / "out")
    write_input(input_dir, prompts, files=2, row_group_size=2)
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 1, "object_store_memory": STORE_BYTES, "include_dashboard": False})
    try:
        prefill_node = cluster.add_node(num_cpus=1, resources={"prefill_node": 1}, object_store_memory=STORE_BYTES)
        decode_node = cluster.add_node(num_cpus=1, resources={"decode_node": 1}, object_store_memory=STORE_BYTES)
        cluster.wait_for_nodes()
        # a driver of its own: this test process may already be connected to the session's Ray runtime
        driver = textwrap.dedent(f"""
            import json, ray
            from batchgen.pipelines.pipeline import JobConfig, run_job
            ray.init(address={cluster.address!r}, log_to_driver=False)
            summary = run_job(JobConfig(
                model={tiny_moe_dir!r}, input={input_dir!r}, output={output!r}, mode="disaggregated",
                sampling_params={SAMPLING!r}, engine={ENGINE!r}, batch_size=2, rows_per_block=2,
                prefill_resources={{"prefill_node": 1}}, decode_resources={{"decode_node": 1}}))
            print(json.dumps({{"actors": [[a.stage, a.node_id] for a in summary.engine_actors],
                              "rows": summary.progress.rows, "ready_s": summary.engines_ready_s}}))
        """)
        run = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        report = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        cluster.shutdown()
    assert {stage: node for stage, node in report["actors"]} == {"Prefill": prefill_node.node_id,
                                                                 "Decode": decode_node.node_id}
    assert prefill_node.node_id != decode_node.node_id
    assert report["rows"] == ROWS and report["ready_s"] > 0
    table = read_output(output)
    assert table.column("row_index").to_pylist() == list(range(ROWS))
    assert table.column("error").null_count == ROWS
    assert table.column("generated_token_ids").to_pylist() == engine_outputs(tiny_moe_dir, prompts)
