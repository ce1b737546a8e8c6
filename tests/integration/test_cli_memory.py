"""The real ``neuroshard memory`` commands and a memory job, against ``neuroshard up``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.integration.cli_helpers import REPO, run_cli
from tests.memory_reference import ReferenceStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_load_get_reinforce_decay_stats_topk(up_cluster: tuple[str, Path], tmp_path: Path) -> None:
    address, _ = up_cluster
    at = ("--coordinator", address)
    rng = np.random.default_rng(11)
    ids = np.arange(1, 5_001, dtype=np.uint64) * 104_729
    strengths = rng.random(5_000, dtype=np.float32)
    np.savez(tmp_path / "mem.npz", ids=ids, strengths=strengths)
    hot = np.r_[rng.choice(ids, 2_000), np.uint64(3)]  # id 3 is not stored
    boosts = rng.random(len(hot), dtype=np.float32) * 0.3
    np.savez(tmp_path / "boosts.npz", ids=hot, boosts=boosts)
    ref = ReferenceStore()

    loaded = run_cli("memory", "load", str(tmp_path / "mem.npz"), "--batch", "1500", *at)
    ref.upsert(ids, strengths)
    got = run_cli("memory", "get", str(ids[0]), "3", *at)
    reinforced = run_cli("memory", *at, "reinforce", str(tmp_path / "boosts.npz"))
    ref.reinforce(hot, boosts)
    decayed = run_cli("memory", "decay", "0.05", *at)
    ref.decay(0.05)
    stats = run_cli("memory", "stats", "--json", *at)
    top = run_cli("memory", "topk", "5", "--json", *at)

    for done in (loaded, got, reinforced, decayed, stats, top):
        assert done.returncode == 0, done.stderr
    assert loaded.stdout.startswith(f"loaded 5000 memories from {tmp_path / 'mem.npz'}")
    assert got.stdout.splitlines() == [f"{ids[0]}\tfound\t{strengths[0]:.6f}", "3\tmissing\t-"]
    assert reinforced.stdout.startswith("reinforced 2000 of 2001 accesses")
    assert decayed.stdout.strip() == "decayed 5000 memories by 0.05"
    doc = json.loads(stats.stdout)
    rq = ref.quality()
    assert doc["memories"] == doc["quality"]["count"] == 5_000
    assert doc["quality"]["histogram"] == list(rq.histogram)
    assert doc["under_replicated_slots"] == 0 and doc["replication_factor"] == 2
    assert [w["name"] for w in doc["workers"]] == ["worker-0", "worker-1", "worker-2"]
    ref_ids, ref_s = ref.topk(5)
    assert json.loads(top.stdout) == {
        "k": 5,
        "topk": [
            {"id": i, "strength": s} for i, s in zip(ref_ids.tolist(), ref_s.tolist(), strict=True)
        ],
    }


def test_set_strengths_and_sample(up_cluster: tuple[str, Path], tmp_path: Path) -> None:
    address, _ = up_cluster
    at = ("--coordinator", address)
    ids = np.arange(1, 3_001, dtype=np.uint64) * 7_919 + 2**40  # apart from the test above's
    strengths = np.random.default_rng(12).random(3_000, dtype=np.float32)
    np.savez(tmp_path / "mem.npz", ids=ids, strengths=strengths)
    updated_ids = np.r_[ids[:500], np.uint64(5)]  # id 5 is not stored
    updated = np.linspace(0, 1, 501, dtype=np.float32)
    np.savez(tmp_path / "prio.npz", ids=updated_ids, strengths=updated)

    loaded = run_cli("memory", "load", str(tmp_path / "mem.npz"), *at)
    set_done = run_cli("memory", "set-strengths", str(tmp_path / "prio.npz"), *at)
    # The module's cluster holds other tests' memories too: the reference is its content.
    exported = run_cli("memory", "export", str(tmp_path / "all.npz"), *at)
    sampled = run_cli("memory", "sample", "50", "--alpha", "0.7", "--seed", "3", "--json", *at)
    refused = run_cli("memory", "sample", "5", "--table", "other", *at)
    bad_alpha = run_cli("memory", "sample", "5", "--alpha", "-1", *at)

    for done in (loaded, set_done, exported, sampled):
        assert done.returncode == 0, done.stderr
    assert set_done.stdout.strip() == "updated 500 of 501 ids (1 not stored, skipped)"
    with np.load(tmp_path / "all.npz") as f:
        ref = ReferenceStore()
        ref.upsert(f["ids"], f["strengths"])
    assert ref.get(ids[:500])[1].tobytes() == updated[:500].tobytes()
    doc = json.loads(sampled.stdout)
    want_ids, want_s, _, want_p = ref.sample(50, 0.7, 3)
    assert (doc["seed"], doc["size"]) == (3, len(ref.ids))
    assert [d["id"] for d in doc["draws"]] == want_ids.tolist()
    assert [d["strength"] for d in doc["draws"]] == want_s.tolist()
    assert [d["probability"] for d in doc["draws"]] == want_p.tolist()
    assert refused.returncode == 1 and "table 'other' does not exist" in refused.stderr
    assert bad_alpha.returncode == 2 and "--alpha: -1.0 must be finite and >= 0" in bad_alpha.stderr


def test_memory_job_follow_json(up_cluster: tuple[str, Path], tmp_path: Path) -> None:
    address, _ = up_cluster
    spec = yaml.safe_load((REPO / "configs/jobs/memory-zipf.yaml").read_text())
    spec.update(memories=50_000, iterations=5)
    spec["access"]["batch"] = 10_000
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(spec))

    done = run_cli(
        "submit", str(tmp_path / "small.yaml"), "--follow", "--json", "--coordinator", address
    )

    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert (doc["state"], doc["kind"], doc["error"]) == ("SUCCEEDED", "memory", None)
    r = doc["result"]
    assert r["iterations"] == 5 and r["memories"] == 50_000 and r["accesses"] == 50_000
    assert 0 < r["iteration_ms_p50"] <= r["iteration_ms_p99"]
    assert r["upserts_per_s"] > 0 and r["reinforces_per_s"] > 0 and r["load_s"] > 0
    assert r["topk_k"] == 100 and len(r["topk"]) == 10
    strengths = [t["strength"] for t in r["topk"]]
    assert strengths == sorted(strengths, reverse=True)
    assert r["quality"]["count"] >= 50_000 and len(r["quality"]["histogram"]) == 10
    assert r["convergence"] > 1 and r["iteration_ms_std"] >= 0


def test_bad_input_exits_2_with_one_line(up_cluster: tuple[str, Path], tmp_path: Path) -> None:
    address, _ = up_cluster
    np.savez(tmp_path / "bad.npz", ids=np.arange(3), strengths=np.array([0.5, np.nan, 0.2]))
    np.savez(tmp_path / "nob.npz", ids=np.arange(3))
    cases = [
        (("load", str(tmp_path / "bad.npz")), f"{tmp_path / 'bad.npz'}: strengths[1]: nan"),
        (
            ("reinforce", str(tmp_path / "nob.npz")),
            f"{tmp_path / 'nob.npz'}: no array 'boosts' (has: ids)",
        ),
        (("get", "-4"), "id: '-4' is not an unsigned 64-bit integer"),
        (("decay", "1.5"), "rate: 1.5 is outside [0, 1]"),  # refused by the coordinator
    ]
    for args, message in cases:
        done = run_cli("memory", *args, "--coordinator", address)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
        assert done.stdout == ""
