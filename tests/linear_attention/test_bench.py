"""bench/linear_attention.py on a CPU at a tiny shape: every peer that runs here
(fusedpar, Hugging Face's fallback; the op and the layer) is timed, their outputs agree,
and the result files are written."""

import json

import torch

import bench.linear_attention as bench


def test_the_benchmark_runs_and_its_peers_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    monkeypatch.setattr(bench, "HK", 1)
    monkeypatch.setattr(bench, "HV", 2)
    monkeypatch.setattr(bench, "HEAD_DIM", 8)
    monkeypatch.setattr(bench, "CPU_TOKENS", (70,))
    monkeypatch.setattr(bench, "LAYER_WIDTH", {"cpu": (20, 1, 2)})
    monkeypatch.setattr(bench, "LAYER_CPU_TOKENS", (37,))
    inputs = bench.make_inputs(70, "cpu", torch.float32)
    with torch.no_grad():
        ours, theirs = (bench.peer_function(name)(*inputs) for name in ("fusedpar", "hf"))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    x = torch.randn(1, 37, 20, requires_grad=True)
    with torch.no_grad():  # the layer (S, B, d) against HF's module (B, S, d)
        peers = bench.layer_peers(bench.hf_layer("cpu", torch.float32), x)
        ours, theirs = (peers[name][0]() for name in ("fusedpar", "hf"))
    torch.testing.assert_close(ours.transpose(0, 1), theirs, rtol=1e-4, atol=1e-4)
    bench.main()
    (found,) = tmp_path.rglob("linear_attention.json")
    rows = json.loads(found.read_text())["rows"]
    assert [(r["what"], r["T"]) for r in rows] == [("op", 70), ("layer", 37)]
    for row in rows:
        assert row["notes"] == "", row["notes"]
        # (the backward is a difference of two timings: on a loaded CPU it may come out <= 0)
        assert all(row[f"{p}_fwd_ms"] > 0 for p in ("fusedpar", "hf"))
        assert all(row[f"{p}_bwd_ms"] is not None for p in ("fusedpar", "hf"))
