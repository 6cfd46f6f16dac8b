"""The dependency licence policy's rules (scripts/licences.py over supply-chain/licence-policy.toml)
on made-up packages: a GPL-only package in a lock fails, whatever else the lock holds. The real
locks are checked against their environments by tests/supply_chain (make supply-chain)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# scripts/ is not a package: its modules import each other by name, as when run as scripts.
sys.path.insert(0, str(REPO / "scripts"))
licences = importlib.import_module("licences")
POLICY = licences.Policy.load()


@pytest.mark.parametrize(
    ("expression", "allowed"),
    [
        ("Apache-2.0", True),
        ("MIT OR GPL-3.0-only", True),
        ("BSD-2-Clause AND Apache-2.0 WITH LLVM-exception", True),
        ("GPL-3.0-only", False),
        ("GPL-2.0-or-later", False),
        ("MIT AND GPL-3.0-only", False),
        ("LGPL-2.1-only", False),
        ("AGPL-3.0-only OR SSPL-1.0", False),
        ("not a licence", False),
    ],
)
def test_an_expression_is_allowed_by_every_and_and_one_or(expression: str, allowed: bool) -> None:
    assert POLICY.allows(expression) is allowed


def write_dist(site: Path, name: str, version: str, headers: list[str]) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.4", f"Name: {name}", f"Version: {version}", *headers]
    (info / "METADATA").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_a_gpl_only_package_in_a_lock_fails_and_the_others_pass(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    write_dist(site, "gpl-only", "1.0", ["License-Expression: GPL-3.0-only"])
    write_dist(site, "classified", "2.0", ["Classifier: License :: OSI Approved :: MIT License"])
    write_dist(site, "named", "3.0", ["License: Apache 2.0"])
    write_dist(
        site,
        "mixed",
        "4.0",
        [
            "License: MIT",
            "Classifier: License :: OSI Approved :: GNU General Public License v3 (GPLv3)",
        ],
    )
    write_dist(site, "silent", "5.0", [])
    lock = tmp_path / "test.lock"
    lock.write_text(
        "# a lock\ngpl-only==1.0\nclassified==2.0\nnamed==3.0\nmixed==4.0\nsilent==5.0\n"
        "absent==6.0\n",
        encoding="utf-8",
    )
    readings = {r.name: r for r in licences.read_lock(POLICY, lock, site)}
    assert set(readings) == {"gpl-only", "classified", "named", "mixed", "silent", "absent"}
    assert [n for n, r in sorted(readings.items()) if r.ok] == ["classified", "named"]
    assert readings["gpl-only"].licence == "GPL-3.0-only"
    assert "not compatible with Apache-2.0" in readings["gpl-only"].verdict
    # Every declaration counts: an allowed License field does not excuse a GPL classifier.
    assert "not compatible" in readings["mixed"].verdict
    assert readings["silent"].licence == licences.NONE_DECLARED
    assert "not installed" in readings["absent"].verdict


def test_an_exception_holds_only_for_the_licence_it_was_written_for(tmp_path: Path) -> None:
    policy = licences.Policy(
        allowed=POLICY.allowed,
        aliases=POLICY.aliases,
        exceptions={"tool": {"licence": "GPL-2.0-only", "reason": "a separate program"}},
    )
    assert policy.allows("GPL-2.0-only") is False
    assert licences.judge(policy, "tool", ["GPL-2.0-only"]) == "exception: a separate program"
    changed = licences.judge(policy, "tool", ["AGPL-3.0-only"])
    assert changed.startswith("VIOLATION") and "review it" in changed
    readings = [licences.Reading("x.lock", "other", "1", "MIT", "allowed")]
    assert licences.stale_exceptions(policy, readings) == ["tool"]


def test_every_exception_gives_its_licence_and_reason() -> None:
    assert POLICY.exceptions, "the policy lists no exceptions"
    for name, exception in POLICY.exceptions.items():
        assert set(exception) == {"licence", "reason"}, name
        assert len(exception["reason"].split()) >= 10, f"{name}: say why it is accepted"
    for alias, spdx in POLICY.aliases.items():
        assert POLICY.allows(spdx), f"alias {alias!r} names {spdx!r}, which is not allowed"
