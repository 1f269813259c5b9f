"""The built wheel installs `fusedpar.kernels` (and no top-level `kernels`)."""

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # found, not imported: importing setuptools into a process that already imported the
    # stdlib's distutils (another test did, on this worker) trips setuptools' own check
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("building the wheel offline needs setuptools")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (path,) = out.glob("fusedpar-*.whl")
    return path


def test_wheel_holds_kernels_under_fusedpar(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "fusedpar/kernels/matmul.py" in names
    assert "fusedpar/kernels/__init__.py" in names
    assert not [n for n in names if n.startswith("kernels/")]


def test_wheel_imports_from_a_clean_directory(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--quiet",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    code = (
        "import importlib.util, fusedpar, fusedpar.kernels.matmul as m; "
        f"assert fusedpar.__file__.startswith({str(target)!r}), fusedpar.__file__; "
        "assert m.__file__.startswith(fusedpar.__path__[0]); "
        "spec = importlib.util.find_spec('kernels'); "
        "assert spec is None or 'fusedpar' not in str(spec.origin), spec; print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_no_top_level_kernels_import():
    pattern = re.compile(r"^\s*(from\s+kernels[\s.]|import\s+kernels\b)", re.M)
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("fusedpar", "kernels", "tests", "bench", "examples")
        for p in (ROOT / folder).rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert not offenders, f"import fusedpar.kernels, never a top-level kernels: {offenders}"
