"""The Ape-X example through real daemons: actor processes and the learner around one table.

A short run (no solving): the actors' inserts fill a capped FIFO table past its capacity, the
learner samples by priority and writes priorities back; the table then holds exactly its
capacity, and its strengths are no longer only the actors' initial priorities.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from examples.apex.replay import ClusterReplayFactory
from examples.apex.run import RunConfig, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_short_ape_x_run_fills_the_table_and_learns_from_samples(make_cluster) -> None:
    cluster = await make_cluster(workers=2, slots=32)
    async with cluster.client() as client:
        await client.wait_ready()
        factory = ClusterReplayFactory(cluster.address, "apex")
        await asyncio.to_thread(factory.create, 400)
        # The rate limiter holds the actors to the learner: past min_size an actor steps only
        # while env_steps x 0.5 <= samples learned + 200 (the slack lets the table fill past
        # min_size first), so the run's 1,200 env steps need >= 400 samples (>= 12 learner
        # steps of 32) whatever the relative speeds.
        cfg = RunConfig(
            actors=2,
            max_env_steps=1200,
            min_size=200,
            eval_every=10**9,
            capacity=400,
            batch=32,
            replay_ratio=0.5,
            rate_limit_slack=200,
        )
        result = await asyncio.to_thread(run, cfg, factory)
        assert result.env_steps >= 1200
        assert result.learner_steps >= 10
        q = await client.quality(table="apex")
        assert q["count"] == 400  # FIFO removal held the capacity
        ids, strengths, payloads = await client.get(
            (await client.topk(400, table="apex"))[0], with_payloads=True, table="apex"
        )
        assert all(len(p) == 41 for p in payloads)  # packed transitions
        assert np.unique(strengths).size > 10
