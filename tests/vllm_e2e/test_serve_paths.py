"""``meridian serve`` as a user runs it, on paths the other server tests do not take: speculative
decoding on the V1 runner (vLLM refuses every custom logits processor there, so Meridian starts
without its processor and says so), and the step log that calibrates the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm.sampling_params")

from conftest import meridian_server

from meridian.sim.steptime import CSV_COLUMNS, FittedStepTime
from meridian.vllm.steplog import CSV_HEADER

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def test_serve_with_speculation_and_a_step_log(tiny_model: Path, tmp_path: Path) -> None:
    import httpx

    steps = tmp_path / "steps.csv"
    extra = ["--step-log", str(steps), "--speculative-config", json.dumps(NGRAM)]
    with meridian_server(tiny_model, tmp_path, "", extra) as url:
        for i in range(6):
            resp = httpx.post(
                f"{url}/v1/completions",
                json={"model": str(tiny_model), "prompt": f"{i} + {i} =", "max_tokens": 24},
                timeout=120,
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"]
    log = (tmp_path / "server.log").read_text()
    # Started cleanly: Meridian's scheduler, no processor, and one line saying forcing is off.
    assert "speculative decoding (ngram): Meridian starts without its processor" in log
    assert "--logits-processors" not in log.split("starting", 1)[1].splitlines()[0]
    assert "MeridianScheduler" in log and "Traceback" not in log
    # Every busy step went to the step log, in the simulator's calibration format, and fits.
    lines = steps.read_text().splitlines()
    assert lines[0] == CSV_HEADER == ",".join(CSV_COLUMNS)
    rows = [[float(v) for v in line.split(",")] for line in lines[1:]]
    assert len(rows) >= 20
    assert all(row[3] >= 1 and row[4] > 0 for row in rows)  # a request, a positive time
    assert any(row[0] > 0 for row in rows)  # prompts (and draft verification)
    fit = FittedStepTime.from_csv(steps)
    assert fit.num_samples == len(rows)
