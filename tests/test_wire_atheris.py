"""Coverage-guided fuzzing of the MRDN v1 decoder with atheris (libFuzzer), bounded in runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TARGET = Path(__file__).parent / "fuzz" / "wire_target.py"


def test_decoder_survives_coverage_guided_fuzzing(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    result = subprocess.run(
        [sys.executable, str(TARGET), "-runs=30000", "-seed=1", "-max_len=256", str(corpus)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # libFuzzer writes crash-* reproducers into the working directory
    )
    # libFuzzer exits non-zero and prints the crashing input when the target raises anything
    # but a WireError (or a decoded frame does not re-encode to its input).
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Done 30000 runs" in result.stderr
