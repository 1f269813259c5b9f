"""The worked examples in docs/ are tests themselves."""

import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_example(doc: str, module_name: str, tmp_path, monkeypatch):
    """Import the first ```python block of `doc` as a module the ranks can import too."""
    code = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)[0]
    (tmp_path / f"{module_name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))  # World.run hands sys.path to the ranks
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    return importlib.import_module(module_name)


def test_testing_guide_example(tmp_path, monkeypatch):
    example = _load_example("docs/testing.md", "testing_guide_example", tmp_path, monkeypatch)
    example.test_tensor_parallel_mlp_matches_dense()
