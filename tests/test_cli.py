"""`batchgen run` and `batchgen demo`: config precedence, fail-fast checks, exit codes, progress, summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from pipeline_helpers import SAMPLING, engine_outputs, read_output, workload, write_input

from batchgen.connectors.checkpoint_files import load_tokenizer
from batchgen.connectors.demo_data import demo_prompts
from batchgen.pipelines.cli import UsageError, build_parser, job_config, main


def test_config_file_holds_the_options_and_the_command_line_overrides_it(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "model": "tiny-moe", "input": "s3://bucket/in", "output": "s3://bucket/out", "mode": "single",
        "batch-size": 16, "concurrency": 3, "max_tokens": 64, "sampling_params": {"top_p": 0.5, "temperature": 1.0},
        "engine": {"max_num_seqs": 32, "page_size": 16}, "storage_options": {"endpoint_url": "http://x"},
    }))
    args = build_parser().parse_args(["run", "--config", str(config), "--batch-size", "8", "--temperature", "0",
                                      "--engine", '{"page_size": 32}'])
    job = job_config(args)
    assert (job.model, job.input, job.output, job.mode) == ("tiny-moe", "s3://bucket/in", "s3://bucket/out", "single")
    assert (job.batch_size, job.concurrency) == (8, 3)
    assert job.sampling_params == {"top_p": 0.5, "temperature": 0.0, "max_tokens": 64}
    assert job.engine == {"max_num_seqs": 32, "page_size": 32}
    assert job.storage_options == {"endpoint_url": "http://x"}
    # an object option as the JSON text the command line takes (it raised a TypeError), and one that is not JSON
    config.write_text(yaml.safe_dump({"model": "m", "input": "s3://b/i", "output": "o",
                                      "sampling_params": '{"top_k": 3}', "storage_options": '{"anon": true}'}))
    job = job_config(build_parser().parse_args(["run", "--config", str(config), "--storage-options", '{"key": "k"}']))
    assert job.sampling_params == {"top_k": 3} and job.storage_options == {"anon": True, "key": "k"}
    for engine in ("max_num_seqs=3", [1]):
        config.write_text(yaml.safe_dump({"model": "m", "input": "i", "output": "o", "engine": engine}))
        with pytest.raises(UsageError, match="engine must be a JSON object"):
            job_config(build_parser().parse_args(["run", "--config", str(config)]))


def test_the_config_files_own_keys_and_the_stage_resource_flags_reach_the_job(tmp_path):
    """list_outputs has no flag, `migrate: false` is --no-migrate, an engine's device_memory_bytes is
    --device-memory-mb; --prefill-resources / --decode-resources pin the stages (README, "CLI and ready pipelines")."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"model": "m", "input": "i", "output": "o", "list_outputs": True,
                                      "migrate": False, "engine": {"device_memory_bytes": 1 << 30}}))
    job = job_config(build_parser().parse_args(["run", "--config", str(config), "--prefill-resources",
                                                '{"prefill_node": 1}', "--decode-resources", '{"decode_node": 1}']))
    assert (job.list_outputs, job.migrate, job.engine) == (True, False, {"device_memory_bytes": 1 << 30})
    assert (job.prefill_resources, job.decode_resources) == ({"prefill_node": 1}, {"decode_node": 1})


def write_prompts(path: Path, column: str = "prompt") -> str:
    pq.write_table(pa.table({column: workload(2)}), path)
    return str(path)


@pytest.mark.parametrize("case", ["no prompt column", "unreadable model", "unwritable output", "missing input",
                                  "unknown config option", "bad sampling default"])
def test_run_fails_fast_with_a_clear_message(tmp_path, tiny_moe_dir, capsys, case):
    good_input = write_prompts(tmp_path / "in.parquet")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    argv = {"model": tiny_moe_dir, "input": good_input, "output": str(tmp_path / "out")}
    extra: list[str] = []
    expected_code, message = 1, ""
    if case == "no prompt column":
        argv["input"] = write_prompts(tmp_path / "text.parquet", column="text")
        message = "has no prompt column: expected one of ['prompt_token_ids', 'messages', 'prompt'], found " \
                  "columns ['text']"
    elif case == "unreadable model":
        argv["model"] = str(tmp_path / "no-model")
        message = "is not readable"
    elif case == "unwritable output":
        argv["output"] = str(blocker / "out")
        message = "is not writable"
    elif case == "missing input":
        argv["input"] = str(tmp_path / "nothing-here")
        message = "does not exist"
    elif case == "unknown config option":
        (tmp_path / "c.yaml").write_text("batchsize: 4\n")
        extra, expected_code, message = ["--config", str(tmp_path / "c.yaml")], 2, "unknown option(s) ['batchsize']"
    else:  # a bad value: a bad command line (exit 2), found before Ray starts
        extra, expected_code, message = ["--temperature", "-1"], 2, "invalid sampling parameter 'temperature'"
    started = time.monotonic()
    code = main(["run", *[x for k, v in argv.items() for x in (f"--{k}", v)], *extra, "--no-progress"])
    assert code == expected_code
    assert message in capsys.readouterr().err
    assert time.monotonic() - started < 15  # no Ray, no engine: checks only
    assert not list((tmp_path / "out").glob("part-*"))


def test_console_script_exit_status(tmp_path, tiny_moe_dir):
    bad_input = write_prompts(tmp_path / "text.parquet", column="text")
    script = Path(sys.executable).with_name("batchgen")
    done = subprocess.run([str(script), "run", "--model", tiny_moe_dir, "--input", bad_input, "--output",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "job failed" in done.stderr and "no prompt column" in done.stderr


def test_run_with_bad_rows_exits_zero_and_reports_them(ray_cluster, tiny_moe_dir, tmp_path, capfd):
    """Also in memory-constrained mode (--device-memory-mb, 40 % of tiny-moe's weights): same tokens."""
    input_dir = tmp_path / "in"
    write_input(str(input_dir), workload(4), files=1)
    bad = pa.table({"id": [4], "prompt": [None]}, schema=pq.read_schema(next(input_dir.glob("*.parquet"))))
    pq.write_table(bad, input_dir / "part-9.parquet")
    code = main(["run", "--model", tiny_moe_dir, "--input", str(input_dir), "--output", str(tmp_path / "out"),
                 "--mode", "single", "--batch-size", "2", "--sampling-params", json.dumps(SAMPLING),
                 "--engine", json.dumps({"host_kv_budget_bytes": 32 << 20, "max_model_len": 512}),
                 "--device-memory-mb", "6"])
    captured = capfd.readouterr()  # the progress bar writes to the terminal's descriptor, past the stderr filter
    assert code == 0
    assert "rows         5 total: 5 written by this run, 0 already there" in captured.out
    assert "errors       1 rows with an error (see the 'error' column; 1 by this run)" in captured.out
    assert "BatchGen (weights streamed within 6.0 MiB of device memory) constructed in" in captured.out
    assert "row" in captured.err and "tok/s" in captured.err and "ETA" in captured.err  # the progress bar
    table = read_output(str(tmp_path / "out"))
    assert table.column("id").to_pylist() == [0, 1, 2, 3, 4]
    assert "missing prompt" in table.column("error")[4].as_py()
    assert table.column("generated_token_ids").to_pylist()[:4] == engine_outputs(tiny_moe_dir, workload(4))
    # the rerun of the finished job writes nothing, and its summary still counts the output's error rows (it
    # counted this run's: 0)
    assert main(["run", "--model", tiny_moe_dir, "--input", str(input_dir), "--output", str(tmp_path / "out"),
                 "--mode", "single", "--batch-size", "2", "--sampling-params", json.dumps(SAMPLING),
                 "--engine", json.dumps({"host_kv_budget_bytes": 32 << 20, "max_model_len": 512}),
                 "--device-memory-mb", "6"]) == 0
    captured = capfd.readouterr()
    assert "rows         5 total: 0 written by this run, 5 already there" in captured.out
    assert "errors       1 rows with an error (see the 'error' column; 0 by this run)" in captured.out


def test_run_renders_messages_rows_with_the_jobs_chat_template(ray_cluster, tiny_moe_dir, tmp_path):
    """--chat-template (a file) reaches the disaggregated pipeline's tokenize stage, and a row's
    chat_template_kwargs that template."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]"
                        "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}{% endif %}")
    prompts = workload(3)
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": p}] for p in prompts],
                             "chat_template_kwargs": [None, {"enable_thinking": False}, None]}),
                   tmp_path / "in.parquet")
    code = main(["run", "--model", tiny_moe_dir, "--input", str(tmp_path / "in.parquet"), "--output",
                 str(tmp_path / "out"), "--sampling-params", json.dumps(SAMPLING), "--chat-template", str(template),
                 "--no-progress"])
    assert code == 0
    tokenizer = load_tokenizer(tiny_moe_dir)
    ids = [tokenizer.encode(f"[user] {p}\n[assistant]" + (" /no_think" if i == 1 else ""), add_special_tokens=False)
           for i, p in enumerate(prompts)]
    table = read_output(str(tmp_path / "out"))
    assert table.column("error").to_pylist() == [None] * 3
    assert table.column("num_prompt_tokens").to_pylist() == [len(x) for x in ids]
    assert table.column("generated_token_ids").to_pylist() == engine_outputs(tiny_moe_dir, ids)


def test_a_chat_template_option_is_a_file_or_the_template_and_a_missing_file_is_a_usage_error(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    base = ["run", "--model", "m", "--input", "i", "--output", "o"]
    assert job_config(build_parser().parse_args([*base, "--chat-template", str(template)])).chat_template == \
        "{{ messages[0]['content'] }}"
    assert job_config(build_parser().parse_args([*base, "--chat-template", "{{ 'x' }}"])).chat_template == "{{ 'x' }}"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"model": "m", "input": "i", "output": "o",
                                                       "chat_template": str(template)}))
    assert job_config(build_parser().parse_args(["run", "--config", str(tmp_path / "job.yaml")])).chat_template == \
        "{{ messages[0]['content'] }}"
    with pytest.raises(UsageError, match="--chat-template '.*missing.jinja' is no template"):
        job_config(build_parser().parse_args([*base, "--chat-template", str(tmp_path / "missing.jinja")]))


def test_demo_writes_its_prompts_runs_them_and_prints_a_summary(ray_cluster, tmp_path, capsys, monkeypatch):
    """The job runs with the driver's threads at DRIVER_NICENESS (pipelines/driver_priority.py), given back after."""
    from batchgen.pipelines import cli
    from batchgen.pipelines.driver_priority import DRIVER_NICENESS

    niceness = []
    execute = cli.execute_job
    monkeypatch.setattr(cli, "execute_job",
                        lambda *a, **k: niceness.append(os.getpriority(os.PRIO_PROCESS, 0)) or execute(*a, **k))
    before = os.getpriority(os.PRIO_PROCESS, 0)
    code = main(["demo", "--out", str(tmp_path / "demo"), "--rows", "6", "--max-tokens", "4", "--mode", "single",
                 "--no-progress"])
    assert niceness == [max(before, DRIVER_NICENESS)]
    if os.geteuid() == 0:  # an unprivileged process cannot raise its priority again
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
    out = capsys.readouterr().out
    assert code == 0
    assert "rows         6 total: 6 written by this run" in out and "tokens/s" in out and "BCT" in out
    table = read_output(str(tmp_path / "demo" / "results"))
    assert table.column("prompt").to_pylist() == demo_prompts(6)
    assert table.column("error").to_pylist() == [None] * 6
    assert all(1 <= n <= 4 for n in table.column("num_generated_tokens").to_pylist())


def test_engine_actors_and_explicit_stage_concurrency_conflict(tmp_path, capsys):
    code = main(["run", "--model", "tiny-moe", "--input", str(tmp_path), "--output", str(tmp_path / "out"),
                 "--engine-actors", "3", "--decode-concurrency", "2"])
    assert code == 2 and "--engine-actors lets the planner split" in capsys.readouterr().err


FILTER_SCRIPT = r'''
import os, sys
from batchgen.pipelines.stderr_filter import filtered_stderr
with filtered_stderr() as terminal:
    os.write(2, b"[2026-12-03 13:31:03,611 E 10113 10321] core_worker.cc:2465: Actor with class name: "
                b"'MapWorker(MapBatches(BatchGen))' and ID: '9c4c' has constructor arguments in the object store and "
                b"max_restarts > 0. If the arguments in the object store go out of scope or are lost, ...\n")
    os.write(2, b"[2026-12-03 13:31:04,000 E 10113 10321] core_worker.cc:99: Failed to connect to the GCS\n")
    print("a Python traceback line", file=sys.stderr)
    terminal.write("progress 50%\r")
    os.write(2, b"no newline at the end")
print("after the job", file=sys.stderr)
'''


def test_cli_stderr_filter_drops_rays_harmless_line_and_passes_everything_else():
    """C++ writes to file descriptor 2 and Python's alike; a line without its end still arrives; the progress
    bar's stream bypasses the line buffering; descriptor 2 is the terminal again afterwards."""
    done = subprocess.run([sys.executable, "-c", FILTER_SCRIPT], capture_output=True, timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert "constructor arguments in the object store" not in err
    assert "core_worker.cc:99: Failed to connect to the GCS\n" in err
    assert "a Python traceback line\n" in err and "progress 50%\r" in err
    assert err.endswith("no newline at the endafter the job\n")


@pytest.mark.parametrize("verbose", [False, True])
def test_verbose_lets_rays_worker_output_and_log_lines_through_and_only_it(monkeypatch, capfd, verbose):
    """README: Ray's worker output and log lines reach the terminal with --verbose only; without it the core
    worker's harmless error-level line is dropped too, while a job's own error lines always pass."""
    import logging

    import ray

    from batchgen.pipelines import cli

    started = {}

    class Plan:
        class lease:  # noqa: N801 (the plan's lease: released after the job)
            @staticmethod
            def release():
                started["released"] = True

    def execute_job(plan, on_progress=None):
        os.write(2, b"(pid=1) core_worker.cc:99: Actor with class name: 'MapWorker' has constructor arguments in the "
                    b"object store and max_restarts > 0.\n")
        os.write(2, b"a real error line\n")
        started["ray.data level"] = logging.getLogger("ray.data").level
        return "summary"

    monkeypatch.setattr(ray.data.DataContext.get_current(), "enable_progress_bars",
                        ray.data.DataContext.get_current().enable_progress_bars)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cli, "init_ray", lambda address, **kwargs: started.update(kwargs))
    monkeypatch.setattr(cli, "plan_job", lambda config: Plan)
    monkeypatch.setattr(cli, "execute_job", execute_job)
    args = build_parser().parse_args(["run", "--model", "m", "--input", "i", "--output", "o", "--no-progress"]
                                     + ["--verbose"] * verbose)
    data_logger = logging.getLogger("ray.data")
    level = data_logger.level
    try:
        assert cli._run(None, args) == "summary"
    finally:
        data_logger.setLevel(level)  # the job sets it for the process
    err = capfd.readouterr().err
    assert "a real error line\n" in err
    assert ("has constructor arguments in the object store" in err) == verbose
    assert started["log_to_driver"] is verbose  # worker processes' output forwarded to the driver
    assert started["logging_level"] == (logging.INFO if verbose else logging.ERROR)
    assert started["ray.data level"] == (logging.INFO if verbose else logging.ERROR)
    assert started["released"]


@pytest.mark.parametrize("flags,message", [
    (["--rows-per-file", "0"], "rows_per_file must be an integer in [1, 2^63 - 1], got 0"),
    (["--engine-num-cpus", "-1"], "engine_num_cpus must be a finite number >= 0, got -1.0"),
    (["--engine-num-gpus", "-2"], "engine_num_gpus must be a finite number >= 0, got -2.0"),
    (["--config", "list_outputs: 'false'"], "list_outputs must be true, false or null, got 'false'"),
    # true is an int to Python (one-row blocks); past int64 the read tasks overflowed
    (["--config", "rows_per_block: true"], "rows_per_block must be an integer in [1, 2^63 - 1], got True"),
    (["--config", "batch_size: 9223372036854775808"], "batch_size must be an integer in [1, 2^63 - 1], got 9223"),
    # fsspec hands options on and the filesystems drop what they do not know: a typo sent the job to AWS itself
    (["--input", "s3://bucket/in", "--storage-options", '{"endpoint_ur": "http://minio:9000"}'],
     "unknown storage option 'endpoint_ur' (did you mean 'endpoint_url'?)"),
])
def test_bad_job_values_are_a_bad_command_line(tmp_path, capsys, flags, message):
    """They were accepted and failed later inside Ray or the sink, or (list_outputs "false") were read as true."""
    if flags[0] == "--config":
        (tmp_path / "c.yaml").write_text(flags[1] + "\n")
        flags = ["--config", str(tmp_path / "c.yaml")]
    code = main(["run", "--model", "m", "--input", "i", "--output", str(tmp_path / "out"), *flags, "--no-progress"])
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["run", "--model", "m", "--input", "i", "--output", "o", "--device-memory-mb", "nan"],
     "expected a finite number > 0, got nan"),
    (["run", "--model", "m", "--input", "i", "--output", "o", "--device-memory-mb", "inf"],
     "expected a finite number > 0, got inf"),
    (["demo", "--rows", "-3"], "expected an integer >= 1, got -3"),
])
def test_option_values_no_command_can_use_are_a_bad_command_line(tmp_path, monkeypatch, capsys, argv, message):
    """--device-memory-mb nan or inf reached int() past the checks (a traceback); demo --rows -3 deleted the
    previous results, then failed with a traceback."""
    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "out" / "results" / "keep.txt"
    kept.parent.mkdir(parents=True)
    kept.write_text("earlier results")
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert kept.read_text() == "earlier results"


def test_demo_sampling_params_set_what_its_own_defaults_set(tmp_path):
    """The demo's max_tokens 32 and temperature 0 were flag defaults, which win over --sampling-params: a demo given
    {"max_tokens": 8, "temperature": 0.7} ran 32 greedy tokens."""
    from batchgen.pipelines.cli import demo_config

    args = build_parser().parse_args(["demo", "--out", str(tmp_path), "--sampling-params",
                                      '{"max_tokens": 8, "temperature": 0.7}'])
    assert demo_config(args, str(tmp_path / "p.parquet"), str(tmp_path / "r")).sampling_params == {
        "max_tokens": 8, "temperature": 0.7}
    plain = build_parser().parse_args(["demo", "--out", str(tmp_path)])
    assert demo_config(plain, "p", "r").sampling_params == {"max_tokens": 32, "temperature": 0.0}
    flags = build_parser().parse_args(["demo", "--out", str(tmp_path), "--max-tokens", "4"])
    assert demo_config(flags, "p", "r").sampling_params == {"max_tokens": 4, "temperature": 0.0}


def test_storage_options_filesystems_take_through_their_kwargs_pass(tmp_path):
    """s3fs's `profile` and HTTP's `headers` reach their sessions through **kwargs: refused by a check of the
    constructors' named parameters alone, they pass; only a near miss of a named one is a typo."""
    from batchgen.connectors.io import check_storage_options

    check_storage_options(["s3://bucket/in", str(tmp_path)], {"profile": "team", "key": "k"})
    check_storage_options(["https://host/in.parquet"], {"headers": {"Authorization": "Bearer x"}})
    with pytest.raises(ValueError, match=r"'secrte' \(did you mean 'secret'\?\)"):
        check_storage_options(["s3://bucket/in"], {"secrte": "s"})
