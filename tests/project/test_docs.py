"""The worked examples in docs/ are tests themselves."""

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load_example(doc: str, module_name: str, tmp_path, monkeypatch):
    """Import the ```python blocks of `doc`, in order, as one module the ranks can import."""
    code = "\n".join(re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S))
    (tmp_path / f"{module_name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))  # World.run hands sys.path to the ranks
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    return importlib.import_module(module_name)


def test_testing_guide_example(tmp_path, monkeypatch):
    example = _load_example("docs/testing.md", "testing_guide_example", tmp_path, monkeypatch)
    example.test_tensor_parallel_mlp_matches_dense()


def test_testing_guide_float64_example(tmp_path, monkeypatch):
    """docs/testing.md's float64 block at TP2 x CP2 against its dense twin, to 16 ulps."""
    example = _load_example("docs/testing.md", "testing_guide_example", tmp_path, monkeypatch)
    example.test_float64_block_matches_its_dense_twin()


def test_dropin_guide_example(tmp_path, monkeypatch):
    example = _load_example("docs/dropin.md", "dropin_guide_example", tmp_path, monkeypatch)
    example.test_converted_block_matches_the_dense_one()


def test_dropin_gpt2_example(tmp_path, monkeypatch):
    """docs/dropin.md's GPT-2 converted by hand: loss and every gradient at TP2 x CP2."""
    example = _load_example("docs/dropin.md", "dropin_guide_example", tmp_path, monkeypatch)
    example.test_gpt2_by_hand_matches_the_original()


def test_dropin_trainer_recipe(tmp_path, monkeypatch):
    """docs/dropin.md's Trainer recipe as written, one step in one process (dims=None);
    tests/hf/test_hf_trainer.py holds the Trainer to the manual loop on 4 ranks."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    example = _load_example("docs/dropin.md", "dropin_guide_example", tmp_path, monkeypatch)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    before = model.lm_head.weight.detach().clone()
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = example.train_with_the_trainer(model, None, data, str(tmp_path), max_steps=1)
    assert trainer.state.global_step == 1
    assert not torch.equal(model.lm_head.weight, before)


README_CHECK = """

def check_readme_block(seed):
    import torch

    dims = fp.ParallelDims(cp=2, tp=2)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(seed)
    model = nn.Sequential(*[Block(32, 4, 2, 64, dims.groups(mesh)) for _ in range(2)])
    fp.distribute(model, mesh)
    x = torch.randn(16 // 4, 2, 32, requires_grad=True)  # (S / CP / TP, B, d), S = 16
    y = model(x)
    y.sum().backward()
    grads = [p.grad is not None for p in model.parameters()]
    return y.shape == x.shape and x.grad is not None and all(grads) and len(grads) > 0
"""


def test_readme_example(tmp_path, monkeypatch):
    """README.md's block as written, small (d 32, 4 heads, S 16), at TP2 x CP2 on 4
    ranks: the model distributes, runs forward and backward, and every parameter has a
    gradient. (The README's own sizes and mesh are a Llama-3 8B on GPUs.)"""
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    (tmp_path / "readme_example.py").write_text(code[: code.index("\ndims = ")] + README_CHECK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "readme_example", raising=False)
    example = importlib.import_module("readme_example")
    assert example.fp.testing.shared_world(4).run(example.check_readme_block, 0) == [True] * 4


# --- the README as a front door (#54): short, a map of the docs, every link alive -----

README_WORDS = 900
TABLE_ROW_CHARS = 160
FENCE = re.compile(r"^( *)```.*?^\1```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings (code blocks left out)."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", FENCE.sub("", path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def _broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown page whose file or heading does not exist."""
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{path.relative_to(ROOT)}: {target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{path.relative_to(ROOT)}: {target}: no such heading")
    return broken


def test_readme_is_short_and_maps_the_docs():
    """README.md reads in two minutes: at most 900 words, no table row over 160
    characters, and every page it links to exists (its headings too)."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert len(text.split()) <= README_WORDS, f"README.md: {len(text.split())} words"
    long_rows = [
        line for line in text.splitlines() if line.startswith("|") and len(line) > TABLE_ROW_CHARS
    ]
    assert not long_rows, f"table rows over {TABLE_ROW_CHARS} characters: {long_rows}"
    pages = [t for t in LINK.findall(FENCE.sub("", text)) if t.startswith("docs/")]
    assert len(pages) >= 12, pages  # the map of the docs
    assert not _broken_links(readme)


def test_links_between_the_docs_resolve():
    """Every relative link of README.md and docs/ (generated pages included) names a file
    that exists and, for a Markdown page, a heading it has."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert not [b for page in pages for b in _broken_links(page)]
