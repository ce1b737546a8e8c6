"""Single-process references that prioritized sync and diloco training are checked against.

A ``sampling: prioritized`` job (README, "Prioritized training") in one process, written
independently of the code it checks: nothing from ``coordinator`` or ``worker``. The priority
table is ``tests.memory_reference.ReferenceStore`` (the store's exact seeded sampler and its
bulk priority update and decay, themselves written independently of the store), and the
formulae are written out here, from the README:

- the rows of a step are drawn from the table at its start, as many as the step's global
  batch has under uniform sampling (``global_batch_rows``), with the seed: the first 8 bytes,
  little-endian, of SHA-256("neuroshard-prioritized/{seed}/{epoch}/{step}/0"), shifted right
  by one;
- beta_t = beta + (beta_final - beta) min(1, t / (T - 1)), T the job's steps;
- w_i = (N P(i))^-beta_t, divided by the largest of the draw, as float32;
- the step's loss is mean_i(w_i l_i) over the drawn rows (l_i the unweighted cross-entropy);
- then m = the mean of every per-sample loss so far (float64), and each drawn row's strength
  is float32(0.01 + 0.99 (1 - exp(-l_i / m))), in draw order (the last occurrence of a row
  wins);
- at the end of each epoch (the last step ends the last one) every strength decays by
  ``decay_rate``.

diloco draws the rows of each window of ``resample_every_steps`` inner steps (whole outer
steps; default one) at the window's first outer step, cut at epoch ends, and deals them to
the shards in order: shard 0's rows of each of the outer step's inner steps, then shard 1's,
and so on; each inner step's loss is mean_i(w_i l_i) over its batch, and the outer step's
losses (shard by shard, in that order) set the strengths after it.

allreduce draws the rows of each window of ``resample_every_steps`` steps (default: one
epoch), cut at epoch ends, at its first step (seed of that step), as many as its steps' global
batches have (G = workers x batch_size, fewer at an epoch's last step), with beta_t at that
step; each step trains on its G' rows in turn, loss mean_i(w_i l_i), and its losses then set
the strengths (running mean included) as sync's do; the decay at each epoch's end.

Each reference returns the model and a ``Trace``: the SHA-256 of every drawn row (int64
little-endian, in draw order), the running mean loss and the table at the end.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from shared.config import TrainJobSpec
from shared.training.data import Dataset, batch_indices
from shared.training.models import build_model
from tests.memory_reference import ReferenceStore
from tests.training_reference import (
    _optimizer,
    _refuse_unmodelled,
    global_batch_rows,
    steps_in_epoch,
)


@dataclass
class Trace:
    """What a prioritized reference drew and left.

    Attributes:
        digest: SHA-256 of every drawn row, int64 little-endian, in draw order.
        table: the priority table at the end (before the job would drop it).
        loss_total: the sum of every per-sample loss (float64).
        loss_count: how many.
        rows_drawn: rows drawn.
    """

    digest: hashlib._Hash = field(default_factory=hashlib.sha256)
    table: ReferenceStore = field(default_factory=ReferenceStore)
    loss_total: float = 0.0
    loss_count: int = 0
    rows_drawn: int = 0

    @property
    def running_mean_loss(self) -> float:
        return self.loss_total / self.loss_count if self.loss_count else 0.0

    def draw(self, n: int, seed: int, epoch: int, step: int, alpha: float):
        """n rows of the table: (rows [n] int64, P(i) [n] float64)."""
        text = f"neuroshard-prioritized/{seed}/{epoch}/{step}/0".encode()
        draw_seed = int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1
        ids, _, _, probabilities = self.table.sample(n, alpha, draw_seed)
        rows = ids.astype(np.int64)
        self.digest.update(rows.astype("<i8").tobytes())
        self.rows_drawn += n
        return rows, probabilities

    def write_back(self, rows: np.ndarray, losses: np.ndarray) -> None:
        """The running mean with ``losses``, then each row's strength from its loss."""
        loss64 = losses.astype(np.float64)
        self.loss_total += float(np.sum(loss64))
        self.loss_count += len(loss64)
        m = self.running_mean_loss
        strengths = (0.01 + 0.99 * (1.0 - np.exp(-loss64 / m))).astype(np.float32)
        self.table.update_strengths(rows.astype(np.uint64), strengths)


def weights_of(probabilities: np.ndarray, n_rows: int, beta: float) -> np.ndarray:
    """w_i = (N P(i))^-beta / max_j w_j, float32."""
    w = (n_rows * probabilities) ** -beta
    return (w / w.max()).astype(np.float32)


def beta_at(spec: TrainJobSpec, t: int, total: int) -> float:
    s = spec.sampling
    return s.beta + (s.beta_final - s.beta) * min(1.0, t / max(total - 1, 1))


def _table(n_train: int, slots: int) -> ReferenceStore:
    table = ReferenceStore(slots=slots)
    table.upsert(np.arange(n_train, dtype=np.uint64), np.ones(n_train, np.float32))
    return table


def weighted_step(
    model: nn.Module, opt: torch.optim.Optimizer, dataset: Dataset, rows, weights
) -> np.ndarray:
    """One optimizer step on mean_i(w_i l_i) over ``rows``; return the losses l_i, float32."""
    idx = torch.from_numpy(rows)
    x, y = torch.from_numpy(dataset.x_train)[idx], torch.from_numpy(dataset.y_train)[idx]
    opt.zero_grad()
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    (losses * torch.from_numpy(weights)).mean().backward()
    opt.step()
    return losses.detach().numpy().astype(np.float32)


def train_prioritized_single_process(
    spec: TrainJobSpec, dataset: Dataset, slots: int
) -> tuple[nn.Module, Trace]:
    """A ``strategy: sync`` prioritized job of ``spec.steps`` steps, in this process.

    Args:
        spec: the job (steps set; sgd, adam or adamw; fp32; no schedule nor clipping).
        dataset: its data set, as ``load_dataset(spec.data, spec.seed, spec.test_fraction)``.
        slots: the cluster's slot count (the sampler's order is slot, then id).
    """
    assert spec.steps is not None
    _refuse_unmodelled(spec)
    n_train, s = len(dataset.y_train), spec.sampling
    per_epoch = steps_in_epoch(n_train, spec.workers, spec.batch_size)
    model = build_model(spec.model, dataset.input_shape, dataset.num_classes, spec.seed)
    opt = _optimizer(spec, model)
    trace = Trace(table=_table(n_train, slots))
    for t in range(spec.steps):
        epoch = t // per_epoch
        size = len(global_batch_rows(spec, n_train, t))
        rows, probabilities = trace.draw(size, spec.seed, epoch, t, s.alpha)
        weights = weights_of(probabilities, n_train, beta_at(spec, t, spec.steps))
        trace.write_back(rows, weighted_step(model, opt, dataset, rows, weights))
        if (t % per_epoch == per_epoch - 1 or t == spec.steps - 1) and s.decay_rate > 0:
            trace.table.decay(s.decay_rate)
    return model, trace


def train_prioritized_diloco_single_process(
    spec: TrainJobSpec, dataset: Dataset, slots: int
) -> tuple[nn.Module, Trace]:
    """A ``strategy: diloco`` prioritized job of ``spec.steps`` inner steps, in this process.

    One replica and inner optimizer per shard, kept for the job; the outer Nesterov SGD on the
    sample-weighted mean of the pseudo-gradients (as ``train_diloco_single_process``).
    """
    assert spec.steps is not None
    _refuse_unmodelled(spec)
    n_train, shards, s, h = len(dataset.y_train), spec.workers, spec.sampling, spec.inner_steps
    per_epoch = steps_in_epoch(n_train, shards, spec.batch_size)
    outer_per_epoch = math.ceil(per_epoch / h)
    per_window = (s.resample_every_steps or h) // h
    full_epochs, rest = divmod(spec.steps, per_epoch)
    outer_total = full_epochs * outer_per_epoch + math.ceil(rest / h)

    def fresh() -> nn.Module:
        return build_model(spec.model, dataset.input_shape, dataset.num_classes, spec.seed)

    def inner_range(o: int) -> tuple[int, range]:
        epoch, j = divmod(o, outer_per_epoch)
        first = j * h
        return epoch, range(first, min(first + h, per_epoch, spec.steps - epoch * per_epoch))

    def counts(o: int) -> list[list[int]]:
        """[shard][inner step] rows of outer step o under uniform sampling."""
        epoch, inner = inner_range(o)
        return [
            [
                len(batch_indices(n_train, sh, shards, spec.batch_size, epoch, i, spec.seed))
                for i in inner
            ]
            for sh in range(shards)
        ]

    model, replicas = fresh(), [fresh() for _ in range(shards)]
    inner_opts = [_optimizer(spec, r) for r in replicas]
    outer = torch.optim.SGD(
        model.parameters(),
        lr=spec.outer_lr,
        momentum=spec.outer_momentum,
        nesterov=spec.outer_momentum > 0,
    )
    trace = Trace(table=_table(n_train, slots))
    drawn: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for o in range(outer_total):
        epoch, inner = inner_range(o)
        j = o % outer_per_epoch
        if j % per_window == 0:  # a window starts: draw the rows of its outer steps
            window = range(o, min(o + per_window, (epoch + 1) * outer_per_epoch, outer_total))
            sizes = [sum(map(sum, counts(w))) for w in window]
            rows, probabilities = trace.draw(sum(sizes), spec.seed, epoch, o, s.alpha)
            t = epoch * per_epoch + inner.start
            weights = weights_of(probabilities, n_train, beta_at(spec, t, spec.steps))
            bounds = np.cumsum([0, *sizes])
            for w, a, b in zip(window, bounds[:-1], bounds[1:], strict=True):
                drawn[w] = (rows[a:b], weights[a:b])
        rows, weights = drawn.pop(o)
        deltas, seen, losses, offset = [], [], [], 0
        for shard, (replica, opt) in enumerate(zip(replicas, inner_opts, strict=True)):
            replica.load_state_dict(model.state_dict())
            for count in counts(o)[shard]:
                if count == 0:
                    continue
                batch, w = rows[offset : offset + count], weights[offset : offset + count]
                offset += count
                losses.append(weighted_step(replica, opt, dataset, batch, w))
            pairs = zip(model.parameters(), replica.parameters(), strict=True)
            deltas.append([g.detach() - r.detach() for g, r in pairs])
            seen.append(sum(counts(o)[shard]))
        total = sum(seen)
        outer.zero_grad()
        for i, p in enumerate(model.parameters()):
            mean = sum(
                c / total * d[i].to(torch.float64) for d, c in zip(deltas, seen, strict=True)
            )
            p.grad = mean.to(torch.float32)
        outer.step()
        trace.write_back(rows, np.concatenate(losses))
        if (j == outer_per_epoch - 1 or o == outer_total - 1) and s.decay_rate > 0:
            trace.table.decay(s.decay_rate)
    return model, trace


def train_prioritized_allreduce_single_process(
    spec: TrainJobSpec, dataset: Dataset, slots: int
) -> tuple[nn.Module, Trace]:
    """A ``strategy: allreduce`` prioritized job of ``spec.steps`` steps, in this process."""
    assert spec.steps is not None
    _refuse_unmodelled(spec)
    n_train, s = len(dataset.y_train), spec.sampling
    g = spec.workers * spec.batch_size * spec.grad_accum_steps
    per_epoch = -(-n_train // g)
    every = s.resample_every_steps or per_epoch
    model = build_model(spec.model, dataset.input_shape, dataset.num_classes, spec.seed)
    opt = _optimizer(spec, model)
    trace = Trace(table=_table(n_train, slots))

    def size(t: int) -> int:
        return max(0, min(g, n_train - (t % per_epoch) * g))

    rows = weights = np.empty(0)
    offset = 0
    for t in range(spec.steps):
        epoch, in_epoch = divmod(t, per_epoch)
        if in_epoch % every == 0:  # a window starts
            stop = min(t + every, (epoch + 1) * per_epoch, spec.steps)
            n = sum(size(u) for u in range(t, stop))
            rows, probabilities = trace.draw(n, spec.seed, epoch, t, s.alpha)
            weights = weights_of(probabilities, n_train, beta_at(spec, t, spec.steps))
            offset = 0
        batch, w = rows[offset : offset + size(t)], weights[offset : offset + size(t)]
        offset += size(t)
        trace.write_back(batch, weighted_step(model, opt, dataset, batch, w))
        if (in_epoch == per_epoch - 1 or t == spec.steps - 1) and s.decay_rate > 0:
            trace.table.decay(s.decay_rate)
    return model, trace
