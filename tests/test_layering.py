"""The layering of ``src/meridian`` is checked, not hoped for (docs/architecture.md).

Imports only point down: ``cli → bench → sim → vllm → telemetry → core → config``. Every
``import``/``from`` of a ``meridian.*`` module anywhere in a file (lazy ones inside functions
included) must go to its own package or one below it; vLLM, torch and Ray are imported only by
the modules that drive them; and ``meridian.core`` imports with those libraries blocked.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "meridian"

# Each package and the meridian packages it may import (besides itself and meridian.errors).
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "core": {"config"},
    "telemetry": {"config", "core"},
    "vllm": {"config", "core", "telemetry"},
    "ray": {"config", "core", "telemetry", "vllm"},
    "sim": {"config", "core", "telemetry", "vllm"},
    "bench": {"config", "core", "telemetry", "vllm", "sim"},
    "cli": {"config", "core", "telemetry", "vllm", "ray", "sim", "bench"},
}
HEAVY = {"torch", "vllm", "ray", "transformers"}
# The modules that may import those libraries: the vLLM integration, the simulator's vLLM
# driver, the Ray Serve driver, and the benchmark harnesses that run against a live vLLM.
HEAVY_ALLOWED = ("meridian.vllm.", "meridian.ray.", "meridian.sim.vllm_engine", "meridian.bench.")


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (absolute names), with the line."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def test_imports_only_point_down() -> None:
    wrong: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module(path)
        parts = module.split(".")
        package = parts[1] if len(parts) > 2 else None  # None: meridian/__init__, errors, ...
        for line, name in _imports(path):
            where = f"{path.relative_to(SRC.parent)}:{line}"
            top = name.split(".")[0]
            if top in HEAVY and not module.startswith(HEAVY_ALLOWED):
                wrong.append(f"{where}: {module} imports {name}")
            if top != "meridian" or name in ("meridian", "meridian.errors") or package is None:
                continue
            target = name.split(".")[1]
            if target != package and target not in ALLOWED[package]:
                wrong.append(f"{where}: {package} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_every_package_is_placed() -> None:
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(ALLOWED), f"not in a layer: {sorted(packages - set(ALLOWED))}"


def test_core_runs_without_torch_vllm_and_ray() -> None:
    modules = sorted(_module(p) for p in (SRC / "core").glob("*.py"))
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {sorted(HEAVY)!r}:\n"
        "            raise ImportError(f'{name} is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for name in {modules!r}:\n"
        "    __import__(name)\n"
        "print(len(sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
