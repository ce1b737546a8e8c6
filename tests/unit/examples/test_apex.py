"""The Ape-X example's pieces: n-step transitions, packing, importance weights, local replay."""

from __future__ import annotations

import numpy as np
import pytest

from examples.apex.dqn import (
    TRANSITION,
    Learner,
    LearnerConfig,
    NStep,
    actor_epsilon,
    importance_weights,
    pack,
    unpack,
)
from examples.apex.replay import LocalReplay


def obs(k: float) -> np.ndarray:
    return np.full(4, k, np.float32)


def test_n_step_returns_discount_and_flush_at_episode_end() -> None:
    ns = NStep(3, 0.5)
    assert ns.add(obs(0), 0, 1.0, obs(1), False, False) == []
    assert ns.add(obs(1), 1, 2.0, obs(2), False, False) == []
    (t,) = ns.add(obs(2), 0, 4.0, obs(3), False, False)
    assert t[1:3] == (0, 1.0 + 0.5 * 2.0 + 0.25 * 4.0) and t[4] == 0.125
    np.testing.assert_array_equal(t[3], obs(3))
    # termination: the two pending steps flush with discount 0 (no bootstrap)
    out = ns.add(obs(3), 1, 8.0, obs(4), True, False)
    assert [round(x[2], 6) for x in out] == [2.0 + 0.5 * 4.0 + 0.25 * 8.0, 4.0 + 0.5 * 8.0, 8.0]
    assert [x[4] for x in out] == [0.0, 0.0, 0.0]


def test_truncation_bootstraps_with_the_remaining_discount() -> None:
    ns = NStep(3, 0.5)
    ns.add(obs(0), 0, 1.0, obs(1), False, False)
    out = ns.add(obs(1), 1, 1.0, obs(2), False, True)
    assert [x[4] for x in out] == [0.25, 0.5]


def test_pack_and_unpack_round_trip_41_byte_records() -> None:
    recs = np.array([(obs(1), 1, 0.5, obs(2), 0.9), (obs(3), 0, -1.0, obs(4), 0.0)], TRANSITION)
    payloads = pack(recs)
    assert [len(p) for p in payloads] == [41, 41]
    back = unpack(payloads)
    assert back.tobytes() == recs.tobytes()
    with pytest.raises(ValueError, match="41 bytes"):
        unpack([b"short"])


def test_importance_weights_are_normalised_by_their_max() -> None:
    w = importance_weights(np.array([0.5, 0.25, 0.25]), 3, 1.0)
    np.testing.assert_allclose(w, [2 / 3 / (4 / 3), 1.0, 1.0])  # (N P)^-1 / max
    assert importance_weights(np.array([0.1, 0.9]), 2, 0.0).tolist() == [1.0, 1.0]


def test_actor_epsilons_follow_ape_x() -> None:
    assert actor_epsilon(0, 1) == 0.4
    assert actor_epsilon(0, 8) == pytest.approx(0.4)
    assert actor_epsilon(7, 8) == pytest.approx(0.4**8)


def test_local_replay_removes_the_oldest_when_full_and_samples_by_priority() -> None:
    r = LocalReplay(3)
    r.insert(np.arange(4, dtype=np.uint64), np.array([1, 0.5, 0.5, 0.0], np.float32), [b"a"] * 4)
    assert r.size() == 3
    r.update(np.array([0, 3], np.uint64), np.array([1.0, 1.0], np.float32))  # 0 is gone: skipped
    drawn = r.sample(2000, 1.0, seed=0)
    assert 0 not in drawn.ids.tolist()
    share = np.mean(drawn.ids == 3)
    assert 0.4 < share < 0.6  # priorities 0.5, 0.5, 1.0


def test_a_learner_step_lowers_the_td_error_of_its_batch() -> None:
    rng = np.random.default_rng(0)
    recs = np.zeros(64, TRANSITION)
    recs["obs"] = rng.normal(size=(64, 4))
    recs["next_obs"] = rng.normal(size=(64, 4))
    recs["action"] = rng.integers(0, 2, 64)
    recs["ret"] = 1.0
    learner = Learner(LearnerConfig(lr=1e-2, target_every=10**9), seed=0)
    before = learner.td_errors(recs).mean()
    for _ in range(20):
        learner.step(recs, np.ones(64, np.float32))
    assert learner.td_errors(recs).mean() < before
