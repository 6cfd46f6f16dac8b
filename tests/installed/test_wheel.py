"""The built artefacts, checked and used as a user gets them (`make test-dist`).

The wheel is installed into a fresh virtual environment under a temporary directory outside the
checkout (a copy, not an editable install; the versions requirements.lock pins; commands run
from a directory of their own with no PYTHONPATH), then run: `meridian --version`,
`meridian config check` on the example the wheel carries, `meridian bench sim` on both bundled
workloads, and `meridian doctor`. Doctor needs vLLM: it runs in a second environment holding the
wheel alone, layered over the vLLM environment MERIDIAN_VLLM_VENV names (make passes .venv-vllm
when it is built); without one that test is skipped and says so in the summary. The SBOM of the
fresh environment is validated against the CycloneDX schema.

MERIDIAN_DIST_DIR names the directory `make dist` filled; without it the module is skipped.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
release = importlib.import_module("release")

VERSION = release.project_version()
NAMES = release.artefact_names(VERSION)
DIST_INFO = f"vllm_meridian-{VERSION}.dist-info"
# What the wheel must carry beyond the modules, named so that a missing one reads plainly.
PACKAGE_DATA = (
    "meridian/py.typed",
    "meridian/meridian.toml.example",
    "meridian/bench/data/servegen-r1.json",
    "meridian/bench/data/LICENSE-servegen.txt",
    "meridian/bench/data/workloads.toml",
    "meridian/sim/data/presets.toml",
)
RUNTIME_DEPENDENCIES = {"pydantic", "numpy", "rich", "prometheus-client", "matplotlib", "httpx"}

pytestmark = pytest.mark.skipif(
    not os.environ.get("MERIDIAN_DIST_DIR"),
    reason="the built wheel is tested by `make test-dist`, which builds it first",
)


@pytest.fixture(scope="module")
def dist() -> Path:
    return Path(os.environ["MERIDIAN_DIST_DIR"])


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    path = dist / NAMES["wheel"]
    assert path.is_file(), f"{path} is missing: make dist builds it"
    return path


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="meridian-test-dist-")).resolve()
    assert not where.is_relative_to(REPO), f"{where} is inside the checkout"
    (where / "work").mkdir()
    (where / "tmp").mkdir()
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def python(wheel: Path, scratch: Path) -> Path:
    return release.fresh_env(scratch / "venv", wheel)


def run(
    python: Path, command: str, *args: str, scratch: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``command`` (a script of ``python``'s environment) as a user runs it: from a directory of
    its own outside the checkout, with that environment first on PATH and no PYTHONPATH (and
    temporary files in the scratch directory: doctor leaves its stand-in model there)."""
    bindir = python.parent
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(bindir.parent)
    env["TMPDIR"] = str(scratch / "tmp")  # what the commands leave there goes with the scratch
    return subprocess.run(
        [str(bindir / command), *args],
        cwd=scratch / "work",
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def tracked_package_files() -> list[str]:
    """src/meridian's files as git tracks them, as the wheel names them (meridian/...)."""
    done = subprocess.run(
        ["git", "ls-files", "src/meridian"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return [line.removeprefix("src/") for line in done.stdout.splitlines()]


# -- the artefacts ------------------------------------------------------------------------------


def test_the_wheel_holds_the_package_its_data_and_licences_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        meta = archive.read(f"{DIST_INFO}/METADATA").decode()
    assert {name.split("/")[0] for name in names} == {"meridian", DIST_INFO}
    parts = {part for name in names for part in name.split("/")}
    assert not parts & {"tests", "benchmarks", "scripts", "conftest.py"}
    assert not [n for n in names if n.rsplit("/", 1)[-1].startswith("test_")]
    missing = [n for n in PACKAGE_DATA if n not in names]
    assert not missing, f"package data missing from the wheel: {missing}"
    missing = [n for n in tracked_package_files() if n not in names]
    assert not missing, f"files of src/meridian missing from the wheel: {missing}"
    for licence in ("LICENSE", "NOTICE", "src/meridian/bench/data/LICENSE-servegen.txt"):
        assert f"{DIST_INFO}/licenses/{licence}" in names
    assert f"Version: {VERSION}\n" in meta
    assert "License-Expression: Apache-2.0\n" in meta


def test_the_sdist_holds_the_licence_notice_and_the_package_data(dist: Path) -> None:
    root = f"vllm_meridian-{VERSION}"
    with tarfile.open(dist / NAMES["sdist"]) as archive:
        members = {m.name: m for m in archive.getmembers()}
        notice = archive.extractfile(members[f"{root}/NOTICE"])
        assert notice is not None
        notice_text = notice.read().decode()
    for name in ("LICENSE", "NOTICE", "pyproject.toml", "PKG-INFO", "README.md"):
        assert members[f"{root}/{name}"].isfile(), name
    for name in PACKAGE_DATA:
        # The example is a link in the checkout; the sdist carries the file itself.
        assert members[f"{root}/src/{name}"].isfile(), name
    assert "ServeGen" in notice_text and "f891d11" in notice_text


# -- the wheel, installed -----------------------------------------------------------------------


def test_the_installed_package_is_the_wheel_not_a_source_tree(python: Path, scratch: Path) -> None:
    code = (
        "import json, sys, meridian; from importlib import metadata; "
        "d = metadata.distribution('vllm-meridian'); "
        "print(json.dumps({'file': meridian.__file__, 'path': sys.path, "
        "'direct_url': json.loads(d.read_text('direct_url.json') or '{}')}))"
    )
    done = run(python, "python", "-c", code, scratch=scratch)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    site = release.purelib(python)
    assert Path(seen["file"]).resolve().is_relative_to(site.resolve())
    inside = [p for p in seen["path"] if p and Path(p).resolve().is_relative_to(REPO)]
    assert not inside, f"the checkout is on the installed package's path: {inside}"
    assert "archive_info" in seen["direct_url"], seen["direct_url"]  # a file, not editable
    installed = {
        release.normalize(d.metadata["Name"]) for d in metadata.distributions(path=[str(site)])
    }
    assert "pip" not in installed and "pytest" not in installed


def test_meridian_version_prints_pyproject_s_version(python: Path, scratch: Path) -> None:
    done = run(python, "meridian", "--version", scratch=scratch)
    assert done.returncode == 0, done.stderr
    # Outside a git checkout the version alone (no commit).
    assert done.stdout == f"meridian {VERSION}\n"


def test_config_check_passes_on_the_example_the_wheel_ships(python: Path, scratch: Path) -> None:
    code = "import importlib.resources as r; print(r.files('meridian') / 'meridian.toml.example')"
    located = run(python, "python", "-c", code, scratch=scratch)
    assert located.returncode == 0, located.stderr
    example = Path(located.stdout.strip())
    assert example.read_bytes() == (REPO / "meridian.toml.example").read_bytes()
    done = run(python, "meridian", "config", "check", str(example), scratch=scratch)
    assert done.returncode == 0, done.stderr
    header, _, body = done.stdout.partition("\n")
    assert header == f"# config: {example}: OK"
    assert "scheduler" in json.loads(body)


@pytest.mark.parametrize(("workload", "rate"), [("synthetic", "16"), ("servegen-r1", "1.9")])
def test_bench_sim_runs_each_bundled_workload(
    python: Path, scratch: Path, workload: str, rate: str
) -> None:
    out = scratch / f"sim-{workload}"
    done = run(
        python,
        "meridian",
        "bench",
        "sim",
        "--workload",
        workload,
        "--arrival-rate",
        rate,
        "--duration-s",
        "5",
        "--out-dir",
        str(out),
        scratch=scratch,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "meridian" in done.stdout and "Traceback" not in done.stderr
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert workload in json.dumps(report)
    assert list(out.glob("*.png")), "no plot drawn (matplotlib from the wheel's dependencies)"


def test_doctor_without_vllm_names_what_to_install(python: Path, scratch: Path) -> None:
    done = run(python, "meridian", "doctor", scratch=scratch)
    assert done.returncode == 1  # vLLM is not a dependency of the wheel
    assert "FAIL  vLLM: not installed" in done.stdout
    assert f"PASS  package: vllm-meridian {VERSION}" in done.stdout
    assert "Traceback" not in done.stderr


def test_doctor_passes_where_vllm_is_present(wheel: Path, scratch: Path) -> None:
    vllm_venv = os.environ.get("MERIDIAN_VLLM_VENV")
    if not vllm_venv:
        message = (
            "vLLM IS ABSENT: `meridian doctor` was NOT run from the wheel with vLLM "
            "(build .venv-vllm with `make vllm-venv`, or set MERIDIAN_VLLM_VENV)"
        )
        print(f"\n*** {message} ***", file=sys.stderr)
        pytest.skip(message)
    python = release.fresh_env(
        scratch / "vllm-layer", wheel, layer_on=Path(vllm_venv) / "bin" / "python"
    )
    located = run(
        python, "python", "-c", "import meridian; print(meridian.__file__)", scratch=scratch
    )
    assert Path(located.stdout.strip()).is_relative_to(release.purelib(python))
    done = run(python, "meridian", "doctor", scratch=scratch, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS  vLLM: " in done.stdout
    assert f"PASS  package: vllm-meridian {VERSION}" in done.stdout


# -- the SBOM -----------------------------------------------------------------------------------


def test_the_sbom_of_the_wheel_s_closure_validates(python: Path, scratch: Path) -> None:
    out = scratch / "sbom.cdx.json"
    document = release.environment_sbom(python, out)
    text = out.read_text(encoding="utf-8")
    assert release.schema_errors(text) is None
    broken = json.loads(text)
    broken["components"][0]["type"] = "not-a-type"
    assert release.schema_errors(json.dumps(broken)) is not None  # the validator can fail

    root = document["metadata"]["component"]
    assert (root["name"], root["version"]) == ("vllm-meridian", VERSION)
    assert root["licenses"][0]["license"]["id"] == "Apache-2.0"
    site = release.purelib(python)
    installed = {
        (release.normalize(d.metadata["Name"]), d.version)
        for d in metadata.distributions(path=[str(site)])
    } - {("vllm-meridian", VERSION)}
    components = {(release.normalize(c["name"]), c["version"]) for c in document["components"]}
    assert components == installed
    assert {name for name, _ in components} >= RUNTIME_DEPENDENCIES
    assert release.lock_mismatches(document, release.lock_pins()) == []
    print(f"\nSBOM of the wheel's runtime closure: {len(components)} components")
