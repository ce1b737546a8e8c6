"""Gradient averaging, the ParameterServer, and sync training == single-process training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.training.aggregation import weighted_average
from coordinator.training.checkpoints import save_model
from coordinator.training.parameter_server import ParameterServer
from coordinator.training.step_plan import shard_rows
from shared.config import TrainJobSpec
from shared.training.data import Dataset, load_dataset, steps_per_epoch
from tests.training_reference import train_single_process
from worker.training.trainer import Trainer


def make_spec(**overrides: object) -> TrainJobSpec:
    fields = {"kind": "train", "workers": 3, "batch_size": 32, "seed": 0}
    return TrainJobSpec.model_validate(fields | overrides)


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset(make_spec().data, seed=0, test_fraction=0.2)


def run_sync(spec: TrainJobSpec, dataset: Dataset, steps: int) -> ParameterServer:
    """Drive spec.workers Trainers and a ParameterServer in-process, like the daemons will."""
    trainers = [Trainer(spec, i, spec.workers) for i in range(spec.workers)]
    ps = ParameterServer(spec, dataset)
    per_epoch = steps_per_epoch(len(dataset.y_train), spec.workers, spec.batch_size)
    for g in range(steps):
        epoch, step = divmod(g, per_epoch)
        params = ps.params()
        pieces = shard_rows(spec, len(dataset.y_train), epoch, step)
        results = []
        for t in trainers:
            t.set_params(params, ps.version)
            results.append(t.compute_rows(pieces[t.shard_index]))
        ps.step(weighted_average([r.grads for r in results], [r.samples for r in results]))
    return ps


def test_weighted_average_weights_by_samples() -> None:
    grads = [{"w": np.array([1.0, 2.0], np.float32)}, {"w": np.array([4.0, 8.0], np.float32)}]

    avg = weighted_average(grads, [1, 3])

    assert avg["w"].dtype == np.float32
    np.testing.assert_allclose(avg["w"], [3.25, 6.5])


def test_weighted_average_ignores_empty_workers() -> None:
    grads = [{"w": np.ones(3, np.float32)}, {"w": np.zeros(3, np.float32)}]

    np.testing.assert_array_equal(weighted_average(grads, [5, 0])["w"], np.ones(3))


def _float64_loop(grads: list[dict[str, np.ndarray]], samples: list[int]) -> np.ndarray:
    """The reference: acc = 0; acc += (n / N) * float64(g) per worker in order; float32."""
    acc = np.zeros(np.shape(grads[0]["w"]), np.float64)
    for g, n in zip(grads, samples, strict=True):
        if n:
            acc += (n / sum(samples)) * np.asarray(g["w"], np.float64)
    return acc.astype(np.float32)


@pytest.mark.parametrize("samples", [[48, 48], [10, 0, 86], [1, 2, 3], [7]])
@pytest.mark.parametrize("shape", [(), (5,), (33, 17)])
def test_weighted_average_is_bit_identical_to_the_float64_loop(
    samples: list[int], shape: tuple[int, ...]
) -> None:
    rng = np.random.default_rng(len(samples))
    grads = [{"w": rng.standard_normal(shape).astype(np.float32)} for _ in samples]
    specials = np.array([-0.0, np.nan, np.inf, -np.inf, 1e-45, 3e38], np.float32)
    flat = grads[0]["w"].reshape(-1)
    flat[: len(specials)] = specials[: flat.size]

    got = weighted_average(grads, samples)["w"]  # float32: the compiled pass

    assert got.dtype == np.float32 and got.shape == shape
    assert got.tobytes() == _float64_loop(grads, samples).tobytes()


def test_weighted_average_of_other_dtypes_takes_the_numpy_path() -> None:
    grads = [{"w": np.arange(6.0).reshape(2, 3)}, {"w": np.ones((3, 2), np.float32).T}]

    got = weighted_average(grads, [1, 2])["w"]  # float64, and a non-contiguous view

    assert got.tobytes() == _float64_loop(grads, [1, 2]).tobytes()


@pytest.mark.parametrize(
    ("grads", "samples", "message"),
    [
        ([{"w": np.ones(2)}] * 2, [0, 0], "every worker reported 0 samples"),
        ([{"w": np.ones(2)}, {"v": np.ones(2)}], [1, 1], r"missing \['w'\]"),
        ([{"w": np.ones(2)}, {"w": np.ones(3)}], [1, 1], "'w': expected shape"),
        ([{"w": np.ones(2)}], [1, 1], "1 gradient sets but 2 sample counts"),
        ([{"w": np.ones(2)}], [-1], "must be >= 0"),
    ],
)
def test_weighted_average_rejects_bad_input(grads: list, samples: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        weighted_average(grads, samples)


@pytest.mark.parametrize(
    ("optimizer", "workers"),
    # 3 workers: equal shards of 479 rows. 4 workers: shards of 360/359/359/359 rows, so the
    # short last batches differ in size and only a sample-weighted average stays exact.
    [("sgd", 3), ("adam", 3), ("sgd", 4)],
)
def test_sync_training_equals_single_process_on_the_global_batch(
    digits: Dataset, optimizer: str, workers: int
) -> None:
    """THE equivalence: N shards + parameter server == one process on the concatenated batch."""
    lr = 0.05 if optimizer == "sgd" else 3e-3
    spec = make_spec(workers=workers, optimizer={"name": optimizer, "lr": lr})
    steps = 20  # crosses an epoch boundary (15 or 12 steps per epoch) and short last batches
    model = train_single_process(spec, digits, steps)

    ps = run_sync(spec, digits, steps)

    assert ps.version == steps
    params = ps.params()
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            torch.from_numpy(params[name]), p.detach(), rtol=1e-5, atol=1e-5, msg=name
        )


def test_mlp_on_digits_with_3_shards_reaches_95_percent(digits: Dataset) -> None:
    spec = make_spec(epochs=15, optimizer={"name": "adam", "lr": 3e-3})
    steps = 15 * steps_per_epoch(len(digits.y_train), 3, 32)

    ps = run_sync(spec, digits, steps)

    metrics = ps.evaluate()
    loss, accuracy = metrics["test_loss"], metrics["test_accuracy"]
    assert accuracy >= 0.95 and loss < 0.2


def test_params_are_float32_copies(digits: Dataset) -> None:
    ps = ParameterServer(make_spec(), digits)
    params = ps.params()

    next(iter(params.values()))[...] = 99.0

    assert all(a.dtype == np.float32 for a in params.values())
    assert not any(torch.any(p == 99.0) for p in ps.model.parameters())
    assert ps.param_count == sum(a.size for a in params.values())


def test_step_rejects_mismatched_grads(digits: Dataset) -> None:
    ps = ParameterServer(make_spec(), digits)

    with pytest.raises(ValueError, match="parameter names differ"):
        ps.step({"nope": np.zeros(3, np.float32)})
    assert ps.version == 0


def test_evaluate_returns_loss_and_accuracy(digits: Dataset) -> None:
    ps = ParameterServer(make_spec(), digits)

    metrics = ps.evaluate()
    loss, accuracy = metrics["test_loss"], metrics["test_accuracy"]

    assert loss == pytest.approx(np.log(10), rel=0.1) and 0.0 <= accuracy <= 0.3
    assert ps.model.training


def test_state_round_trip_resumes_identically(digits: Dataset) -> None:
    spec = make_spec(optimizer={"name": "adam", "lr": 1e-2})
    a = run_sync(spec, digits, steps=3)
    b = ParameterServer(spec, digits)
    grads = {n: np.full(s.shape, 0.1, np.float32) for n, s in a.params().items()}

    b.load_state(a.state())
    a.step(grads)
    b.step(grads)

    assert b.version == a.version == 4
    for name, value in a.params().items():
        np.testing.assert_array_equal(b.params()[name], value)


def test_load_state_rejects_garbage(digits: Dataset) -> None:
    with pytest.raises(ValueError, match="not a checkpoint"):
        ParameterServer(make_spec(), digits).load_state(b"garbage")


def test_save_writes_a_loadable_state_dict(digits: Dataset, tmp_path: Path) -> None:
    ps = ParameterServer(make_spec(), digits)

    save_model(ps.model, tmp_path / "model.pt")

    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == set(ps.params())
