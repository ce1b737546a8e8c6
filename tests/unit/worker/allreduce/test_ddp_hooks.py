"""torch's DDP communication hooks for an allreduce job's compression (worker.allreduce.ddp_hooks).

A world of one gloo rank (a FileStore in a temporary directory, no network): enough for DDP
to run its reducer, so each hook really runs on every backward pass.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from shared.config import TrainJobSpec
from shared.training.data import load_dataset
from worker.allreduce.ddp_hooks import (
    POWERSGD_START_ITER,
    CompressionNotSupported,
    check_allreduce_compression,
    register_compression_hook,
)
from worker.allreduce.ddp_replica import Replica


@pytest.fixture
def gloo_world_of_one(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g)


def _ddp(model: nn.Module) -> DistributedDataParallel:
    return DistributedDataParallel(model, gradient_as_bucket_view=True)  # as ddp_replica


def _losses(ddp: nn.Module, steps: int) -> list[float]:
    x, y = _batch()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        out.append(float(loss.detach()))
    return out


@pytest.mark.usefixtures("gloo_world_of_one")
def test_fp16_hook_sends_the_gradients_rounded_to_float16() -> None:
    # Arrange: the same model twice, one wrapped with the fp16 hook.
    plain, hooked = _model(), _model()
    ddp = _ddp(hooked)
    # Act
    state = register_compression_hook(ddp, "fp16", 0.01, 2, "gloo")
    x, y = _batch()
    nn.functional.cross_entropy(plain(x), y).backward()  # type: ignore[no-untyped-call]
    nn.functional.cross_entropy(ddp(x), y).backward()  # type: ignore[no-untyped-call]
    # Assert: torch's own hook is registered, and a world of one gets fp16(g) / 1 back.
    assert state is None
    assert [h for h, _ in ddp._comm_hooks] == [default_hooks.fp16_compress_hook]
    for p, q in zip(plain.parameters(), hooked.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(q.grad, p.grad.half().float())
        assert not torch.equal(q.grad, p.grad)  # the rounding is visible: the hook ran


@pytest.mark.usefixtures("gloo_world_of_one")
def test_powersgd_hook_compresses_from_step_two_with_error_feedback_and_trains() -> None:
    ddp = _ddp(_model())
    state = register_compression_hook(ddp, "powersgd", 0.01, 2, "gloo")
    assert isinstance(state, powerSGD_hook.PowerSGDState)
    assert state.matrix_approximation_rank == 2 and state.use_error_feedback
    assert state.start_powerSGD_iter == POWERSGD_START_ITER == 2
    exact = _losses(_ddp(_model()), 30)
    losses = _losses(ddp, 30)
    # Steps 0 and 1 all-reduce uncompressed (the losses before steps 0-2 agree), step 2 on
    # is compressed: residuals (error feedback) and warm-start factors exist per bucket.
    assert losses[:3] == pytest.approx(exact[:3], rel=1e-6)
    assert abs(losses[3] - exact[3]) > 1e-3
    assert state.iter >= 30 and state.error_dict and state.p_memory_dict
    # Rank-2 gradients with error feedback still train (measured 2.31 -> 0.90; exact: 0.57).
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.usefixtures("gloo_world_of_one")
def test_none_registers_nothing_and_a_second_hook_is_refused_by_torch() -> None:
    ddp = _ddp(_model())
    assert register_compression_hook(ddp, "none", 0.01, 2, "gloo") is None
    assert ddp._comm_hooks == []
    register_compression_hook(ddp, "fp16", 0.01, 2, "gloo")
    with pytest.raises(RuntimeError):
        register_compression_hook(ddp, "powersgd", 0.01, 2, "gloo")


@pytest.mark.parametrize(
    ("name", "rank", "backend", "message"),
    [
        ("bf16", 2, "gloo", "bf16 needs the nccl backend"),
        ("int8", 2, "gloo", "'int8' is not available with strategy allreduce"),
        ("topk", 2, "nccl", "'topk' is not available"),
        ("zip", 2, "gloo", "'zip' is not available"),
        ("powersgd", 0, "gloo", "rank must be >= 1"),
    ],
)
def test_what_the_allreduce_strategy_cannot_run_is_refused(
    name: str, rank: int, backend: str, message: str
) -> None:
    with pytest.raises(CompressionNotSupported, match=message):
        check_allreduce_compression(name, rank, backend)


def test_bf16_is_accepted_on_nccl() -> None:
    check_allreduce_compression("bf16", 2, "nccl")  # no GPU needed to check the rule


@pytest.mark.usefixtures("gloo_world_of_one")
def test_powersgd_start_step_under_two_is_refused_by_torch() -> None:
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        register_compression_hook(_ddp(_model()), "powersgd", 0.01, 2, "gloo", start_iter=1)


@pytest.mark.usefixtures("gloo_world_of_one")
def test_the_replica_registers_the_specs_hook_when_the_spec_has_one() -> None:
    # Arrange: a replica whose spec carries a compression (the field TrainJobSpec gains in
    # issue 11; set here by hand so the test holds before and after it lands).
    spec = TrainJobSpec(kind="train", strategy="allreduce", steps=2, batch_size=16)
    ds = load_dataset(spec.data, spec.seed, spec.test_fraction)
    replica = Replica(spec, ds.x_train, ds.y_train, ds.num_classes, torch.device("cpu"))
    replica.spec = copy.copy(spec)
    object.__setattr__(
        replica.spec, "compression", SimpleNamespace(name="fp16", ratio=0.01, rank=2)
    )
    # Act: a "world of 2" makes wrap build DDP (over this group of one rank).
    ddp = replica.wrap(2)
    replica.train_step(ddp, 0, 1)
    # Assert
    assert isinstance(ddp, DistributedDataParallel)
    assert [h for h, _ in ddp._comm_hooks] == [default_hooks.fp16_compress_hook]
    assert replica.step == 1
