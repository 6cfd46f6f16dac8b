"""`meridian bench sim`: reports are byte-identical per seed; bad flags are one-line errors."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import pytest
from rich.console import Console

from meridian.bench.report import AbReport, SimReport, load_report
from meridian.bench.slo import SloSpec
from meridian.bench.summary import PolicySummary
from meridian.cli import main
from meridian.cli.common import print_summary
from meridian.sim.policies import DEFAULT_POLICIES
from meridian.sim.records import RunCounters, SimResult

SMALL = ["bench", "sim", "--duration-s", "4", "--arrival-rate", "4"]


def test_default_ab_writes_reports_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # The summary, then the files, on stdout (progress bars go to stderr).
    assert "wrote" in out and str(tmp_path) in out
    assert out.index("What scheduling did") < out.index("wrote")
    assert "engine: the fast engine model (synchronous scheduling only" in out
    report = load_report(tmp_path / "report.json", SimReport)
    assert report.policies == list(DEFAULT_POLICIES)
    assert report.engine == "model" and not report.async_scheduling
    # vLLM's defaults on an H100 (its API server's), not a made-up engine shape.
    assert (report.max_num_seqs, report.max_num_batched_tokens) == (1024, 8192)
    assert [f.forcing for f in report.forcing][:2] == ["off", "meridian"]
    assert report.static_cap is not None
    assert any(f.forcing == f"static:{report.static_cap}" for f in report.forcing)
    ab = load_report(tmp_path / "ab-report.json", AbReport)
    # WIN and LOSS only against the baselines with Meridian's forcing.
    assert ab.candidate == "meridian"
    assert ab.baselines == ["vllm-fcfs+forcing", "vllm-priority+forcing", "pascal+forcing"]
    assert "Where Meridian loses" in (tmp_path / "ab-report.md").read_text()
    for png in ("cdf-output-itl.png", "cdf-ttfvt.png", "kv-usage.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_seed_gives_byte_identical_report(tmp_path: Path) -> None:
    args = [*SMALL, "--policies", "meridian,vllm-fcfs", "--no-plots", "--seed", "7"]
    assert main([*args, "--out-dir", str(tmp_path / "a")]) == 0
    assert main([*args, "--out-dir", str(tmp_path / "b")]) == 0
    a = (tmp_path / "a" / "report.json").read_bytes()
    assert a == (tmp_path / "b" / "report.json").read_bytes()
    assert (
        main(
            [
                *SMALL,
                "--policies",
                "meridian,vllm-fcfs",
                "--no-plots",
                "--seed",
                "8",
                "--out-dir",
                str(tmp_path / "c"),
            ]
        )
        == 0
    )
    assert a != (tmp_path / "c" / "report.json").read_bytes()


def test_sweep_writes_sweep_report(tmp_path: Path) -> None:
    args = [
        "bench",
        "sim",
        "--duration-s",
        "3",
        "--arrival-rate",
        "2,4",
        "--policies",
        "meridian,vllm-fcfs+forcing",
        "--out-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    sweep = json.loads((tmp_path / "sweep-report.json").read_text())
    assert [p["arrival_rate"] for p in sweep["points"]] == [2.0, 4.0]
    assert (tmp_path / "sweep-goodput.png").exists()
    assert (tmp_path / "rate-2" / "ab-report.json").exists()


def test_trace_round_trip_through_the_cli(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    out1, out2 = tmp_path / "one", tmp_path / "two"
    assert (
        main(
            [
                *SMALL,
                "--no-plots",
                "--policies",
                "meridian,vllm-fcfs",
                "--export-trace",
                str(trace),
                "--out-dir",
                str(out1),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "bench",
                "sim",
                "--workload",
                str(trace),
                "--no-plots",
                "--policies",
                "meridian,vllm-fcfs",
                "--out-dir",
                str(out2),
            ]
        )
        == 0
    )
    one = json.loads((out1 / "report.json").read_text())
    two = json.loads((out2 / "report.json").read_text())
    # The same runs; only the arrival window differs: the bundled workload's is its duration,
    # a trace's ends at its last arrival (a trace does not know the duration it was drawn for).
    window = ("window_s", "goodput_req_s", "attainment")
    for name, summary in one["summaries"].items():
        other = two["summaries"][name]
        assert {k: v for k, v in summary.items() if k not in window} == {
            k: v for k, v in other.items() if k not in window
        }
        assert summary["attainment"]["hidden_pct"] == other["attainment"]["hidden_pct"]
    # A replay states the trace's own load, not the command line's default rate and duration.
    md = (out2 / "report.md").read_text()
    assert "replayed at the trace's own arrival times" in md and "16 requests/s" not in md
    assert f"Load: offered {one['offered']['num_requests']} requests" in md


def test_a_light_load_says_scheduling_changed_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policies = "meridian,vllm-fcfs+forcing,meridian-sched,vllm-fcfs"
    args = [*SMALL, "--no-plots", "--policies", policies, "--out-dir", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    # 4 req/s for 4 s: nothing is preempted, every scheduler runs the same batches.
    assert out.count("scheduling changed nothing at this load") == 2
    assert "What forcing did (scheduling held equal):" in out
    assert "changed nothing" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("width", [80, 100])
def test_summary_fits_the_terminal(width: int) -> None:
    summaries = {p: _summary(p) for p in DEFAULT_POLICIES}
    report = SimReport(
        workload="synthetic", seed=0, duration_s=60.0, hardware="h100-sxm", model="qwen3-8b",
        slo=SloSpec(), policies=list(DEFAULT_POLICIES), arrival_rate=16.0, summaries=summaries,
    )  # fmt: skip
    console = Console(width=width, record=True, file=io.StringIO())
    print_summary(console, report)
    text = console.export_text()
    table = text.split("What scheduling did")[0]
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text
    for name in DEFAULT_POLICIES:
        assert any(line.startswith(name + " ") for line in table.splitlines()), name
    # Every value whole: 4 significant digits with thousands separators.
    assert "123,457" in table and "0.01235" in table and "12/3,456" in table


def _summary(policy: str) -> PolicySummary:
    from meridian.bench.summary import summarize

    base = summarize(SimResult(policy, "model", 64, [], [], RunCounters(), end_ns=0), SloSpec())
    return base.model_copy(
        update={
            "throughput_tok_s": 123456.7,
            "goodput_req_s": 0.0123456,
            "preemptions": base.preemptions.model_copy(update={"output": 12, "think": 3456}),
        }
    )


def test_vllm_log_lines_hidden_unless_verbose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = [*SMALL, "--no-plots", "--policies", "meridian", "--out-dir", str(tmp_path)]
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING"):
        monkeypatch.setenv(name, "")  # so that the test's end restores the variable's absence
        monkeypatch.delenv(name)
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", logging.NOTSET)
    assert main([*args, "-v"]) == 0
    assert "VLLM_LOGGING_LEVEL" not in os.environ and vllm_logger.level == logging.NOTSET
    assert main(args) == 0
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0" and vllm_logger.level == logging.ERROR


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--arrival-rate", "fast"], "--arrival-rate must be a number"),
        (["--arrival-rate", "0"], "--arrival-rate values must be finite numbers > 0"),
        (["--arrival-rate", "inf"], "--arrival-rate values must be finite numbers > 0"),
        (["--arrival-rate", "4,,8"], "--arrival-rate has an empty value in '4,,8'"),
        (["--arrival-rate", "4,"], "--arrival-rate has an empty value in '4,'"),
        (["--output-itl-slo-ms", "0"], "--output-itl-slo-ms must be a number in (0, 3,600,000]"),
        (["--ttfvt-slo-base-s", "nan"], "--ttfvt-slo-base-s must be a number in (0, 86,400]"),
        (["--duration-s", "-1"], "--duration-s must be in (0, 604,800] seconds"),
        (["--policies", "vllm-fcfs,nope"], "unknown policy 'nope'"),
        (
            ["--policies", "meridian-sched+forcing"],
            "Meridian with its forcing is called 'meridian'",
        ),
        (["--policies", "static-budget:0"], "the cap must be a positive integer"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1; got 0"),
        (["--async-scheduling", "on"], "--engine model models synchronous scheduling only"),
        (["--workload", "nosuch"], "--workload: 'nosuch' is neither a bundled workload"),
        (["--seed", "-2"], "--seed must be >= 0"),
        (["--kv-offload-gib", "4"], "--kv-offload-gib drives vLLM's OffloadingConnector"),
    ],
)
def test_bad_flags_are_one_line_errors(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "sim", "--out-dir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _no_work(*args: object, **kwargs: object) -> None:
    raise AssertionError("the run started before its arguments were checked")


@pytest.mark.parametrize(
    "args",
    [
        ["--arrival-rate", "4,,8"],
        ["--output-itl-slo-ms", "0"],
        ["--out-dir", "FILE"],
        ["--out-dir", "FILE/sub"],
    ],
)
def test_bad_input_is_refused_before_any_work(
    args: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The output folder used to be created after the whole simulation had run: a file in its
    # place gave a FileExistsError traceback then. Every check runs before the simulation.
    monkeypatch.setattr("meridian.cli.bench_cmd.simulate", _no_work)
    monkeypatch.setattr("meridian.cli.bench_cmd.load_requests", _no_work)
    existing = tmp_path / "report"
    existing.write_text("not a folder")
    args = [a.replace("FILE", str(existing)) for a in args]
    out = ["--out-dir", str(tmp_path / "out")] if "--out-dir" not in args else []
    assert main(["bench", "sim", *out, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    if "--out-dir" in args:
        assert f"--out-dir {args[1]}" in err and "is not a directory" in err
    assert existing.read_text() == "not a folder"


def test_fidelity_and_real_check_their_output_folder_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    existing = tmp_path / "f"
    existing.write_text("")
    for argv in (
        ["bench", "fidelity", "--out-dir", str(existing)],
        ["bench", "real", "--url", "http://127.0.0.1:9/v1", "--model", "m", "--out-dir",
         str(existing)],
    ):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"error: --out-dir {existing} is not a directory" in err, argv


def test_bad_trace_file_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"arrival_s": 0, "prompt_tokens": 5, "think_tokens": 0, "answer_tokens": 3}\n'
        '{"arrival_s": 1, "prompt_tokens": "x"}\n'
    )
    assert main(["bench", "sim", "--workload", str(trace), "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and ":2" in err


def test_engine_vllm_without_vllm_says_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except ImportError:
        assert main([*SMALL, "--engine", "vllm", "--out-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "make vllm-venv" in err and "Traceback" not in err
    else:
        pytest.skip("vLLM is installed here: tests/vllm_e2e runs --engine vllm")


def test_metrics_flag_reports_runs_through_the_catalogue(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    args = [*SMALL, "--policies", "meridian,vllm-fcfs", "--no-plots", "--metrics"]
    assert main([*args, "--out-dir", str(tmp_path)]) == 0
    text = (tmp_path / "metrics-meridian.prom").read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    think = families["meridian_request_think_tokens"]
    count = next(s.value for s in think.samples if s.name.endswith("_count"))
    report = json.loads((tmp_path / "report.json").read_text())
    assert count == report["summaries"]["meridian"]["think_tokens"]["count"]
