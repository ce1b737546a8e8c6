"""Gradient compression of an ``allreduce`` job: torch's own DDP communication hooks.

DDP all-reduces gradient buckets; a communication hook replaces that all-reduce
(``DistributedDataParallel.register_comm_hook``, torch docs "DDP Communication Hooks"). We map
a job's compression to the hooks torch ships rather than to code of ours:

- ``none``: no hook, DDP's float32 all-reduce.
- ``fp16``: ``default_hooks.fp16_compress_hook``: each bucket divided by the world size, cast
  to float16, all-reduced and cast back (half the bytes).
- ``bf16``: ``default_hooks.bf16_compress_hook``, the same in bfloat16; torch documents it
  for NCCL (>= 2.9.6) only, so another backend is refused.
- ``powersgd``: ``powerSGD_hook.powerSGD_hook`` (Vogels et al. 2019, "PowerSGD: Practical
  Low-Rank Gradient Compression for Distributed Optimization"): each gradient matrix M
  (n x m) is sent as rank-r factors P (n x r) and Q (m x r), with error feedback and warm
  start on (torch's defaults). Tensors that would not shrink ``min_compression_rate``-fold
  (torch's default 2: biases, small layers) are all-reduced uncompressed.

``int8`` and ``topk`` are the parameter server's schemes (``shared.training.compression``):
a sum of int8 values with per-rank scales or of sparse vectors with different supports is
not what an all-reduce computes, and torch ships no hook for them, so they are refused here.

Hook state (PowerSGD's residuals and warm-start factors) lives in the DDP wrapper of one
generation; a new generation starts a new one, with vanilla all-reduce for its first
``start_iter`` steps.
"""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

ALLREDUCE_SCHEMES = ("none", "fp16", "bf16", "powersgd")
# PowerSGD runs vanilla all-reduce for its first start_powerSGD_iter steps (torch's default
# 1000: a short job would never compress). torch requires > 1 with error feedback or warm
# start ("PowerSGD can only be applied after the first two iterations in DDP": DDP may
# rebuild its buckets after the first one), so 2 is the earliest it allows.
POWERSGD_START_ITER = 2


class CompressionNotSupported(ValueError):
    """A compression the allreduce strategy or its backend cannot run (INVALID_ARGUMENT)."""


def check_allreduce_compression(name: str, rank: int, backend: str) -> None:
    """Refuse a compression that :func:`register_compression_hook` cannot register.

    Args:
        name: the job's compression scheme.
        rank: PowerSGD's matrix approximation rank r (used by ``powersgd`` only).
        backend: the process group's backend, ``gloo`` or ``nccl``.

    Raises:
        CompressionNotSupported: ``int8``/``topk``/an unknown name, ``bf16`` on a backend
            other than NCCL, or ``powersgd`` with r < 1; the message says why.
    """
    if name not in ALLREDUCE_SCHEMES:
        raise CompressionNotSupported(
            f"compression {name!r} is not available with strategy allreduce "
            f"(choose one of {ALLREDUCE_SCHEMES}; int8 and topk are for strategy sync)"
        )
    if name == "bf16" and backend != "nccl":
        raise CompressionNotSupported(
            f"compression bf16 needs the nccl backend (a GPU job), this group runs {backend!r}; "
            "use fp16 or powersgd"
        )
    if name == "powersgd" and rank < 1:
        raise CompressionNotSupported(f"powersgd matrix rank must be >= 1, got {rank}")


def register_compression_hook(
    ddp_model: DistributedDataParallel,
    name: str,
    ratio: float,
    rank: int,
    backend: str,
    start_iter: int = POWERSGD_START_ITER,
) -> powerSGD_hook.PowerSGDState | None:
    """Register the DDP communication hook of a job's compression on ``ddp_model``.

    Call it once, after wrapping and before the first backward pass (torch allows one hook
    per DDP model). Every rank must register the same hook.

    Args:
        ddp_model: the generation's DDP wrapper, its process group the default (WORLD) one.
        name: ``none | fp16 | bf16 | powersgd``.
        ratio: top-k's fraction; unused here (all-reduce hooks have none), accepted so the
            spec's fields pass through as they are.
        rank: PowerSGD's matrix approximation rank r >= 1: a matrix gradient n x m is sent
            as (n + m) r numbers instead of n m.
        backend: the process group's backend (``torch.distributed.get_backend()``).
        start_iter: PowerSGD's ``start_powerSGD_iter`` >= 2 (see ``POWERSGD_START_ITER``).

    Returns:
        PowerSGD's state (its ``iter`` counts the steps, its ``error_dict`` holds the
        residuals) for ``powersgd``, else None.

    Raises:
        CompressionNotSupported: as :func:`check_allreduce_compression`.
        ValueError: ``start_iter`` < 2 (torch's own check, error feedback being on).
        RuntimeError: a hook is registered already (torch's check).
    """
    del ratio  # no all-reduce hook keeps a fraction of the elements
    check_allreduce_compression(name, rank, backend)
    if name == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter,
            use_error_feedback=True,
            warm_start=True,
        )
        ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    return None
