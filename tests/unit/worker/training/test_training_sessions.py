"""``TrainingSessions.step``, one ComputeGradients call: the parameter handshake (need_params,
deltas, parameters that do not fit) and the rows the coordinator names, fetched where they
are not held. Real trainers on digits; the coordinator's FetchShard is a stand-in."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import numpy as np
import pytest

from coordinator.training.step_plan import shard_rows
from shared.config import TrainJobSpec
from shared.training.data import load_dataset, shard_bounds
from worker.training.shards import Shard, ShardRows, TrainData
from worker.training.training_sessions import BadParams, StepInput, TrainingSessions

FIELDS = {"kind": "train", "workers": 3, "batch_size": 32, "seed": 0, "model": "mlp"}
DIGITS = TrainJobSpec.model_validate(FIELDS)


class Fetcher:
    """The coordinator's FetchShard for digits, recording the shards asked for."""

    def __init__(self) -> None:
        self.ds = load_dataset(DIGITS.data, DIGITS.seed, DIGITS.test_fraction)
        self.fetched: list[Shard] = []

    async def fetch(self, job_id: str, shard: Shard) -> tuple[TrainData, ShardRows]:
        self.fetched.append(shard)
        n = len(self.ds.y_train)
        start, stop = shard_bounds(n, *shard)
        x, y = self.ds.x_train[start:stop].copy(), self.ds.y_train[start:stop].copy()
        data = TrainData(n, self.ds.input_shape, self.ds.num_classes)
        rows = ShardRows(start, stop, x, y)
        data.add(shard, rows)
        return data, rows


@pytest.fixture
def fetcher() -> Fetcher:
    return Fetcher()


@pytest.fixture
async def sessions(fetcher: Fetcher) -> AsyncIterator[TrainingSessions]:
    s = TrainingSessions(torch_threads=1, fetcher=fetcher)  # type: ignore[arg-type]
    yield s
    s.close()


def call(version: int, params: dict[str, np.ndarray] | None, **fields: object) -> StepInput:
    """A call of step (0, 0) on shard 1's rows of it."""
    rows = shard_rows(DIGITS, 1437, 0, 0)[1]
    base: dict[str, object] = {"params_delta": False, "base_version": 0, "rows": rows}
    return StepInput("j1", 0, 0, version, params, **(base | fields))  # type: ignore[arg-type]


async def started(sessions: TrainingSessions, spec: dict[str, object]) -> dict[str, np.ndarray]:
    """Start job j1 on shard 1 of 3; return its initial parameters and buffers."""
    await sessions.start("j1", json.dumps(FIELDS | spec), 1, 3)
    model = sessions.get("j1").model
    return {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}


async def test_parameters_of_another_version_are_asked_for(sessions: TrainingSessions) -> None:
    params = await started(sessions, {})

    unknown = await sessions.step(call(1, None))  # nothing held yet
    loaded = await sessions.step(call(1, params))
    held = await sessions.step(call(1, None))
    stale = await sessions.step(call(2, None))

    assert unknown is None and stale is None
    assert loaded is not None and held is not None
    assert loaded.samples == held.samples == 32 and held.loss_sum == loaded.loss_sum


async def test_a_piece_spanning_shards_fetches_the_ones_not_held(
    sessions: TrainingSessions, fetcher: Fetcher
) -> None:
    # Arrange: a file data set; this worker holds shard 1. A proportional piece of shards
    # 1 and 2 (its header's shard_index says 0: the piece spans shards).
    params = await started(sessions, {"data": {"path": "digits.npz"}})
    per_shard = shard_rows(DIGITS, 1437, 0, 0)
    rows = np.concatenate([per_shard[1], per_shard[2][:5]])

    # Act
    res = await sessions.step(call(1, params, rows=rows))

    # Assert: shard 2 was fetched, shard 0 never was.
    assert res is not None and res.samples == 37
    assert fetcher.fetched == [(1, 3), (2, 3)]


async def test_a_delta_for_a_job_without_compression_is_refused(
    sessions: TrainingSessions,
) -> None:
    params = await started(sessions, {})

    with pytest.raises(BadParams, match="^params_delta: the job's spec has no compression$"):
        await sessions.step(call(1, params, params_delta=True))


async def test_parameters_that_are_not_the_models_are_refused(sessions: TrainingSessions) -> None:
    params = await started(sessions, {})
    first = next(iter(params))

    with pytest.raises(BadParams, match=f"^param: parameter '{first}': expected shape"):
        await sessions.step(call(1, params | {first: np.zeros((1, 1), np.float32)}))
    assert sessions.get("j1").params_version is None


async def test_a_delta_on_a_base_not_held_asks_for_the_parameters_in_full(
    sessions: TrainingSessions,
) -> None:
    params = await started(sessions, {"compression": {"name": "int8"}})

    res = await sessions.step(call(1, params, params_delta=True, base_version=0))

    assert res is None
