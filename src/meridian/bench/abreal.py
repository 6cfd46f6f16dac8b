"""``meridian bench ab-real``: stock vLLM and Meridian, in turn, on the same model and workload.

Each side is a real OpenAI server on 127.0.0.1 started by this process and stopped after its
run. The stock side is vLLM's own order (through
:class:`~meridian.vllm.scheduler.MeridianShadowScheduler`, or its asynchronous twin where vLLM
schedules asynchronously: it keeps vLLM's order and only counts, so preemptions by phase can be
compared) with no logits processor: no forcing. The
Meridian side is exactly what ``meridian serve`` starts. After each run the server's ``/metrics``
is scraped for preemptions by phase.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from meridian.bench.realmode import RealRunSpec, run_real
from meridian.config.schema import MeridianConfig
from meridian.core.types import Phase
from meridian.errors import MeridianError
from meridian.sim.records import SimResult
from meridian.sim.request import RequestSpec
from meridian.vllm.resolve import EngineResolution

STOCK = "vllm-fcfs"
CANDIDATE = "meridian"


@dataclass(frozen=True, slots=True)
class AbRealSpec:
    """The model, its family and config, and the vLLM arguments both servers get."""

    model: str
    vllm_args: Sequence[str] = ()
    config: MeridianConfig | None = None
    config_path: Path | None = None
    model_family: str | None = None
    startup_timeout_s: float = 300.0
    log_dir: Path | None = None
    replay_think_lengths: bool = False
    # The stock side keeps Meridian's logits processor (the same forcing on both sides, e.g.
    # a server-wide think cap) instead of running without one.
    stock_forcing: bool = False
    # vLLM's resolution of the engine arguments (runner, scheduling mode): both sides' scheduler
    # class and processor follow it. None: resolved from ``model`` and ``vllm_args`` when needed.
    engine: EngineResolution | None = None


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def server_command(
    side: str, spec: AbRealSpec, port: int, metrics_dir: Path
) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one side's server."""
    from meridian.vllm.resolve import resolve_engine
    from meridian.vllm.serve import build_serve_argv

    args = ["--host", "127.0.0.1", "--port", str(port), *spec.vllm_args]
    cmd = build_serve_argv(
        spec.model,
        args,
        spec.config,
        engine=spec.engine or resolve_engine(spec.model, spec.vllm_args),
        config_path=spec.config_path,
        model_family=spec.model_family,
        metrics_dir=metrics_dir,
        shadow=side == STOCK,
    )
    argv = list(cmd.argv)
    if side == STOCK and "--logits-processors" in argv and not spec.stock_forcing:
        j = argv.index("--logits-processors")
        del argv[j : j + 2]
    return argv, cmd.env


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log: Path) -> None:
    """Poll ``url``/health each second until it answers 200; raise if ``proc`` exits first or
    ``timeout_s`` passes (naming the server's ``log``)."""
    start = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise MeridianError(f"the server exited with {proc.returncode}; see {log}")
        if time.perf_counter() - start > timeout_s:
            raise MeridianError(f"the server was not healthy after {timeout_s:g} s; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)


def scrape_preemptions(text: str) -> dict[Phase, int]:
    """Preemptions by phase from a ``/metrics`` page."""
    preemptions: dict[Phase, int] = {}
    phases = {p.name.lower(): p for p in Phase}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meridian_preemptions_total":
                phase = phases.get(sample.labels.get("phase", ""))
                if phase is not None:
                    preemptions[phase] = preemptions.get(phase, 0) + int(sample.value)
    return preemptions


@contextmanager
def serving(side: str, spec: AbRealSpec) -> Iterator[str]:
    """One side's server on a free 127.0.0.1 port while the block runs (its base URL); stopped,
    with its whole process group, afterwards. Its log is ``server-SIDE.log`` in
    ``spec.log_dir`` (a fresh temporary folder when unset)."""
    port = free_port()
    log_dir = spec.log_dir or Path(tempfile.mkdtemp(prefix="meridian-abreal-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{side}.log"
    url = f"http://127.0.0.1:{port}"
    # The server's multiprocess metric files live only as long as the server.
    with (
        tempfile.TemporaryDirectory(prefix=f"meridian-prom-{side}-") as metrics_dir,
        log_path.open("wb") as log,
    ):
        argv, env = server_command(side, spec, port, Path(metrics_dir))
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_healthy(proc, url, spec.startup_timeout_s, log_path)
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_side(
    side: str, spec: AbRealSpec, requests: Sequence[RequestSpec]
) -> tuple[SimResult, list[str], list[str]]:
    """Start one side's server, replay ``requests``, scrape its counters, stop it."""
    with serving(side, spec) as url:
        run = RealRunSpec(
            url=f"{url}/v1", model=spec.model, replay_think_lengths=spec.replay_think_lengths
        )
        result, errors, retried = run_real(run, requests, side)
        preemptions = scrape_preemptions(httpx.get(f"{url}/metrics", timeout=10).text)
    result.counters.preemptions_by_phase = preemptions
    return result, errors, retried
