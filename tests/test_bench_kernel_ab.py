"""bench/kernel_ab.py: the C kernels rebuilt from a commit's sources, alternated with this tree's on the same inputs."""

import json
import subprocess

import pytest
import torch
from bench_helpers import BENCH_DIR, import_bench

from batchgen.kernels import moe_cpu


@pytest.fixture
def bench(monkeypatch):
    if subprocess.run(["git", "-C", str(BENCH_DIR), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: no commit to rebuild the kernels from")
    if moe_cpu.unavailable():
        pytest.skip(moe_cpu.unavailable())
    return import_bench(monkeypatch, "kernel_ab")


def test_a_commits_kernels_are_its_sources_and_take_turns_with_this_trees(bench, monkeypatch):
    """At HEAD (a clean tree's own commit) every C function is rebuilt from the committed module text: the same source
    as this tree's when the tree is clean, a distinct object either way, swapped in and back out."""
    clean = subprocess.run(["git", "-C", str(bench.REPO), "diff", "--quiet", "HEAD", "--", "kernels"]).returncode == 0
    base = bench.base_kernels("HEAD")
    assert {module for module, _ in base} == set(bench.C_MODULES)
    for (module, attr), function in base.items():
        assert function is not getattr(module, attr) and function.name == getattr(module, attr).name
        if clean:
            assert function.source == getattr(module, attr).source
    builds = bench.Builds(head={key: getattr(*key) for key in base}, base=base)
    seen = []
    bench.alternate(builds, {"which": lambda: seen.append(moe_cpu._GROUPED) or torch.zeros(1)}, rounds=1)
    assert seen == [builds.head[(moe_cpu, "_GROUPED")], base[(moe_cpu, "_GROUPED")]] * 2
    assert moe_cpu._GROUPED is builds.head[(moe_cpu, "_GROUPED")]  # this tree's kernels back in place


def test_a_case_that_times_part_of_itself_reports_that_part(bench):
    """The engine case's figure is its run's BCT, not the engines built and warmed up around it."""
    builds = bench.Builds(head={}, base={})
    calls = iter([0.25, 0.5, 0.25, 0.5])  # the warm-up round's pair is dropped
    report = bench.alternate(builds, {"engine": lambda: (torch.zeros(1), next(calls))}, rounds=1)
    assert report["engine"]["head_ms"] == 250.0 and report["engine"]["base_ms"] == 500.0
    assert report["engine"]["head_over_base"] == 0.5 and report["engine"]["identical"]


def test_json_report_of_every_kernel_case(bench, capsys):
    bench.main(["--base", "HEAD", "--rounds", "1", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["base"] == "HEAD" and report["rounds"] == 1
    moe = {f"moe_{rows}_rows_per_expert{cold}" for rows in (4, 8, 16, 32) for cold in ("", "_cold")}
    packed = {f"moe_packed_{rows}_rows_per_expert{cold}" for rows in (4, 8, 16, 32, 450) for cold in ("", "_cold")}
    assert set(report["points"]) == moe | packed | {"prefill_attention_4096_tokens", "decode_attention_128_seqs"}
    for point in report["points"].values():
        assert point["head_ms"] > 0 and point["base_ms"] > 0
        if not report["changed"]:  # the same sources build the same code: the same bits
            assert point["identical"]
