"""`ruff check` is part of the suite, so CI keeps the tree clean."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    pytest.importorskip("ruff", reason="ruff comes with the [test] extra")
    ruff = shutil.which("ruff") or [sys.executable, "-m", "ruff"]
    cmd = [ruff, "check", str(ROOT)] if isinstance(ruff, str) else [*ruff, "check", str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
