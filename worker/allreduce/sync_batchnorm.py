"""BatchNorm over the global batch of an ``allreduce`` job, on CPU as on CUDA.

``torch.nn.SyncBatchNorm`` runs only on CUDA (torch 2.13 raises "SyncBatchNorm layers only
work with GPU modules" on CPU). ``CpuSyncBatchNorm`` computes the same thing with
collectives that run on any backend: each rank sums its rows' values and squares per channel,
one all-reduce makes the global sums, and the batch mean and (biased) variance follow
(Ioffe & Szegedy 2015, algorithm 1, over the union of the ranks' rows). The all-reduce is
``torch.distributed.nn.functional.all_reduce``, which is differentiable (its backward
all-reduces the incoming gradient), so gradients flow through the shared statistics as they
would in one process on the global batch. Sums are taken in float64 so that
``E[x^2] - E[x]^2`` loses nothing a float32 ``BatchNorm`` would keep.

Running statistics follow ``torch.nn.BatchNorm``: ``running = (1 - m) running + m batch``
with the unbiased variance ``var * n / (n - 1)``, ``n`` the global row count per channel.

Shapes: B rows on this rank, C channels, ``*S`` spatial dims.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn


class CpuSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm layer whose batch statistics are those of every rank's rows together."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input [B, C, ...], got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` [B, C, *S] with the global batch's statistics when training.

        Outside training, or with no process group, it is an ordinary BatchNorm.
        """
        self._check_input_dim(input)
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(input)
        dims = [0, *range(2, input.dim())]
        x64 = input.to(torch.float64)
        count = torch.tensor([input.numel() / input.shape[1]], dtype=torch.float64)
        local = torch.cat([x64.sum(dims), (x64 * x64).sum(dims), count])
        total: torch.Tensor = dist_fn.all_reduce(  # type: ignore[no-untyped-call]
            local, op=dist.ReduceOp.SUM
        )
        c = input.shape[1]
        n = total[-1]
        mean = total[:c] / n
        var = (total[c : 2 * c] / n - mean * mean).clamp_min(0.0)
        self._update_running(mean.detach(), var.detach(), float(n))
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (x64 - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        out = out.to(input.dtype)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        if not self.track_running_stats or self.running_mean is None:
            return
        assert self.running_var is not None and self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else float(self.momentum)
        unbiased = var * (n / max(n - 1.0, 1.0))
        self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
        self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by one synchronised over the process group.

    On CUDA: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``. On CPU: ``CpuSyncBatchNorm``
    layers holding the same parameters and buffers (the state_dict keys do not change, so a
    saved model loads into the plain architecture).
    """
    if device.type == "cuda":
        converted: nn.Module = nn.SyncBatchNorm.convert_sync_batchnorm(module)  # type: ignore[no-untyped-call]
        return converted
    return _convert_cpu(module)


def _convert_cpu(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, CpuSyncBatchNorm
    ):
        new = CpuSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        if module.affine:
            with torch.no_grad():
                new.weight = module.weight
                new.bias = module.bias
        new.running_mean = module.running_mean
        new.running_var = module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, _convert_cpu(child))
    return module
