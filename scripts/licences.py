#!/usr/bin/env python3
"""Meridian's dependency licence policy, applied to what the lock files pin.

Each lock file's packages are read from the installed metadata of the environment it builds
(requirements.lock: .venv; requirements-vllm.lock: .venv-vllm; requirements-vllm-gpu.lock:
.venv-vllm-gpu's own site-packages), and each licence is judged against
supply-chain/licence-policy.toml: an SPDX expression of allowed licences, or an exception listed
with its reason. The reading, in order: PEP 639's ``License-Expression`` alone when present;
else the ``License`` field (a name; a licence's full text counts only by its first line, when
that line is a name) and every ``License ::`` classifier, each of which must be allowed.

Usage::

    .venv/bin/python scripts/licences.py [--venv LOCK=DIR ...]   # every package; exit 1 on a
                                                                 # violation

tests/supply_chain/test_locked_licences.py runs the same check in ``make supply-chain``.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import release  # scripts/release.py: the lock parsing and environment paths
from license_expression import (
    AND,
    OR,
    ExpressionError,
    LicenseSymbol,
    LicenseWithExceptionSymbol,
    get_spdx_licensing,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
POLICY = REPO_ROOT / "supply-chain" / "licence-policy.toml"
# Each lock file and the environment `make` builds from it.
LOCK_VENVS = {
    "requirements.lock": ".venv",
    "requirements-vllm.lock": ".venv-vllm",
    "requirements-vllm-gpu.lock": ".venv-vllm-gpu",
}
NONE_DECLARED = "(none declared)"
# What old setuptools wrote in the License field when a project gave none.
_PLACEHOLDERS = {"", "UNKNOWN"}
_LICENSING = get_spdx_licensing()


def _parse(expression: str) -> object | None:
    """``expression`` parsed as SPDX ids (strictly: unknown ids are an error), or None."""
    try:
        parsed: object = _LICENSING.parse(expression, validate=True, strict=True)
    except ExpressionError:  # ExpressionParseError too
        return None
    return parsed


@dataclass(frozen=True)
class Policy:
    """supply-chain/licence-policy.toml."""

    allowed: frozenset[str]
    aliases: Mapping[str, str]
    exceptions: Mapping[str, Mapping[str, str]]

    @classmethod
    def load(cls, path: Path = POLICY) -> Policy:
        with path.open("rb") as f:
            data = tomllib.load(f)
        return cls(
            allowed=frozenset(data["allowed"]),
            aliases=dict(data.get("aliases", {})),
            exceptions=dict(data.get("exceptions", {})),
        )

    def spdx(self, name: str) -> str | None:
        """``name`` as an SPDX expression: its alias, else itself when it parses as one."""
        if name in self.aliases:
            return self.aliases[name]
        return name if _parse(name) is not None else None

    def allows(self, expression: str) -> bool:
        """Every term of an AND, one term of an OR; a licence WITH an exception by the licence."""
        parsed = _parse(expression)
        return parsed is not None and self._allows(parsed)

    def _allows(self, node: object) -> bool:
        if isinstance(node, LicenseWithExceptionSymbol):
            return self._allows(node.license_symbol)
        if isinstance(node, LicenseSymbol):
            return str(node.key) in self.allowed
        if isinstance(node, AND):
            return all(self._allows(arg) for arg in node.args)
        if isinstance(node, OR):
            return any(self._allows(arg) for arg in node.args)
        return False


def _field(md: metadata.PackageMetadata, name: str) -> str:
    """A metadata field's first value, stripped ('' when absent)."""
    values = md.get_all(name) or []
    return str(values[0]).strip() if values else ""


def declared(dist: metadata.Distribution, policy: Policy) -> list[str]:
    """The licence names ``dist``'s metadata declares, in the order they are read."""
    md = dist.metadata
    expression = _field(md, "License-Expression")
    if expression:
        return [expression]
    names = []
    lines = _field(md, "License").splitlines()
    first = lines[0].strip() if lines else ""
    # A one-line field is a name (judged, even when unknown); a licence's full text is read by
    # its first line only when that line is a name the policy knows.
    if first not in _PLACEHOLDERS and (len(lines) == 1 or policy.spdx(first) is not None):
        names.append(first)
    for classifier in md.get_all("Classifier") or []:
        parts = [part.strip() for part in classifier.split("::")]
        # "License :: OSI Approved" alone names no licence.
        if parts[0] == "License" and len(parts) > 1 and parts[-1] != "OSI Approved":
            names.append(parts[-1])
    return names


@dataclass
class Reading:
    """One locked package: its licence as declared and the policy's verdict."""

    lock: str
    name: str
    version: str
    licence: str
    verdict: str  # "allowed", "exception: REASON" or a violation starting "VIOLATION"

    @property
    def ok(self) -> bool:
        return not self.verdict.startswith("VIOLATION")


def judge(policy: Policy, name: str, names: list[str]) -> str:
    """The verdict on a package called ``name`` whose metadata declares ``names``."""
    licence = "; ".join(names) or NONE_DECLARED
    expressions = [policy.spdx(n) for n in names]
    if names and all(e is not None and policy.allows(e) for e in expressions):
        return "allowed"
    exception = policy.exceptions.get(name)
    if exception is None:
        return "VIOLATION: not compatible with Apache-2.0 and not in the policy's exceptions"
    if exception["licence"] != licence:
        return f"VIOLATION: the exception was written for {exception['licence']!r}: review it"
    return "exception: " + " ".join(exception["reason"].split())


def site_packages(venv: Path) -> Path:
    """The environment's own site-packages (a layered environment's base is not read)."""
    return release.purelib(venv / "bin" / "python")


def read_lock(policy: Policy, lock: Path, site: Path) -> list[Reading]:
    """Every package ``lock`` pins, as installed in ``site``."""
    installed = {
        release.normalize(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])
    }
    readings = []
    for name, pinned in sorted(release.lock_pins(lock).items()):
        dist = installed.get(name)
        if dist is None or dist.version != pinned:
            found = "not installed" if dist is None else f"{dist.version} installed"
            verdict = f"VIOLATION: pinned {pinned}, {found} in {site}: its licence is unread"
            readings.append(Reading(lock.name, name, pinned, "?", verdict))
            continue
        names = declared(dist, policy)
        readings.append(
            Reading(
                lock.name,
                name,
                pinned,
                "; ".join(names) or NONE_DECLARED,
                judge(policy, name, names),
            )
        )
    return readings


def stale_exceptions(policy: Policy, readings: Iterable[Reading]) -> list[str]:
    """Exceptions that name no locked package, or one the policy allows without them."""
    needed = {r.name for r in readings if r.verdict.startswith("exception")}
    return sorted(set(policy.exceptions) - needed)


@dataclass
class Report:
    readings: list[Reading] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)

    @property
    def violations(self) -> list[Reading]:
        return [r for r in self.readings if not r.ok]

    def lines(self) -> list[str]:
        out = [
            f"{r.lock:27} {r.name:40} {r.version:18} {r.licence[:50]:50} {r.verdict}"
            for r in self.readings
        ]
        out += [f"stale exception: {name} (no locked package needs it)" for name in self.stale]
        return out


def check(venvs: Mapping[str, Path], policy: Policy | None = None) -> Report:
    """The policy over every lock file whose environment is given (lock name -> venv)."""
    policy = policy or Policy.load()
    report = Report()
    for lock, venv in venvs.items():
        report.readings += read_lock(policy, REPO_ROOT / lock, site_packages(venv))
    if set(venvs) == set(LOCK_VENVS):  # an exception may serve a lock not read this time
        report.stale = stale_exceptions(policy, report.readings)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check the locked packages' licences.")
    parser.add_argument(
        "--venv",
        action="append",
        default=[],
        metavar="LOCK=DIR",
        help="the environment of a lock file (default: the repository's .venv* directories)",
    )
    args = parser.parse_args(argv)
    venvs = {lock: REPO_ROOT / venv for lock, venv in LOCK_VENVS.items()}
    venvs.update({k: Path(v) for k, v in (item.split("=", 1) for item in args.venv)})
    missing = [f"{lock}: {venv}" for lock, venv in venvs.items() if not venv.is_dir()]
    if missing:
        print(
            "licences.py: environments missing (make venv vllm-venv vllm-gpu-venv):",
            *missing,
            sep="\n  ",
            file=sys.stderr,
        )
        return 1
    report = check(venvs)
    print(*report.lines(), sep="\n")
    bad = len(report.violations) + len(report.stale)
    print(f"{len(report.readings)} locked packages, {bad} violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
