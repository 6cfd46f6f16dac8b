"""Release engineering that needs no build: one version everywhere, the licence files, the README's
Install section and the devcontainer, the workflows' permissions and pins, and the artefact-set
check. The built artefacts themselves are tested by tests/installed (make test-dist)."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

import meridian
from meridian.cli import version_text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
release = importlib.import_module("release")

VERSION = release.project_version()
WORKFLOWS = REPO / ".github" / "workflows"
# The book's table: each workflow's permissions, exactly.
PERMISSIONS = {
    "ci.yml": {"contents": "read"},
    "release.yml": {
        "contents": "write",
        "pull-requests": "write",
        "id-token": "write",
        "attestations": "write",
    },
    "sbom.yml": {"contents": "write"},
    "docs.yml": {"contents": "read", "pages": "write", "id-token": "write"},
    "gpu.yml": {"contents": "read"},
}
# The SLSA generator's provenance job reads its own workflow's path (docs/releasing.md).
EXTRA_JOB_PERMISSIONS = {("release.yml", "provenance"): {"actions": "read"}}
SLSA_GENERATOR = (
    "slsa-framework/slsa-github-generator/.github/workflows/generator_generic_slsa3.yml"
)


# -- one version --------------------------------------------------------------------------------


def changelog_releases() -> list[tuple[str, str]]:
    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.findall(r"^## \[([^\]]+)\](?: - (\S+))?$", text, flags=re.MULTILINE)


def test_meridian_version_is_pyproject_s_and_changelog_s_top_release() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meridian", "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    head = subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    # Run from this checkout: the version, then the commit.
    assert re.fullmatch(
        rf"meridian {re.escape(VERSION)} \(git checkout .*, commit {head}.*\)\n", done.stdout
    ), done.stdout
    assert meridian.__version__ == metadata.version("vllm-meridian") == VERSION
    releases = changelog_releases()
    assert releases[0] == ("Unreleased", "")
    top, date = releases[1]
    assert top == VERSION, f"CHANGELOG.md's top release is {top}, pyproject says {VERSION}"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), f"[{top}] has no release date"


def test_an_installed_package_outside_a_checkout_prints_the_version_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "lib" / "python3.11" / "site-packages" / "meridian"
    package.mkdir(parents=True)
    monkeypatch.setattr(meridian, "__file__", str(package / "__init__.py"))
    assert version_text() == f"meridian {VERSION}"
    # An unpacked sdist has src/ and pyproject.toml but no git: no commit to name.
    unpacked = tmp_path / "vllm_meridian-x" / "src" / "meridian"
    unpacked.mkdir(parents=True)
    (unpacked.parents[1] / "pyproject.toml").write_text("", encoding="utf-8")
    monkeypatch.setattr(meridian, "__file__", str(unpacked / "__init__.py"))
    assert version_text() == f"meridian {VERSION}"


# -- licence files ------------------------------------------------------------------------------


def test_licence_notice_and_the_bundled_data_s_origin() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "Apache-2.0"
    for path in project["license-files"]:
        assert (REPO / path).is_file(), path
    licence = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert licence.lstrip().startswith("Apache License\n                           Version 2.0")
    notice = (REPO / "NOTICE").read_text(encoding="utf-8")
    data = json.loads((REPO / "src/meridian/bench/data/servegen-r1.json").read_text())
    source = data["source"]
    for fact in (source["repository"], source["path"], source["commit"], "arXiv:2505.09999"):
        assert fact in notice, fact
    assert "src/meridian/bench/data/servegen-r1.json" in notice
    assert "LICENSE-servegen.txt" in notice
    # The wheel's copy of the example is the repository's file, not a second copy.
    example = REPO / "src" / "meridian" / "meridian.toml.example"
    assert example.resolve() == (REPO / "meridian.toml.example").resolve()


# -- README and devcontainer --------------------------------------------------------------------


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_install_names_this_version_s_wheel_then_doctor() -> None:
    install = readme_section("Install")
    block = re.search(r"```sh\n(.*?)```", install, flags=re.DOTALL)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block[1].splitlines()]
    wheel = release.artefact_names(VERSION)["wheel"]
    assert commands[0].startswith("pip install ") and wheel in commands[0]
    assert commands[-1] == "meridian doctor"
    wheels = set(re.findall(r"vllm_meridian-[^ '`\[]+\.whl", (REPO / "README.md").read_text()))
    assert wheels == {wheel}, f"the README names other versions' wheels: {wheels - {wheel}}"
    for page in ("CHANGELOG.md", "CONTRIBUTING.md", "SECURITY.md", "CODE_OF_CONDUCT.md"):
        assert f"]({page})" in install and (REPO / page).is_file(), page


def test_the_devcontainer_runs_the_readme_s_first_command() -> None:
    quick_start = readme_section("Quick start")
    block = re.search(r"```sh\n(.*?)```", quick_start, flags=re.DOTALL)
    assert block is not None
    first = block[1].splitlines()[0].split("#")[0].strip()
    container = json.loads((REPO / ".devcontainer" / "devcontainer.json").read_text())
    assert container["postCreateCommand"] == first == "make bench-sim"


# -- workflows ----------------------------------------------------------------------------------


def load_workflow(name: str) -> dict[Any, Any]:
    data: dict[Any, Any] = yaml.safe_load((WORKFLOWS / name).read_text(encoding="utf-8"))
    return data


def triggers(workflow: dict[Any, Any]) -> dict[str, Any]:
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert isinstance(on, dict)
    return on


def test_each_workflow_has_exactly_the_book_s_permissions() -> None:
    assert {p.name for p in WORKFLOWS.glob("*.yml")} == set(PERMISSIONS)
    rank = {"none": 0, "read": 1, "write": 2}
    for name, expected in PERMISSIONS.items():
        workflow = load_workflow(name)
        assert workflow["permissions"] == expected, name
        for job_name, job in workflow["jobs"].items():
            extra = EXTRA_JOB_PERMISSIONS.get((name, job_name), {})
            for scope, level in job.get("permissions", {}).items():
                allowed = {**expected, **extra}.get(scope, "none")
                assert rank[level] <= rank[allowed], f"{name}: job {job_name} widens {scope}"


def test_actions_are_pinned_to_major_version_tags() -> None:
    for name in PERMISSIONS:
        for job_name, job in load_workflow(name)["jobs"].items():
            if "uses" in job:  # a reusable workflow: the SLSA generator only, by its full tag
                ref, _, tag = job["uses"].partition("@")
                assert ref == SLSA_GENERATOR and re.fullmatch(r"v\d+\.\d+\.\d+", tag), job_name
                continue
            for step in job["steps"]:
                if "uses" in step:
                    assert re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+", step["uses"]), step["uses"]


def steps_run(job: dict[str, Any]) -> str:
    return "\n".join(step.get("run", "") for step in job.get("steps", []))


def test_the_workflows_do_what_the_book_says() -> None:
    ci = load_workflow("ci.yml")
    assert "bash .ci/run" in steps_run(ci["jobs"]["test"])
    assert "Signed-off-by" in steps_run(ci["jobs"]["dco"])

    release_flow = load_workflow("release.yml")
    assert triggers(release_flow)["push"]["tags"] == ["v*"]
    jobs = release_flow["jobs"]
    assert jobs["provenance"]["uses"].startswith(SLSA_GENERATOR)
    assert "make sbom test-dist" in steps_run(jobs["build"])
    published = steps_run(jobs["release"])
    assert published.index("check-artefacts dist --tag") < published.index("gh release create")
    assert "--provenance" in published
    upload = next(s for s in jobs["publish"]["steps"] if "twine upload" in s.get("run", ""))
    assert upload["if"] == "github.event_name == 'workflow_dispatch'"  # a tag push: dry run

    docs = load_workflow("docs.yml")
    assert "mkdocs build --strict" in steps_run(docs["jobs"]["build"])
    gpu = load_workflow("gpu.yml")
    assert set(triggers(gpu)) == {"workflow_dispatch"}
    (job,) = gpu["jobs"].values()
    assert job["if"] == "github.actor == github.repository_owner"
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    assert "meridian doctor" in steps_run(job)
    sbom = load_workflow("sbom.yml")
    audit = steps_run(sbom["jobs"]["supply-chain"])
    for lock in ("requirements.lock", "requirements-vllm.lock", "requirements-vllm-gpu.lock"):
        assert f"-r {lock}" in audit
    assert "make supply-chain" in audit and "make sbom" in audit


def test_actionlint_fails_a_broken_workflow(tmp_path: Path) -> None:
    actionlint = Path(sys.executable).parent / "actionlint"
    shutil.copytree(REPO / ".github", tmp_path / ".github")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    clean = subprocess.run([str(actionlint)], cwd=tmp_path, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stdout
    broken = tmp_path / ".github" / "workflows" / "ci.yml"
    broken.write_text(
        broken.read_text().replace(
            "runs-on: ubuntu-latest", "runs-on: ubuntu-latest\n    needs: no-such-job", 1
        )
    )
    done = subprocess.run([str(actionlint)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode != 0 and "no-such-job" in done.stdout


# -- the artefact set ---------------------------------------------------------------------------


def test_a_partial_or_mixed_artefact_set_fails(tmp_path: Path) -> None:
    names = release.artefact_names(VERSION)
    for name in names.values():
        (tmp_path / name).write_text("x")
    assert release.check_artefacts(tmp_path, VERSION) == []
    assert release.check_artefacts(tmp_path, VERSION, provenance=True) == [
        f"missing {release.PROVENANCE}"
    ]
    (tmp_path / names["sbom"]).unlink()
    (tmp_path / "vllm_meridian-0.0.1-py3-none-any.whl").write_text("x")
    assert release.check_artefacts(tmp_path, VERSION) == [
        f"missing {names['sbom']}",
        f"unexpected vllm_meridian-0.0.1-py3-none-any.whl (not an artefact of {VERSION})",
    ]
    assert release.main(["check-artefacts", str(tmp_path), "--tag", f"v{VERSION}"]) == 1
