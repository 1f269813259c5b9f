"""`ruff check` and `ruff format --check` are part of the suite, so CI keeps the tree
clean; formatting is skipped only in `kernels/` (Triton kernels' grouped argument
lists)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff", reason="ruff comes with the [test] extra")
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    return subprocess.run([*cmd, *args, str(ROOT)], capture_output=True, text=True, cwd=ROOT)


def test_ruff_is_clean():
    proc = _ruff("check")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_owns_the_python():
    proc = _ruff("format", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    skipped = [
        f"{path.relative_to(ROOT)}:{i}"
        for folder in ("fusedpar", "bench", "examples", "tests")
        for path in (ROOT / folder).rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: " + "skip" in line
    ]
    assert not skipped, f"ruff format skipped outside kernels/: {skipped}"
