"""Bad input that used to get through (issue 41), each class run as a user runs it: the
``meridian`` command in a process of its own, which must end with one ``error:`` line (no
traceback) and a non-zero exit within 5 s of CPU, its memory bounded (:mod:`cli_process`).

``meridian doctor``'s classes are in ``tests/test_doctor.py`` (and, with vLLM installed, in
``tests/vllm_e2e/test_engine_resolution.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli_process import run_meridian
from meridian.bench.simrun import MAX_SIM_KV_BLOCKS
from meridian.cli import EXIT_BROKEN_PIPE, build_parser

REPO = Path(__file__).resolve().parents[1]
SIM = ["bench", "sim", "--no-plots", "--policies", "vllm-fcfs"]
SERVER = ["--url", "http://127.0.0.1:9/v1", "--model", "m"]


@pytest.fixture
def odd_files(tmp_path: Path) -> dict[str, Path]:
    """Paths that are not regular files, and files over their limit (sparse: no disk used)."""
    link = tmp_path / "zero.toml"
    link.symlink_to("/dev/zero")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # with no writer: opening it would block for ever
    folder = tmp_path / "meridian.toml"
    folder.mkdir()
    big_trace = tmp_path / "big.jsonl"
    with big_trace.open("wb") as f:
        f.truncate(300 * 2**20)
    big_config = tmp_path / "big.toml"
    with big_config.open("wb") as f:
        f.truncate(2 * 2**20)
    return {"LINK": link, "FIFO": fifo, "DIR": folder, "BIGTRACE": big_trace, "BIGTOML": big_config}


FILE_CASES = [
    # (arguments, what the one error line says)
    ([*SIM, "--step-time-csv", "/dev/zero"], "/dev/zero is a character device, not a step-time"),
    ([*SIM, "--workload", "/dev/zero"], "/dev/zero is a character device, not a trace file"),
    ([*SIM, "--step-time-csv", "FIFO"], "fifo.toml is a FIFO (named pipe), not a step-time CSV"),
    (["config", "check", "LINK"], "zero.toml (a symlink to /dev/zero) is a character device"),
    ([*SIM, "--config", "FIFO"], "fifo.toml is a FIFO (named pipe), not a config file"),
    (["config", "check", "DIR"], "meridian.toml is a directory, not a config file"),
    (["config", "check", "BIGTOML"], "big.toml is 2 MiB, over the 1 MiB limit of a config file"),
    ([*SIM, "--workload", "BIGTRACE"], "big.jsonl is 300 MiB, over the 256 MiB limit of a trace"),
    (["config", "check", "--tokenizer", "/dev/zero"], "is a character device, not a tokenizer"),
    (
        ["bench", "accuracy", *SERVER, "--dataset", "/dev/zero", "--no-plots"],
        "/dev/zero is a character device, not a dataset file",
    ),
]


@pytest.mark.parametrize(("args", "message"), FILE_CASES)
def test_every_file_a_command_takes_is_read_bounded(
    args: list[str], message: str, odd_files: dict[str, Path], tmp_path: Path
) -> None:
    argv = [str(odd_files.get(a, a)) for a in args]
    if argv[0] == "bench":
        argv += ["--out-dir", str(tmp_path / "out")]
    run_meridian(argv).assert_refused(message)


def _toml(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_config_values_that_allocate_are_refused_by_their_dotted_path(tmp_path: Path) -> None:
    # 2**80 bytes passed `config check`, and `bench sim` grew to 8.7 GB building its blocks.
    huge = _toml(tmp_path / "huge.toml", f"[kv_memory]\ncapacity_bytes = {2**80}\n")
    limit = 'kv_memory.capacity_bytes must be "auto" or a number of bytes in [1, 4398046511104]'
    run_meridian(["config", "check", str(huge)]).assert_refused(limit)
    out = str(tmp_path / "out")
    run_meridian([*SIM, "--config", str(huge), "--out-dir", out]).assert_refused(limit)
    # Within what a node holds, but in blocks of one token: more blocks than the simulator
    # holds (each an object), refused before any work.
    tiny_blocks = _toml(
        tmp_path / "blocks.toml",
        "[kv_memory]\ncapacity_bytes = 4398046511104\nblock_size_tokens = 1\n",
    )
    run_meridian([*SIM, "--config", str(tiny_blocks), "--out-dir", out]).assert_refused(
        "kv_memory.capacity_bytes (4398046511104) makes",
        f"the simulator holds at most {MAX_SIM_KV_BLOCKS:,} blocks",
    )
    # Every thinking request holds a byte per RPDI window token.
    ring = _toml(tmp_path / "ring.toml", "[entropy]\nrpdi_window_tokens = 4294967295\n")
    run_meridian(["config", "check", str(ring)]).assert_refused(
        "entropy.rpdi_window_tokens must be in [1, 65536]; got 4294967295"
    )


def test_a_transition_phrase_too_long_to_force_is_refused(tmp_path: Path) -> None:
    # 3,000 characters passed; served, a request forced at 5 think tokens spent all of its
    # max_tokens on the phrase and never answered.
    phrase = _toml(
        tmp_path / "phrase.toml", f'[scheduler]\nforce_transition_phrase = "{"x" * 3000}"\n'
    )
    ran = run_meridian(["config", "check", str(phrase)])
    ran.assert_refused(
        "scheduler.force_transition_phrase: string should have at most 256 characters",
        "... (3,000 chars)",
    )
    assert len(ran.err) < 300  # the value is cut, the line stays a line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "100000"], "--replicas must be in [1, 1024]"),
        (["--replicas", "2", "--stats-period-s", "1e-300"], "--stats-period-s must be in [0.01,"),
        (["--replicas", "2", "--stats-period-s", "1e308"], "--stats-period-s must be in [0.01,"),
        (["--duration-s", "1e300", "--arrival-rate", "1e-300"], "--duration-s must be in (0, 60"),
        (["--workload", "servegen-r1", "--duration-s", "1e9"], "--duration-s must be in (0, 60"),
        (["--output-itl-slo-ms", "1e308"], "--output-itl-slo-ms must be a number in (0, 3,600,0"),
        (["--ttfvt-slo-base-s", "1e300"], "--ttfvt-slo-base-s must be a number in (0, 86,400]"),
    ],
)
def test_bench_sim_numbers_that_would_run_away_are_refused(
    args: list[str], message: str, tmp_path: Path
) -> None:
    # Each of these hung (a loop per replica, per stats refresh, per 10-minute window of a
    # duration) or ended in an OverflowError traceback.
    run_meridian([*SIM, *args, "--out-dir", str(tmp_path)]).assert_refused(message)


NOPE = "/proc/nope"  # cannot be created, even by root


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # The whole simulation ran (a minute), then the report's folder failed with a traceback.
        (["bench", "sim", "--out-dir", NOPE], f"--out-dir {NOPE} cannot be created"),
        (["bench", "fidelity", "--out-dir", NOPE], f"--out-dir {NOPE} cannot be created"),
        (["bench", "real", *SERVER, "--out-dir", NOPE], f"--out-dir {NOPE} cannot be created"),
        (
            ["bench", "accuracy", *SERVER, "--dataset", "d.jsonl", "--out-dir", NOPE],
            f"--out-dir {NOPE} cannot be created",
        ),
        (["bench", "ab-real", "--model", "m", "--out-dir", NOPE], f"--out-dir {NOPE} cannot be"),
        (
            [*SIM, "--export-trace", f"{NOPE}/t.jsonl"],
            f"--export-trace {NOPE}/t.jsonl: folder {NOPE} cannot be created",
        ),
        (["serve", "m", "--step-log", f"{NOPE}/s.csv"], f"--step-log {NOPE}/s.csv: folder"),
    ],
)
def test_outputs_are_checked_before_the_work(args: list[str], message: str) -> None:
    run_meridian(args).assert_refused(message)


def test_an_export_trace_into_a_new_folder_makes_it(tmp_path: Path) -> None:
    trace = tmp_path / "new" / "sub" / "t.jsonl"
    ran = run_meridian(
        [*SIM, "--duration-s", "2", "--arrival-rate", "2", "--export-trace", str(trace),
         "--out-dir", str(tmp_path / "out")]
    )  # fmt: skip
    assert ran.code == 0, ran.err
    assert trace.is_file() and trace.read_text().count("\n") >= 1


def test_a_closed_stdout_ends_quietly() -> None:
    # `meridian config check X | head -1` ended in a BrokenPipeError traceback.
    ran = run_meridian(["config", "check", str(REPO / "meridian.toml.example")], close_stdout=True)
    assert ran.code == EXIT_BROKEN_PIPE and ran.err == "", ran.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # Ray started and every replica failed its engine a minute later, each with a traceback.
        (["/nonexistent/model"], "/nonexistent/model: no such file or directory"),
        (["--port", "99999", "m"], "--port must be in 1..65535"),
        (["--address", "10.0.0.1:6379", "--num-cpus", "4", "m"], "with --address, leave it out"),
    ],
)
def test_serve_cluster_refuses_what_would_fail_after_rays_start(
    args: list[str], message: str
) -> None:
    run_meridian(["serve-cluster", *args]).assert_refused(message)


def test_serve_cluster_takes_a_hold_setting(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve-cluster", "m"]).hold == "never"
    assert parser.parse_args(["serve-cluster", "--hold", "admission", "m"]).hold == "admission"
    with pytest.raises(SystemExit) as bad:
        parser.parse_args(["serve-cluster", "--hold", "sometimes", "m"])
    assert bad.value.code == 2
    assert "--hold: invalid choice: 'sometimes'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["serve-cluster", "--help"])
    assert "--hold {never,admission,headroom}" in capsys.readouterr().out
