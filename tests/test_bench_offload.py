"""bench/offload.py --json end to end on tiny-moe (in this process): the report's keys, both systems' tokens
equal to the resident engine's, and a budget the baseline cannot run at reported with its reason."""

import json

from bench_helpers import import_bench


def test_json_report(monkeypatch, capsys, tiny_moe_dir):
    offload = import_bench(monkeypatch, "offload")
    offload.main(["--json", "--model", tiny_moe_dir, "--num-prompts", "8", "--prompt-tokens", "16",
                  "--max-tokens", "8", "--budgets", "0.5", "0.15"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["outputs_match"] is True
    assert set(report["budgets"]) == {"0.5", "0.15"}
    half = report["budgets"]["0.5"]
    for system in ("batchgen", "flexgen_style"):
        assert half["tokens_per_s"][system] > 0
        run = half["runs"][system]
        assert run["outputs_match"] is True
        assert run["device_memory"]["peak_bytes"] <= half["device_memory_bytes"]
        assert half["bytes_streamed_per_token"][system] > 0
    # the baseline's whole-layer slot does not fit 15 % of the weights; expert by expert does
    tight = report["budgets"]["0.15"]
    assert tight["tokens_per_s"]["flexgen_style"] is None and tight["speedup"] is None
    assert "below this model's minimum" in tight["runs"]["flexgen_style"]["error"]
    assert tight["tokens_per_s"]["batchgen"] > 0 and tight["runs"]["batchgen"]["outputs_match"] is True


def test_the_baselines_batch_is_sized_by_the_plan_of_the_engines_device(monkeypatch, tiny_moe_dir):
    """It was sized from a CPU plan (one module slot) whatever the device: on a GPU (two slots) it assumed a whole
    layer's KV more than the engine leaves."""
    import argparse

    import torch

    from batchgen.connectors.checkpoint import load_model
    from batchgen.engine import EngineConfig

    offload = import_bench(monkeypatch, "offload")
    planned_for = []
    plan = offload.offload_plan

    def recording(loaded, config, device_type):
        planned_for.append(device_type)
        return plan(loaded, config, "cpu")

    monkeypatch.setattr(offload, "offload_plan", recording)
    monkeypatch.setattr(EngineConfig, "torch_device", lambda self: torch.device("cuda", 0))
    args = argparse.Namespace(prompt_tokens=16, max_tokens=8, page_size=16, b_attn=8, num_prompts=8,
                              staging_fraction=0.25)
    loaded = load_model(tiny_moe_dir)
    offload.config_for("flexgen_style", args, sum(p.numel() * 4 for p in loaded.model.parameters()) // 2, loaded)
    assert planned_for == ["cuda"]
