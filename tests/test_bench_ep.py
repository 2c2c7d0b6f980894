"""bench/ep.py --json end to end on tiny-moe (in this process, its groups' other ranks in processes of their
own): the keys the issue names, every group's tokens equal to one rank's, and the straggler really PARTITIONed
(on its own model when --straggler-model is given)."""

import json

from bench_helpers import import_bench


def test_json_report(monkeypatch, capsys, tiny_moe_dir):
    ep = import_bench(monkeypatch, "ep")
    ep.main(["--json", "--model", tiny_moe_dir, "--ranks", "1", "2", "--tp-ranks", "--num-prompts", "4",
             "--max-tokens", "4", "--straggler-tokens", "8", "--straggler-model", "preset://tiny-moe"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["tokens_per_s"]) == {"1", "2"} and all(v > 0 for v in report["tokens_per_s"].values())
    assert set(report["straggler_s"]) == {"single", "partition", "unpartitioned"}
    straggler = report["straggler"]
    assert straggler["model"] == "preset://tiny-moe" and straggler["outputs_match"] is True
    assert straggler["partition"]["partitioned_steps"] > 0 and straggler["unpartitioned"]["partitioned_steps"] == 0
    assert set(straggler["read_bandwidth_gbs"]) == {"1", "2"} and straggler["bandwidth_scaling"] > 0
    assert report["outputs_match"] is True
