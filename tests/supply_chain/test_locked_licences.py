"""Every package the three lock files pin has a licence compatible with Apache-2.0, read from the
installed metadata of the environment make builds from that lock, or an exception with its reason
in supply-chain/licence-policy.toml.

`make supply-chain` runs this after building the environments (.venv, .venv-vllm,
.venv-vllm-gpu); MERIDIAN_VENV, MERIDIAN_VLLM_VENV and MERIDIAN_VLLM_GPU_VENV name others.
Run without it (MERIDIAN_SUPPLY_CHAIN unset), the module is skipped and says so.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
licences = importlib.import_module("licences")
release = importlib.import_module("release")

ENV_VARS = {
    "requirements.lock": "MERIDIAN_VENV",
    "requirements-vllm.lock": "MERIDIAN_VLLM_VENV",
    "requirements-vllm-gpu.lock": "MERIDIAN_VLLM_GPU_VENV",
}

pytestmark = pytest.mark.skipif(
    not os.environ.get("MERIDIAN_SUPPLY_CHAIN"),
    reason="the locked packages' licences are checked by `make supply-chain`, which builds the "
    "environments first",
)


def test_every_locked_package_has_a_licence_the_policy_allows() -> None:
    assert set(ENV_VARS) == set(licences.LOCK_VENVS)
    venvs = {
        lock: Path(os.environ.get(var) or REPO / licences.LOCK_VENVS[lock])
        for lock, var in ENV_VARS.items()
    }
    missing = [f"{lock}: {venv}" for lock, venv in venvs.items() if not venv.is_dir()]
    assert not missing, f"environments missing (make venv vllm-venv vllm-gpu-venv): {missing}"
    report = licences.check(venvs)
    print("\n" + "\n".join(report.lines()))
    pinned = sum(len(release.lock_pins(REPO / lock)) for lock in venvs)
    assert len(report.readings) == pinned  # every locked package was read
    violations = [
        f"{r.lock}: {r.name} {r.version}: {r.licence}: {r.verdict}" for r in report.violations
    ]
    assert not violations, "\n".join(violations)
    assert not report.stale, f"exceptions no locked package needs: {report.stale}"
