"""bench/linear_attention_cp.py on a CPU at a tiny shape: the CP op with its stand-in
exchange and the single-device op are both timed, and the result files are written with
the bytes of `fusedpar.plan.linear_context`."""

import json

import bench.linear_attention_cp as bench


def test_the_cp_benchmark_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    monkeypatch.setattr(bench, "CPU", {"span": 40, "Hk": 1, "Hv": 2, "K": 8, "V": 4})
    monkeypatch.setattr(bench, "WORLDS", (2, 4))
    bench.main()
    (found,) = tmp_path.rglob("linear_attention_cp.json")
    rows = json.loads(found.read_text())["rows"]
    assert [r["W"] for r in rows] == [2, 4]
    for row in rows:
        assert all(row[k] > 0 for k in ("single_fwd_bwd_ms", "cp_fwd_bwd_ms", "wire_ratio"))
        assert row["summaries_payload_mib"] < row["all_to_all_wire_mib"] / 50
