"""One rank's share of an ``allreduce`` job with ``sharding: fsdp``: torch FSDP2 ``fully_shard``.

Each block of the model (``shared.training.activation_checkpointing.model_blocks``: its
``blocks``, or a Sequential's children) that holds parameters is a ``fully_shard`` unit, and
the root is one more for what is left. Every parameter becomes a DTensor sharded on dim 0
over the generation's ranks; the optimizer is built over the shards, so its state is sharded
too, and the backward pass reduce-scatters gradients into the shards (Zhao et al. 2023,
"PyTorch FSDP"; torch docs "torch.distributed.fsdp.fully_shard"). A block's full parameters
exist only while it computes (all-gathered before its forward and again before its backward).

The loss scaling of ``worker.allreduce.ddp_replica`` is kept: FSDP2's reduce-scatter averages
over the ranks as DDP's all-reduce does, so a step equals DDP's (and single-process training
on the global batch) up to float rounding.

Shards belong to one process group, so they do not outlive a generation. Each generation
builds the seeded model anew, shards it, and loads the full state rank 0 is sent (the
coordinator's newest), broadcast as torch.save bytes like DDP's and distributed with
``torch.distributed.checkpoint.state_dict.set_model_state_dict`` /
``set_optimizer_state_dict`` (``full_state_dict=True``). States go the other way through
``get_model_state_dict`` / ``get_optimizer_state_dict`` (``full_state_dict=True,
cpu_offload=True``): every rank joins the all-gathers and rank 0 alone keeps the full,
unsharded state dict. The optimizer's state in such a checkpoint is keyed by parameter name
(torch's distributed-checkpoint form), not by parameter index as ``Optimizer.state_dict``.
"""

from __future__ import annotations

import io
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._redistribute import _gen_transform_infos
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from shared.training.activation_checkpointing import find_blocks
from shared.training.controls import UNLOADABLE
from shared.training.packed_state import pack_state
from worker.allreduce.ddp_replica import Replica, StateError, broadcast_bytes

# Gather to rank 0 only, on the CPU: the other ranks never hold the full state.
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_LOAD = StateDictOptions(full_state_dict=True)


class FsdpReplica(Replica):
    """A replica whose parameters, gradients and optimizer state are sharded over the ranks."""

    sharded = True

    def _place(self, model: nn.Module) -> nn.Module:
        """Shard every block with parameters, then the root, over the default group's ranks."""
        forget_earlier_meshes()
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        for block in find_blocks(model):
            if any(True for _ in block.parameters()):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def start_generation(self, rank: int, world_size: int, state: bytes) -> nn.Module:
        """Build and shard the seeded model over this generation, then load rank 0's state.

        Every rank builds the same seeded model at step 0 and shards it; when rank 0 is sent
        a state, it is broadcast and every rank loads its shards of it.

        Args:
            rank: this rank.
            world_size: W.
            state: the full state rank 0 starts from (b"": the seeded model at step 0).

        Raises:
            StateError: the state is not a checkpoint of this job.
            RuntimeError: a collective failed or timed out.
        """
        del world_size  # the mesh is the default group's
        self._build()
        data = broadcast_bytes(rank, state)
        if data:
            self.load_state(data)
        return self.model

    def wrap(self, world_size: int) -> nn.Module:
        """The sharded model itself: FSDP needs no wrapper."""
        del world_size
        return self.model

    def model_bytes(self) -> bytes:
        """The full model state_dict on rank 0 (``pack_state``), b"" elsewhere (collective)."""
        full = get_model_state_dict(self.model, options=_GATHER)  # plain CPU tensors
        return pack_state(cast(dict[str, torch.Tensor], full)) if dist.get_rank() == 0 else b""

    def state_bytes(self) -> bytes:
        """The full state on rank 0, b"" elsewhere (collective); as ``Replica.state_bytes``."""
        model = get_model_state_dict(self.model, options=_GATHER)
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=_GATHER)
        if dist.get_rank() != 0:
            return b""
        return _save(
            {
                "model": model,
                "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "step": self.step,
            }
        )

    def load_state(self, data: bytes) -> None:
        """Load a full state (``state_bytes``, or ``init``'s model and step) into the shards.

        Every rank calls it with the same bytes (the tensors are distributed with
        collectives).

        Raises:
            StateError: the bytes are not a checkpoint of this replica.
        """
        try:
            state: dict[str, Any] = torch.load(
                io.BytesIO(data), map_location="cpu", weights_only=True
            )
            step = int(state["step"])
        except UNLOADABLE as exc:
            raise StateError(f"not a checkpoint of this job: {exc}") from None
        try:
            set_model_state_dict(self.model, state["model"], options=_LOAD)
            if "optimizer" in state:
                set_optimizer_state_dict(
                    self.model, self.optimizer, state["optimizer"], options=_LOAD
                )
                self.scheduler.load_state_dict(state["scheduler"])
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
        except RuntimeError as exc:
            if not str(exc).startswith("Error(s) in loading state_dict"):
                raise  # a collective failed (a peer is gone): the generation ends
            # load_state_dict lists the keys on several lines: the generation's end reason
            # keeps the first line only.
            raise StateError(
                f"not a checkpoint of this job: {' '.join(str(exc).split())}"
            ) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"not a checkpoint of this job: {exc!r}") from None
        self.step = step


def forget_earlier_meshes() -> None:
    """Clear DTensor's caches of sharding decisions made on an earlier generation's mesh.

    A ``DeviceMesh`` compares equal to any mesh of the same ranks and device type whatever
    this process's rank in it (torch 2.13's ``DeviceMesh.__eq__``), so DTensor's sharding
    propagation and redistribution caches, keyed by specs that hold meshes, hand a new
    generation's DTensors the mesh of an earlier one, with this process's old coordinate:
    a rank whose number changed then slices full tensors (state loading, gathers) at its
    old offset ("The size of tensor a (43) must match the size of tensor b (42)").
    """
    _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]
    _gen_transform_infos.cache_clear()


def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters and optimizer state tensors held by this rank (DTensor: its shard).

    Args:
        model: a whole or sharded model.
        optimizer: its optimizer (state allocated after the first step).

    Returns:
        {"params": bytes, "optimizer": bytes}.
    """

    def local_bytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = sum(local_bytes(p) for p in model.parameters())
    opt = sum(
        local_bytes(v)
        for per_param in optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )
    return {"params": params, "optimizer": opt}


def _save(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
