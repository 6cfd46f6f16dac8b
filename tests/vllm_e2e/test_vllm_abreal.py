"""`meridian bench ab-real`: a stock server and a Meridian server in turn, one A/B report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm.sampling_params")


def test_ab_real_runs_both_servers_and_writes_the_ab_report(
    tiny_model: Path, tmp_path: Path
) -> None:
    from meridian.cli import main

    out = tmp_path / "ab"
    args = ["bench", "ab-real", "--model", str(tiny_model), "--duration-s", "5",
            "--arrival-rate", "2", "--max-think-tokens", "64", "--max-prompt-tokens", "100",
            "--replay-think-lengths", "--seed", "1", "--out-dir", str(out), "--no-plots",
            "--", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(4 << 20),
            "--enforce-eager", "--seed", "0"]  # fmt: skip
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["policies"] == ["meridian", "vllm-fcfs"]
    for side in ("meridian", "vllm-fcfs"):
        summary = report["summaries"][side]
        assert summary["num_finished"] == summary["num_requests"] > 0
        # --replay-think-lengths: every think phase ends at the workload's (capped) length.
        assert 0 < summary["think_tokens"]["max"] <= 64
        assert summary["output_itl_s"]["count"] > 0  # answers were streamed as content
        assert (out / f"server-{side}.log").stat().st_size > 0
    ab = json.loads((out / "ab-report.json").read_text())
    assert ab["candidate"] == "meridian" and ab["baselines"] == ["vllm-fcfs"]
    assert "Where Meridian loses" in (out / "ab-report.md").read_text()
