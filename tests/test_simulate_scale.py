"""scripts/simulate_scale.py (issue: scale) runs AdaCheck's real planner and exchange encoding on
a synthetic Megatron layout and reports what a save costs each rank.

Oracles that the simulation did not compute: GPT-3 175B's parameter count from its published
shape (175B, each stored as bf16 weight + fp32 main weight + two fp32 moments = 14 bytes), so
the planner must store every distinct box exactly once (no replica twice, nothing lost); the
ring's N-1 steps; the JSON fields the issue names."""
import json
import os
import subprocess
import sys

import pytest

from launch import ROOT

pytestmark = pytest.mark.timeout(300)

FIELDS = ("model", "ranks", "plan_seconds_per_rank", "exchange_bytes_per_rank", "exchange_rounds",
          "manifest_bytes_read_per_rank", "max_over_mean_bytes_written", "stored_over_unique")


def test_simulation_reports_the_fields_and_stores_each_box_once(tmp_path):
    out = tmp_path / "sim.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "simulate_scale.py"), "--model", "gpt3-175b",
                        "--ranks", "1024", "2048", "--sample-stages", "0", "15", "--json", str(out)],
                       capture_output=True, text=True, timeout=240, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(k in row for k in FIELDS for row in rows), rows
    row = rows[0]
    # the top-level fields are the default exchange's at these sizes (partitioned from 32 ranks on)
    assert row["model"] == "gpt3-175b" and row["ranks"] == 1024 and row["exchange"] == "partitioned"
    assert row["exchange_rounds"] == 2 and row["ring"]["exchange_rounds"] == 1024
    assert row["layout"] == {"tp": 8, "pp": 16, "dp": 8, "ep": 1}
    # 96 layers of 12 h^2 + 13 h; word (vocab padded to 51200) and position (2048) embeddings,
    # the untied output layer and the final LayerNorm
    h = 12288
    params = 96 * (12 * h * h + 13 * h) + 2 * 51200 * h + 2048 * h + 2 * h
    assert abs(params / 175e9 - 1) < 0.01
    assert row["unique_bytes"] == params * 14
    assert row["stored_over_unique"] == 1.0       # each distinct box once (replicas deduplicated)
    assert 1.0 <= row["max_over_mean_bytes_written"] < 2.0 and 1.0 <= row["ring"]["max_over_mean_bytes_written"] < 2.0
    assert isinstance(row["plan_seconds_per_rank"], float) and row["exchange_bytes_per_rank"] > 0
    # what a rank receives: the ring's hashes of the whole job grow with it, the partitioned
    # exchange's (its own tensors' holders) do not
    ring_in, part_in = [r["ring"]["exchange_bytes_per_rank"] for r in rows], [r["exchange_bytes_per_rank"] for r in rows]
    assert ring_in[1] > 1.8 * ring_in[0] and part_in[1] < 1.2 * part_in[0] and part_in[0] < ring_in[0] / 100, (
        ring_in, part_in)
    assert row["manifest_bytes_read_per_rank"] == row["partitioned"]["manifest_bytes_read_per_rank"] > 0
    # a load in the layout it saved: formats 5-6 (the root and the rank's own rank file) read the
    # same at twice the ranks; format 4 (every rank's tables in the root, whole tensor entries)
    # grows with the job
    now, before = [r["partitioned"]["manifest_bytes_read_per_rank"] for r in rows], \
        [r["partitioned"]["format4"]["manifest_bytes_read_per_rank"] for r in rows]
    assert 0 < now[0] < before[0] / 10 and abs(now[1] / now[0] - 1) < 0.05 and before[1] > 1.5 * before[0], (now, before)
    root = [r["partitioned"]["manifest_root_bytes"] for r in rows]
    assert abs(root[1] / root[0] - 1) < 0.01, root
    # a load in another layout: format 6 reads the pages of its regions, about as much at twice the
    # ranks; format 5 read whole tensor entries, every data-parallel rank's box, and grew with the job
    paged, whole = [r["partitioned"]["manifest_bytes_read_per_rank_other_layout"] for r in rows], \
        [r["partitioned"]["format5"]["manifest_bytes_read_per_rank_other_layout"] for r in rows]
    assert paged[1] <= 1.05 * paged[0] and whole[1] > 1.5 * whole[0] and paged[1] < whole[1] / 15, (paged, whole)
