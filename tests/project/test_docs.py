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
