"""The documentation site: generated pages up to date, every config field documented, every
page in the nav, ADRs complete, runbooks naming real metrics, and `mkdocs build --strict`."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pydantic import BaseModel

from meridian.config.boundaries import ModelDefinition
from meridian.config.schema import MeridianConfig

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
GEN_DOCS = REPO / "scripts" / "gen_docs.py"
MKDOCS_YML = REPO / "mkdocs.yml"
CONFIG_PAGE = DOCS / "reference" / "configuration.md"
METRICS_PAGE = DOCS / "reference" / "metrics.md"
# Identifiers that look like metric names but are request knobs (SamplingParams.extra_args).
# Names in the docs that are not metrics: request knobs, scheduler attributes, the scheduler's
# kv_transfer_params key, and the prefix of the retired disaggregation metrics (ADR-0014).
NOT_METRICS = frozenset(
    {
        "meridian_disagg_",
        "meridian_forcing",
        "meridian_max_think_tokens",
        "meridian_signals",
        "meridian_num_tracked",
        "meridian_stats",
        "meridian_overhead",
        "meridian_metrics",
        "meridian_prompt_tokens",
    }
)


def load_gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", GEN_DOCS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_gen_docs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GEN_DOCS), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def config_field_paths() -> list[tuple[str, Any]]:
    """``(dotted path, FieldInfo)`` of every field a user can set, walked independently of
    gen_docs so the two cannot share a blind spot."""
    paths: list[tuple[str, Any]] = []
    for section, field in MeridianConfig.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += [(f"{section}.{n}", f) for n, f in annotation.model_fields.items()]
        else:
            assert section == "model", f"unexpected top-level config field {section}"
            paths += [(f"model.NAME.{n}", f) for n, f in ModelDefinition.model_fields.items()]
    return paths


def _plain(text: str) -> str:
    return re.sub(r"&lt;|&gt;|[<>`\\]", "", text)


# -- generated pages ----------------------------------------------------------------------------


def test_generated_pages_are_up_to_date() -> None:
    result = run_gen_docs("--check")
    assert result.returncode == 0, (
        "generated docs are stale; run .venv/bin/python scripts/gen_docs.py\n" + result.stderr
    )


def test_check_fails_on_drift_and_on_a_missing_page(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(DOCS / "reference", docs / "reference")
    assert run_gen_docs("--check", "--docs-dir", str(docs)).returncode == 0

    edited = docs / "reference" / "configuration.md"
    edited.write_text(edited.read_text(encoding="utf-8").replace("80.0", "81.0", 1))
    result = run_gen_docs("--check", "--docs-dir", str(docs))
    assert result.returncode == 1
    assert "reference/configuration.md: stale" in result.stderr
    # The diff shows what the code generates.
    assert any(line.startswith("+") and "`80.0`" in line for line in result.stderr.splitlines())

    (docs / "reference" / "metrics.md").unlink()
    result = run_gen_docs("--check", "--docs-dir", str(docs))
    assert result.returncode == 1
    assert "reference/metrics.md: stale" in result.stderr


def test_without_check_rewrites_the_pages(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    assert run_gen_docs("--docs-dir", str(docs)).returncode == 0
    assert (docs / "reference" / "configuration.md").read_text(
        encoding="utf-8"
    ) == CONFIG_PAGE.read_text(encoding="utf-8")
    assert run_gen_docs("--check", "--docs-dir", str(docs)).returncode == 0


def test_every_config_field_is_on_the_configuration_page() -> None:
    page = CONFIG_PAGE.read_text(encoding="utf-8")
    sections = re.split(r"^### ", page, flags=re.MULTILINE)
    by_path = {s.split("`", 2)[1]: s for s in sections[1:]}
    paths = config_field_paths()
    assert len(paths) >= 30
    for path, field in paths:
        assert path in by_path, f"{path} has no section on the configuration page"
        block = by_path[path]
        assert "- Type: " in block and "- Default: " in block and "- Range: " in block
        assert re.search(r"- Tuning advice: \S", block), f"{path}: no tuning advice"
        extra = field.json_schema_extra
        if isinstance(extra, dict) and "range" in extra:
            assert f"`{extra['range']}`" in block, f"{path}: range {extra['range']} not shown"
        if field.description:
            # Compare without markup: the page escapes < and > outside code spans.
            first_words = _plain(" ".join(field.description.split()[:4]))
            assert first_words in _plain(block), f"{path}: description not shown"
    assert set(by_path) == {p for p, _ in paths}, "the page documents fields that do not exist"


def test_a_field_without_advice_fails_generation() -> None:
    gen_docs = load_gen_docs()
    advice = dict(gen_docs.ADVICE)
    del advice["entropy.ema_alpha"]
    with pytest.raises(gen_docs.GenDocsError, match=r"no tuning advice for: entropy\.ema_alpha"):
        gen_docs.render_configuration(advice)
    stale = {**gen_docs.ADVICE, "entropy.removed_knob": "advice for nothing"}
    with pytest.raises(gen_docs.GenDocsError, match=r"do not exist: entropy\.removed_knob"):
        gen_docs.render_configuration(stale)


def test_rendering_escapes_html_and_names_toml_types() -> None:
    gen_docs = load_gen_docs()
    assert gen_docs.md_text("e.g. <think>, or ``<think>``") == "e.g. &lt;think&gt;, or `<think>`"
    assert gen_docs.md_text("a | b `c | d`") == "a \\| b `c | d`"
    fields = {path: field for path, field in config_field_paths()}
    assert gen_docs.toml_type(fields["entropy.eat_min_distance"].annotation) == (
        "integer (optional)"
    )
    assert gen_docs.toml_type(fields["kv_memory.capacity_bytes"].annotation) == 'integer or "auto"'
    assert gen_docs.toml_type(fields["scheduler.admission"].annotation) == '"headroom" or "vllm"'
    assert gen_docs.toml_type(fields["model.NAME.think_end_token_ids"].annotation) == (
        "array of integers (optional)"
    )


def test_metrics_page_lists_the_catalogue() -> None:
    page = METRICS_PAGE.read_text(encoding="utf-8")
    try:
        from meridian.telemetry.catalogue import CATALOGUE
    except ModuleNotFoundError:
        assert "Not built yet" in page
        return
    for spec in CATALOGUE:
        assert f"## `{spec.name}` {{#{spec.name}}}" in page
        if spec.dotted:
            assert f"| `{spec.dotted}` | `{spec.name}` |" in page


# -- hand-written pages -------------------------------------------------------------------------


def nav_pages() -> list[str]:
    text = MKDOCS_YML.read_text(encoding="utf-8")
    nav = text[text.index("\nnav:") :]
    return re.findall(r"^\s+-\s+(?:[^:\n]+:\s+)?(\S+\.md)\s*$", nav, flags=re.MULTILINE)


def test_nav_lists_every_page_once() -> None:
    listed = nav_pages()
    assert len(listed) == len(set(listed)), "a page is listed twice in the nav"
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk - set(listed) == set(), "pages missing from the nav in mkdocs.yml"
    # Pages other helpers own are in the nav even before they land; everything else must exist.
    owned_elsewhere = {"vllm.md", "adr/0008-preemption-policy.md"}
    assert set(listed) - on_disk <= owned_elsewhere


def test_adrs_have_every_part_and_are_indexed() -> None:
    index = (DOCS / "adr" / "index.md").read_text(encoding="utf-8")
    adrs = sorted((DOCS / "adr").glob("[0-9][0-9][0-9][0-9]-*.md"))
    numbers = [p.name[:4] for p in adrs]
    assert len(numbers) == len(set(numbers)), "two ADRs share a number"
    assert {f"{n:04d}" for n in range(1, 11)} <= set(numbers)
    for path in adrs:
        text = path.read_text(encoding="utf-8")
        assert text.startswith(f"# ADR-{path.name[:4]}: "), path.name
        assert re.search(r"^Status: \w+", text, flags=re.MULTILINE), f"{path.name}: no Status"
        for part in ("## Context", "## Decision", "## Consequences"):
            assert part in text, f"{path.name}: no {part}"
        assert f"]({path.name})" in index, f"{path.name} is not in docs/adr/index.md"


def test_architecture_diagram_covers_the_state_machine() -> None:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    diagrams = re.findall(r"```mermaid\n(.*?)```", text, flags=re.DOTALL)
    states = next(d for d in diagrams if d.startswith("stateDiagram"))
    for word in (
        "Prefill",
        "Think",
        "Output",
        "Complete",
        "EnterThink",
        "ExitThink",
        "ForceBudget",
    ):
        assert word in states, word
    assert "single-phase" in states


def test_runbooks_and_pages_name_only_catalogue_metrics() -> None:
    catalogue = pytest.importorskip(
        "meridian.telemetry.catalogue", reason="the metric catalogue is not built yet"
    )
    known: set[str] = set()
    for spec in (*catalogue.CATALOGUE, *catalogue.CLUSTER_CATALOGUE):
        known.add(spec.name)
        if spec.kind.value == "histogram":
            known |= {f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count"}
    generated = {CONFIG_PAGE, METRICS_PAGE}
    unknown: list[str] = []
    for page in sorted(DOCS.rglob("*.md")):
        if page in generated:
            continue
        for name in re.findall(r"\bmeridian_[a-z0-9_]+", page.read_text(encoding="utf-8")):
            if name not in known and name not in NOT_METRICS:
                unknown.append(f"{page.relative_to(DOCS)}: {name}")
    assert unknown == [], "pages name metrics that are not in the catalogue"


def test_runbooks_have_every_part() -> None:
    runbooks = sorted(p for p in (DOCS / "runbooks").glob("*.md") if p.name != "index.md")
    assert {p.stem for p in runbooks} >= {
        "stutter-under-load",
        "forcing-never-fires",
        "runaway-tracked-requests",
        "plugin-not-active",
    }
    for path in runbooks:
        text = path.read_text(encoding="utf-8")
        for part in ("## Symptoms", "## Metrics", "## Checks", "## Fixes"):
            assert part in text, f"{path.name}: no {part}"
        assert re.search(r"\bmeridian_[a-z_]+", text), f"{path.name} names no metric"


# -- the site -----------------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed in this environment")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(MKDOCS_YML),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    config_html = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text(
        encoding="utf-8"
    )
    assert 'id="entropy.ema_alpha"' in config_html
    arch_html = (tmp_path / "site" / "architecture" / "index.html").read_text(encoding="utf-8")
    assert arch_html.count('class="mermaid"') >= 2  # the layers and the phase state machine


README = REPO / "README.md"


def test_readme_lists_every_bundled_model_family_with_its_parser() -> None:
    from meridian.config.boundaries import BUNDLED_MODELS

    rows = {
        m[1]: m[2]
        for m in re.finditer(r"^\| `(\w+)` \|.*\| `(\w+)` \| [^|]+ \|$", README.read_text(), re.M)
        if m[1] in BUNDLED_MODELS or "_" in m[1]
    }
    assert rows == {name: d.reasoning_parser for name, d in BUNDLED_MODELS.items()}
    for definition in BUNDLED_MODELS.values():
        ids = definition.think_start_token_ids
        if ids is not None and len(ids) == 1:
            assert f"| {ids[0]} / {definition.think_end_token_ids[0]} |" in README.read_text()


def test_readme_and_docs_stay_inside_the_repo_and_define_their_terms() -> None:
    text = README.read_text()
    pages = [README, *DOCS.glob("*.md")]
    for page in pages:
        body = page.read_text()
        assert "../shared/" not in body, page
        assert "issue's target" not in body and "issue-11" not in body.lower(), page
    for term in ("TTFVT", "TTOT", "goodput"):
        assert f"**{term}**" in text.split("## Quick start")[0], term


def test_rendered_blocks_match_the_committed_results() -> None:
    # Each committed sweep renders the README's and docs' tables; a hand edit or a stale table
    # differs from what the JSON renders.
    from meridian.bench.targets import TargetsRun
    from meridian.bench.targets_render import block_keys, blocks, render_docs

    runs = [
        TargetsRun.model_validate_json(p.read_text(encoding="utf-8"))
        for p in sorted((REPO / "benchmarks" / "results").glob("targets-*.json"))
    ]
    for page in (README, DOCS / "benchmarks.md"):
        text = page.read_text(encoding="utf-8")
        assert render_docs(text, runs) == text, f"{page.name}: run bench_targets.py --render"
        filled = {key for run in runs for key in blocks(run)}
        assert set(block_keys(text)) <= filled, f"{page.name}: a block no committed run fills"
