"""One rank's replica of an ``allreduce`` job: model, optimizer, schedule, scaler and data.

Lives in the job's child process (``worker.allreduce.allreduce_child``); a generation wraps the
model in ``DistributedDataParallel`` and calls :meth:`Replica.train_step` once per optimizer step.

Each step the ranks train on their parts of the step's global batch
(``shared.training.partition``). A rank's loss is ``sum(per-sample losses of its rows) x W / G'``
(the task's loss, ``shared.training.tasks``)
(W ranks, G' rows in the step), so DDP's average over ranks is the gradient of the mean loss
over the whole global batch, even when the ranks hold different numbers of rows: the step
equals single-process training on the global batch (Goyal et al. 2017, section 2).
Micro-batches (``grad_accum_steps``) skip DDP's all-reduce until the last one (``no_sync``).

With ``sampling: prioritized`` the coordinator sends each generation the drawn rows of its
window of steps and their importance weights (``set_window``): a step's global batch is the
window's next G' rows, and a rank's loss is ``sum(w_i l_i) x W / G'`` over its rows, so the
step is single-process training on mean_i(w_i l_i) over the drawn batch; the unweighted l_i
are kept (``take_losses``) for the coordinator to set the rows' priorities.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shared.config import TrainJobSpec
from shared.training.activation_checkpointing import checkpoint_blocks
from shared.training.controls import (
    UNLOADABLE,
    autocast,
    current_lr,
    make_grad_scaler,
    make_lr_scheduler,
    make_optimizer,
)
from shared.training.models import build_model
from shared.training.packed_state import pack_state
from shared.training.partition import (
    allreduce_steps_per_epoch,
    allreduce_total_steps,
    epoch_permutation,
    global_batch_size,
    micro_batches,
    rank_rows,
    step_rows,
)
from shared.training.tasks import task_of
from worker.allreduce.ddp_hooks import register_compression_hook
from worker.allreduce.sync_batchnorm import convert_sync_batchnorm


class StateError(ValueError):
    """State bytes that are not a checkpoint of this job's replica."""


@dataclass
class StepStats:
    """What one rank's part of one step contributed: rows, per-sample losses summed, correct."""

    samples: int = 0
    loss_sum: float = 0.0
    correct: int = 0


class Replica:
    """The state one rank trains; identical on every rank after each step."""

    # Whether the state is split over the ranks: gathering it is then a collective that
    # every rank joins (``worker.allreduce.fsdp_replica``).
    sharded = False

    def __init__(
        self,
        spec: TrainJobSpec,
        x_train: npt.NDArray[Any],
        y_train: npt.NDArray[Any],
        num_classes: int,
        device: torch.device,
        allowed_models: Mapping[str, str] | None = None,
        daemon: str = "worker",
        allowed_losses: Mapping[str, str] | None = None,
    ) -> None:
        """Build the model (seeded, as on every rank), optimizer, lr schedule and scaler.

        Args:
            spec: the job (``device`` already resolved by the coordinator).
            x_train: [N, *input_shape] the whole training split's inputs (float32, or int64
                tokens).
            y_train: [N, ...] its targets, as the task defines them.
            num_classes: the model's output width (classes, regression targets, vocabulary).
            device: where the model, its state and the batches live.
            allowed_models: this worker's ``allowed_models``.
            daemon: ``worker NAME``, for a refusal's message.
            allowed_losses: this worker's ``allowed_losses``.

        Raises:
            EntryPointRefused, ModelError: as ``build_model`` (and ``task_of`` for a loss).
        """
        self.spec, self.device = spec, device
        self.task = task_of(spec, allowed_losses, daemon)
        self.x, self.y = torch.from_numpy(x_train), torch.from_numpy(y_train)
        self.n_train = len(y_train)
        self.global_batch = global_batch_size(spec)
        self.per_epoch = allreduce_steps_per_epoch(self.n_train, self.global_batch)
        self.total_steps = allreduce_total_steps(spec, self.n_train)
        self._model_args = (tuple(x_train.shape[1:]), num_classes, allowed_models, daemon)
        self._perm_epoch = -1
        self._perm = np.empty(0, np.int64)
        # sampling: prioritized: (first step, rows [K] int64, weights [K] float32) of the
        # generation's window, and the unweighted per-sample losses of its steps trained
        self._window: tuple[int, npt.NDArray[np.int64], npt.NDArray[np.float32]] | None = None
        self._losses: list[npt.NDArray[np.float32]] = []
        # A sharded replica builds its model for real at each generation's start; here on
        # the meta device only, so that a model that cannot be built is refused at once.
        self._build(on_meta=self.sharded)

    def _build(self, on_meta: bool = False) -> None:
        """Build the seeded model, its optimizer, lr schedule and grad scaler, at step 0.

        Raises:
            EntryPointRefused, ModelError: as ``build_model``; ModelError too when
                ``activation_checkpointing`` finds no blocks.
        """
        spec = self.spec
        input_shape, num_classes, allowed_models, daemon = self._model_args
        model = build_model(
            spec.model,
            input_shape,
            num_classes,
            spec.seed,
            allowed_models,
            daemon,
            device="meta" if on_meta else "cpu",
        )
        if spec.sync_batchnorm:
            model = convert_sync_batchnorm(model, self.device)
        if spec.activation_checkpointing:
            checkpoint_blocks(model)
        self.model: nn.Module = model if on_meta else self._place(model.to(self.device))
        self.optimizer = make_optimizer(spec, self.model.parameters())
        self.scheduler = make_lr_scheduler(spec, self.optimizer, self.total_steps)
        self.scaler = make_grad_scaler(spec.precision, self.device)
        self.step = 0
        self.last_lr = self.lr  # the learning rate of the last step taken

    def _place(self, model: nn.Module) -> nn.Module:
        """The model as the replica holds it between steps: whole (sharded: its shards)."""
        return model

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return current_lr(self.optimizer)

    def epoch_of(self, step: int) -> tuple[int, int]:
        """(epoch, step_in_epoch) of a global step."""
        return divmod(step, self.per_epoch)

    def _rows(self, step: int) -> npt.NDArray[np.int64]:
        """The global batch of ``step`` (as ``global_rows``, its epoch's permutation cached)."""
        epoch, in_epoch = self.epoch_of(step)
        if self._perm_epoch != epoch:
            self._perm = epoch_permutation(self.n_train, self.spec.seed, epoch)
            self._perm_epoch = epoch
        g = self.global_batch
        return self._perm[in_epoch * g : (in_epoch + 1) * g]

    def set_window(
        self, first_step: int, rows: npt.NDArray[np.int64], weights: npt.NDArray[np.float32]
    ) -> None:
        """Train the next steps on a prioritized window's drawn rows (module docstring).

        Args:
            first_step: the window's first global step (within one epoch).
            rows: [K] int64, the global batches of the window's steps in turn.
            weights: [K] float32 importance weights aligned with ``rows``.
        """
        self._window = (first_step, rows, weights)
        self._losses = []

    def clear_window(self) -> None:
        """Back to the uniform order (a generation without a window)."""
        self._window = None
        self._losses = []

    def take_losses(self) -> npt.NDArray[np.float32]:
        """This rank's unweighted losses since the window was set; then forgets them.

        Returns:
            [R] float32, its rows of each step trained in turn.
        """
        out = np.concatenate(self._losses) if self._losses else np.empty(0, np.float32)
        self._losses = []
        return out.astype(np.float32)

    def _window_batch(
        self, step: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32] | None]:
        """The rows of ``step`` (and their weights when a window is set).

        Raises:
            ValueError: the step is outside the window (FAILED_PRECONDITION upstream: the
                coordinator sent a window that does not cover the generation).
        """
        if self._window is None:
            return self._rows(step), None
        first, rows, weights = self._window
        _, in_epoch = self.epoch_of(step)
        start = (step - first) * self.global_batch  # only an epoch's last step is short
        stop = start + step_rows(self.n_train, self.global_batch, in_epoch)
        if step < first or stop > len(rows):
            raise ValueError(f"step {step} is outside the window of {len(rows)} rows from {first}")
        return rows[start:stop], weights[start:stop]

    def start_generation(self, rank: int, world_size: int, state: bytes) -> nn.Module:
        """Bring every rank to rank 0's state; return the model as the generation trains it.

        Rank 0 (which holds the newest state, or is sent one in ``state``) broadcasts its
        state; every other rank loads it. Call it on every rank after the process group is
        initialised.

        Args:
            rank: this rank.
            world_size: W.
            state: torch.save bytes sent to rank 0 to start from (b"": its own).

        Raises:
            StateError: the state is not a checkpoint of this job.
            RuntimeError: a collective failed or timed out.
            CompressionNotSupported: as :meth:`wrap`.
        """
        if rank == 0 and state:
            self.load_state(state)
        data = broadcast_bytes(rank, self.state_bytes() if rank == 0 else b"")
        if rank != 0:
            self.load_state(data)
        return self.wrap(world_size)

    def wrap(self, world_size: int) -> nn.Module:
        """The model as a generation trains it: DDP, or the model itself for one rank.

        With one rank there is nothing to all-reduce (and no buffer to broadcast). DDP gets
        the communication hook of the spec's compression (``worker.allreduce.ddp_hooks``).

        Raises:
            CompressionNotSupported: a compression the group's backend cannot run.
        """
        if world_size == 1:
            return self.model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(
            self.model, device_ids=device_ids, gradient_as_bucket_view=True
        )
        # The spec's compression (issue 11) as one of torch's comm hooks; getattr until the
        # field lands in TrainJobSpec.
        compression = getattr(self.spec, "compression", None)
        if compression is not None:
            register_compression_hook(
                ddp, compression.name, compression.ratio, compression.rank, dist.get_backend()
            )
        return ddp

    def train_step(self, ddp: nn.Module, rank: int, world_size: int) -> StepStats:
        """Train one optimizer step (``self.step``) on this rank's rows, then advance.

        Raises:
            RuntimeError (torch.distributed.DistBackendError among them): a collective
                failed or timed out; the replica keeps the state of ``self.step``.
        """
        self.last_lr = self.lr
        rows, weights = self._window_batch(self.step)
        mine = rank_rows(rows, rank, world_size)
        mine_w = None
        if weights is not None:  # the same contiguous part as the rows (rank_rows)
            mine_w = weights[rank_rows(np.arange(len(rows)), rank, world_size)]
        scale = world_size / max(len(rows), 1)
        stats = StepStats()
        self.optimizer.zero_grad(set_to_none=True)
        parts = micro_batches(mine, self.spec.grad_accum_steps)
        done = 0
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            if not last and isinstance(ddp, DistributedDataParallel):
                ctx = ddp.no_sync()  # accumulate locally; all-reduce on the last micro-batch
            w = mine_w[done : done + len(part)] if mine_w is not None else None
            done += len(part)
            with ctx:
                self._backward(ddp, part, scale, stats, w)
        self.scaler.unscale_(self.optimizer)
        if self.spec.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.step += 1
        return stats

    def _backward(
        self,
        ddp: nn.Module,
        part: npt.NDArray[np.int64],
        scale: float,
        s: StepStats,
        weights: npt.NDArray[np.float32] | None = None,
    ) -> None:
        index = torch.from_numpy(part)
        x = self.x[index].to(self.device, non_blocking=True)
        y = self.y[index].to(self.device, non_blocking=True)
        with autocast(self.spec.precision, self.device):
            outputs = ddp(x)
        per_sample = self.task.per_sample_loss(outputs, y)
        losses = per_sample.sum()
        if weights is None:
            loss = losses
        else:  # prioritized: sum(w_i l_i); the unweighted l_i go back to the coordinator
            w = torch.from_numpy(np.ascontiguousarray(weights)).to(self.device)
            loss = (per_sample * w).sum()
            self._losses.append(per_sample.detach().float().cpu().numpy())
        self.scaler.scale(loss * scale).backward()  # type: ignore[no-untyped-call]
        s.samples += len(part)
        s.loss_sum += float(losses.detach())
        s.correct += self.task.correct(outputs, y)

    def model_bytes(self) -> bytes:
        """The model's state_dict alone (parameters and buffers), ``pack_state``'s bytes.

        Rank 0 calls it (a sharded replica: every rank, and the others get b"").
        """
        return pack_state(self.model.state_dict())

    def state_bytes(self) -> bytes:
        """torch.save bytes of model, optimizer, lr schedule, grad scaler and step.

        Rank 0 calls it (a sharded replica: every rank, and the others get b"").
        """
        buf = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "step": self.step,
            },
            buf,
        )
        return buf.getvalue()

    def load_state(self, data: bytes) -> None:
        """Restore what :meth:`state_bytes` wrote (``torch.load(weights_only=True)``).

        A state of ``model`` and ``step`` alone (a job's ``init`` weights) loads the model
        and leaves the optimizer, schedule and grad scaler as built.

        Raises:
            StateError: the bytes are not a checkpoint of this replica (the replica may be
                partly loaded: the caller ends the generation).
        """
        try:
            state: dict[str, Any] = torch.load(
                io.BytesIO(data), map_location=self.device, weights_only=True
            )
            step = int(state["step"])
            self.model.load_state_dict(state["model"])
            # A job's initial state (``init``) holds the model and step 0 alone: the fresh
            # optimizer and schedule are then the right ones.
            if "optimizer" in state:
                self.optimizer.load_state_dict(state["optimizer"])
                self.scheduler.load_state_dict(state["scheduler"])
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
        except UNLOADABLE as exc:
            raise StateError(f"not a checkpoint of this job: {exc}") from None
        self.step = step


def broadcast_bytes(rank: int, data: bytes) -> bytes:
    """Broadcast rank 0's ``data`` to every rank of the default group (a size, then bytes).

    Args:
        rank: this rank.
        data: rank 0's bytes (ignored on the other ranks).

    Returns:
        Rank 0's bytes, on every rank.

    Raises:
        RuntimeError: a collective failed or timed out.
    """
    size = torch.tensor([len(data) if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(size, 0)
    if rank == 0:
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
    else:
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
    if int(size[0]):
        dist.broadcast(buf, 0)
    return data if rank == 0 else buf.numpy().tobytes()
