#!/usr/bin/env python3
"""Release tooling: the built wheel in a fresh environment, the SBOM of that environment, and the
check that a release's artefact set is whole.

Usage::

    .venv/bin/python scripts/release.py sbom dist            # dist/vllm_meridian-V.cdx.json
    .venv/bin/python scripts/release.py check-artefacts dist [--tag vV] [--provenance]

``sbom`` installs ``dist``'s wheel, with the versions requirements.lock pins, into a virtual
environment made for it under a temporary directory (no pip of its own, so it holds exactly the
wheel's runtime dependency closure), describes that environment with CycloneDX's own generator
(``cyclonedx-py environment``), validates the document against the CycloneDX 1.6 schema and
checks every component against the lock. ``make test-dist`` installs the wheel the same way
(:func:`fresh_env`). ``check-artefacts`` fails unless the wheel, the sdist and the SBOM of
pyproject's version (and the provenance, with ``--provenance``) are all there and nothing of
another version is: the release workflow runs it before anything is published.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = REPO_ROOT / "pyproject.toml"
LOCK = REPO_ROOT / "requirements.lock"
# The file names the wheel and sdist of distribution vllm-meridian get (PEP 427 / PEP 625).
STEM = "vllm_meridian"
PROVENANCE = "vllm-meridian.intoto.jsonl"
# pip's warning for each package that this machine's extra index location does not hold.
_PIP_NOISE = "is ignored: it is neither a file nor a directory"


def project_version() -> str:
    """The one version: pyproject.toml's ``project.version``."""
    with PYPROJECT.open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def artefact_names(version: str) -> dict[str, str]:
    """The file name of each artefact a release of ``version`` ships."""
    return {
        "wheel": f"{STEM}-{version}-py3-none-any.whl",
        "sdist": f"{STEM}-{version}.tar.gz",
        "sbom": f"{STEM}-{version}.cdx.json",
    }


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(lock: Path = LOCK) -> dict[str, str]:
    """``name == version`` lines of a lock file, by normalised name (hash lines skipped)."""
    pins: dict[str, str] = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if match:
            pins[normalize(match[1])] = match[2]
    return pins


def check_artefacts(dist: Path, version: str, *, provenance: bool = False) -> list[str]:
    """What is wrong with ``dist`` as the artefact set of ``version`` (empty: whole)."""
    expected = set(artefact_names(version).values())
    if provenance:
        expected.add(PROVENANCE)
    present = {p.name for p in dist.iterdir()} if dist.is_dir() else set()
    problems = [f"missing {name}" for name in sorted(expected - present)]
    problems += [
        f"unexpected {name} (not an artefact of {version})"
        for name in sorted(present - expected)
        if name.startswith(STEM) or name.endswith((".whl", ".tar.gz", ".cdx.json", ".jsonl"))
    ]
    return problems


def _run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    if done.returncode != 0:
        stderr = "\n".join(line for line in done.stderr.splitlines() if _PIP_NOISE not in line)
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{stderr}")
    return done


def purelib(python: Path) -> Path:
    """The site-packages directory of the environment ``python`` runs in."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(_run([str(python), "-c", code]).stdout.strip())


def fresh_env(
    where: Path, wheel: Path, *, base_python: Path | None = None, layer_on: Path | None = None
) -> Path:
    """A new virtual environment at ``where`` with ``wheel`` installed (a copy, not an editable
    install), and its python.

    Without ``layer_on`` the wheel comes with its dependencies at the versions requirements.lock
    pins. With ``layer_on`` (another environment's python) the wheel is installed alone and that
    environment's site-packages is appended to this one's path as a plain directory, so its
    packages (vLLM) import while its ``.pth`` files, an editable Meridian's among them, are not
    run. The environment has no pip: what it holds is the wheel and what the wheel needs.
    """
    base = base_python or layer_on or Path(sys.executable)
    _run([str(base), "-m", "venv", "--without-pip", str(where)])
    python = where / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    if layer_on is None:
        _run([*pip, "install", "--quiet", "-c", str(LOCK), str(wheel)])
    else:
        _run([*pip, "install", "--quiet", "--no-deps", str(wheel)])
        layer = purelib(layer_on)
        (purelib(python) / "_meridian_layer.pth").write_text(f"{layer}\n", encoding="utf-8")
    return python


def environment_sbom(python: Path, out: Path) -> dict[str, Any]:
    """CycloneDX 1.6 JSON of the environment ``python`` runs in, with vllm-meridian (from
    pyproject.toml) as the root component, written to ``out``; the document."""
    _run(
        [
            sys.executable,
            "-m",
            "cyclonedx_py",
            "environment",
            "--pyproject",
            str(PYPROJECT),
            "--mc-type",
            "library",
            "--output-reproducible",
            "--sv",
            "1.6",
            "--of",
            "JSON",
            "-o",
            str(out),
            str(python),
        ]
    )
    document: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return document


def schema_errors(text: str) -> str | None:
    """The CycloneDX 1.6 JSON schema's complaint about ``text`` (None: valid)."""
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    return None if error is None else str(error)


def lock_mismatches(document: dict[str, Any], pins: dict[str, str]) -> list[str]:
    """Components whose version is not the one the lock pins (or that the lock lacks)."""
    wrong = []
    for component in document.get("components", []):
        pinned = pins.get(normalize(component["name"]))
        if pinned != component["version"]:
            wrong.append(f"{component['name']} {component['version']} (lock: {pinned})")
    return wrong


def write_sbom(dist: Path) -> Path:
    """``dist``'s SBOM for pyproject's version, validated; its path."""
    names = artefact_names(project_version())
    wheel = dist / names["wheel"]
    if not wheel.is_file():
        raise RuntimeError(f"{wheel} is missing: run make dist first")
    out = dist / names["sbom"]
    scratch = Path(tempfile.mkdtemp(prefix="meridian-sbom-"))
    try:
        document = environment_sbom(fresh_env(scratch / "venv", wheel), out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    error = schema_errors(out.read_text(encoding="utf-8"))
    if error is not None:
        raise RuntimeError(f"{out} does not validate against CycloneDX 1.6: {error}")
    wrong = lock_mismatches(document, lock_pins())
    if wrong:
        raise RuntimeError(f"{out}: components not as requirements.lock pins: {', '.join(wrong)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    sbom = commands.add_parser("sbom", help="write and validate the wheel's CycloneDX SBOM")
    sbom.add_argument("dist", type=Path)
    check = commands.add_parser("check-artefacts", help="fail on a partial artefact set")
    check.add_argument("dist", type=Path)
    check.add_argument("--tag", help="the release tag (v + pyproject's version)")
    check.add_argument("--provenance", action="store_true", help="expect the SLSA provenance")
    args = parser.parse_args(argv)
    version = project_version()
    if args.command == "sbom":
        try:
            out = write_sbom(args.dist)
        except RuntimeError as exc:
            print(f"release.py sbom: {exc}", file=sys.stderr)
            return 1
        document = json.loads(out.read_text(encoding="utf-8"))
        print(
            f"wrote {out}: CycloneDX {document['specVersion']}, valid, "
            f"{len(document['components'])} components, every one as requirements.lock pins it"
        )
        return 0
    problems = check_artefacts(args.dist, version, provenance=args.provenance)
    if args.tag is not None and args.tag != f"v{version}":
        problems.append(f"tag {args.tag} is not v{version} (pyproject.toml's version)")
    for problem in problems:
        print(f"release.py check-artefacts: {problem}", file=sys.stderr)
    if not problems:
        print(f"{args.dist}: the whole artefact set of {version}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
