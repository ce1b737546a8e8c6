"""The process training one allreduce job: ``python -m worker.allreduce.allreduce_child``.

The worker daemon starts one per job and talks to it in frames (``worker.allreduce.child_pipe``) on
its stdin/stdout, so a hung collective or a crash in torch never takes the daemon (and its
memory slots) down: the daemon kills the child instead. The child keeps its replica across
generations, which is what lets survivors go on from their newest state.

Frames, daemon to child:
    ``init`` {spec_json, data_path, num_classes, torch_threads, allowed_models,
    allowed_losses, daemon, bind_host}: ``bind_host`` is the worker's advertised host, where
    rank 0's store and every rank's gloo listen (``worker.allreduce.rendezvous_store``)
    ``generation`` {generation, rank, world_size, master_addr, master_port, checkpoint_every,
    timeout_s, secret, stop_at} with the state to start from as payload (rank 0, when the
    coordinator sends one); ``secret`` seals the generation's store keys; ``stop_at`` > 0 ends
    the generation at that step (a paced job's granted epochs), rank 0 sending its full state
    ``stop`` {}: end the generation at the next control point (a rescale)
    ``window`` {first_step, rows_bytes} + rows (int64) then weights (float32), little-endian:
    sampling prioritized, the drawn rows of the next generation's window (it says
    ``windowed``; ``send_start_state``: rank 0 sends its full state before its first step)
Frames, child to daemon:
    ``ready`` {port}: rank 0's store listens (the coordinator tells the other ranks)
    ``joined`` {}: this rank is in the group and holds rank 0's state (every rank; the
    coordinator gives up on a rank that has not joined in time)
    ``progress`` {step, epoch, samples, loss_sum, correct, steps, seconds, lr} (rank 0)
    ``state`` {step, reason} + bytes (rank 0): the full state, torch.save bytes (reason
    checkpoint, final), or the model's state_dict alone, ``shared.training.packed_state``
    bytes (epoch, for evaluation: cheaper to write and read than torch.save's)
    ``ended`` {held_step, done, reason[, losses_from_step]}: the generation is over; the
    replica holds held_step; windowed: the payload is this rank's unweighted per-sample
    losses (float32) of the steps trained from losses_from_step
    ``fatal`` {message}: the child cannot train this job, and exits

The child exits when its stdin closes (the daemon died or let it go).
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import sys
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from shared.config import TrainJobSpec, job_spec_from_json
from shared.training.controls import resolve_device
from shared.training.data import load_dataset
from worker.allreduce.child_pipe import BlockingPipe, Frame, PipeClosed
from worker.allreduce.ddp_replica import Replica, StepStats
from worker.allreduce.rendezvous_store import (
    SealedStore,
    bound_listener,
    client_store,
    gloo_interface,
)

# Most steps between control points (a small all-reduce of the stop flag and progress sums:
# one more latency-bound collective, so not every step). Epoch ends, checkpoints, the last
# step and the job's first step (its report is L_0, the loss before the first update) are
# control points, and so is every CONTROL_EVERY-th step since the last one: an epoch of up
# to 20 steps has one control point, at its end (at multiples of 20, a 15-step epoch had
# 1.75).
CONTROL_EVERY = 20


class _Inbox:
    """Frames from the daemon, read on a thread; ``stop`` sets a flag instead of queueing."""

    def __init__(self, pipe: BlockingPipe) -> None:
        self.frames: queue.Queue[Frame] = queue.Queue()
        self.stop = threading.Event()
        self._pipe = pipe
        threading.Thread(target=self._run, name="inbox", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                frame = self._pipe.read()
            except (PipeClosed, ValueError):
                os._exit(0)  # the daemon is gone: nobody to train for
            if frame.type == "stop":
                self.stop.set()
            else:
                self.frames.put(frame)


def _load_replica(init: dict[str, Any]) -> Replica:
    spec = job_spec_from_json(init["spec_json"])
    assert isinstance(spec, TrainJobSpec)
    torch.set_num_threads(int(init["torch_threads"]))
    if init["data_path"]:
        with np.load(init["data_path"], allow_pickle=False) as f:
            x, y = f["x"], f["y"]
        num_classes = int(init["num_classes"])
    else:
        ds = load_dataset(spec.data, spec.seed, spec.test_fraction, spec.task, spec.vocab_size)
        x, y, num_classes = ds.x_train, ds.y_train, ds.num_classes
    replica_class = Replica
    if spec.sharding == "fsdp":
        # Imported only for FSDP jobs: torch's FSDP, DTensor and distributed-checkpoint
        # modules double the child's import time, which a DDP job need not wait for.
        from worker.allreduce.fsdp_replica import FsdpReplica

        replica_class = FsdpReplica
    return replica_class(
        spec,
        x,
        y,
        num_classes,
        resolve_device(spec.device),
        dict(init["allowed_models"]),
        str(init["daemon"]),
        dict(init.get("allowed_losses", {})),
    )


def _backend(replica: Replica) -> str:
    backend = replica.spec.backend
    if backend == "auto":
        return "nccl" if replica.device.type == "cuda" else "gloo"
    return backend


class _Generation:
    """One generation: rendezvous, state broadcast, DDP or FSDP, steps to done, stop or failure."""

    def __init__(
        self, pipe: BlockingPipe, inbox: _Inbox, replica: Replica, bind_host: str, cmd: Frame
    ) -> None:
        self.pipe, self.inbox, self.replica = pipe, inbox, replica
        self.bind_host = bind_host
        f = cmd.fields
        self.rank, self.world = int(f["rank"]), int(f["world_size"])
        self.timeout = datetime.timedelta(seconds=float(f["timeout_s"]))
        self.checkpoint_every = int(f["checkpoint_every"])
        self.master = (str(f["master_addr"]), int(f["master_port"]))
        self.generation = int(f["generation"])
        self.secret = str(f["secret"])
        self.stop_at = int(f.get("stop_at", 0))
        self.send_start_state = bool(f.get("send_start_state", False))
        self.windowed = bool(f.get("windowed", False))
        self.state = cmd.payload
        self.start_step = -1  # the replica's step once the generation has rank 0's state

    def run(self, window: Frame | None) -> None:
        if self.windowed and window is not None:
            k = int(window.fields["rows_bytes"])
            rows = np.frombuffer(window.payload[:k], "<i8").astype(np.int64)
            weights = np.frombuffer(window.payload[k:], "<f4").astype(np.float32)
            self.replica.set_window(int(window.fields["first_step"]), rows, weights)
        else:
            self.replica.clear_window()
        held, done, reason = self.replica.step, False, ""
        from_step = held
        try:
            done, reason = self._run()
        except Exception as exc:  # a collective failed or timed out: the generation is over
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        finally:
            held = self.replica.step
            _release_group()
            # The generation's DDP wrapper, process group and store (rank 0: its server,
            # still listening) sit in reference cycles that only the cyclic collector frees:
            # free them before "ended", so before the next generation can be asked for (a
            # paced job's may follow at once, and an old server collected later, at some
            # point of the next rendezvous, left the new store's clients waiting).
            gc.collect()
        ended: dict[str, Any] = {"held_step": held, "done": done, "reason": reason}
        payload = b""
        if self.windowed:
            # from the step the generation started at (a load of the coordinator's state
            # moves the replica there)
            ended["losses_from_step"] = self.start_step if self.start_step >= 0 else from_step
            payload = self.replica.take_losses().astype("<f4").tobytes()
        self.pipe.write(Frame("ended", ended, payload))

    def _run(self) -> tuple[bool, str]:
        """Rendezvous, load the state, train: (done, why the generation ended)."""
        # gloo (and NCCL's bootstrap) listen on the interface of the advertised host, not
        # every interface; an operator's own setting wins.
        interface = gloo_interface(self.bind_host)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        store = SealedStore(self._store(), self.secret, self.generation)
        # Ranks name their process group's keys by a process-wide counter: every rank
        # starts a generation from 0, whatever its earlier generations did.
        _c10d()._world.group_count = 0
        dist.init_process_group(
            _backend(self.replica),
            store=store,
            rank=self.rank,
            world_size=self.world,
            timeout=self.timeout,
        )
        model = self.replica.start_generation(self.rank, self.world, self.state)
        self.start_step = self.replica.step
        self.replica.take_losses()  # nothing before this generation's first step counts
        self.pipe.write(Frame("joined"))
        if self.send_start_state:
            self._send_state("checkpoint")
        return self._train(model)

    def _store(self) -> TCPStore:
        """Rank 0: a store listening on the advertised host only; others: a client of it.

        TCPStore's own server would listen on every interface whatever host it is given,
        so rank 0 binds the socket and hands its descriptor over (``master_listen_fd``). A
        client waits for the store's answer no longer than the timeout (``client_store``).
        """
        if self.rank == 0:
            sock = bound_listener(self.bind_host)
            port = int(sock.getsockname()[1])
            store = TCPStore(
                self.bind_host,
                port,
                None,
                True,
                self.timeout,
                wait_for_workers=False,
                master_listen_fd=sock.detach(),
            )
            self.pipe.write(Frame("ready", {"port": port}))
            return store
        host, port = self.master
        return client_store(host, port, self.timeout)

    def _train(self, model: torch.nn.Module) -> tuple[bool, str]:
        r = self.replica
        if r.step > 0 and (r.step >= r.total_steps or r.step % r.per_epoch == 0):
            # The last generation may have ended between an epoch's (or the job's) last step
            # and the state it owed: send it again; the coordinator takes it once.
            self._send_state("final" if r.step >= r.total_steps else "epoch")
        sums, steps, t0 = StepStats(), 0, time.perf_counter()
        end = min(r.total_steps, self.stop_at) if self.stop_at > 0 else r.total_steps
        while r.step < end:
            s = r.train_step(model, self.rank, self.world)
            sums.samples += s.samples
            sums.loss_sum += s.loss_sum
            sums.correct += s.correct
            steps += 1
            reason = self._boundary(r.step)
            if reason is None and steps < CONTROL_EVERY and r.step != 1:
                continue
            stop, totals = self._control(sums)
            now = time.perf_counter()
            if self.rank == 0:
                self._progress(totals, steps, now - t0)
            if reason is not None:  # its time counts in the next report's seconds
                self._send_state(reason)
            sums, steps, t0 = StepStats(), 0, now
            if stop and r.step < r.total_steps:
                if r.sharded and reason != "checkpoint":
                    # The ranks' shards do not outlive the generation: the next one starts
                    # from the coordinator's newest state, so rank 0 sends this step's.
                    self._send_state("checkpoint")
                return False, "stopped for a new generation"
        if r.step < r.total_steps:
            return False, "paused: the epochs granted have run"
        return True, ""

    def _send_state(self, reason: str) -> None:
        """Rank 0's state: the full state (checkpoint, final), the model alone (epoch).

        Every rank calls it at the same steps; a sharded replica's ranks all take part in
        gathering the state to rank 0, a whole replica's rank 0 serialises its own.
        """
        r = self.replica
        if self.rank != 0 and not r.sharded:
            return
        payload = r.model_bytes() if reason == "epoch" else r.state_bytes()
        if self.rank == 0:
            self.pipe.write(Frame("state", {"step": r.step, "reason": reason}, payload))

    def _boundary(self, step: int) -> str | None:
        """Why rank 0 sends its state after ``step`` steps (None: it does not)."""
        r = self.replica
        if step >= r.total_steps:
            return "final"
        if step % self.checkpoint_every == 0 or step == self.stop_at:
            return "checkpoint"
        if step % r.per_epoch == 0:
            return "epoch"
        return None

    def _control(self, sums: StepStats) -> tuple[bool, StepStats]:
        """All-reduce the stop flag and the progress sums: (stop, the sums of every rank)."""
        flag = 1.0 if self.inbox.stop.is_set() else 0.0
        t = torch.tensor([flag, sums.samples, sums.loss_sum, sums.correct], dtype=torch.float64)
        dist.all_reduce(t)
        return bool(t[0] > 0), StepStats(int(t[1]), float(t[2]), int(t[3]))

    def _progress(self, totals: StepStats, steps: int, seconds: float) -> None:
        """Rank 0 reports the steps since the last report and their wall seconds.

        The seconds run from the previous report to this one, so the time rank 0 spends
        sending a state counts in the report after it.
        """
        r = self.replica
        epoch, _ = r.epoch_of(r.step - 1)
        fields = {
            "step": r.step,
            "epoch": epoch,
            "samples": totals.samples,
            "loss_sum": totals.loss_sum,
            "correct": totals.correct,
            "steps": steps,
            "seconds": seconds,
            "lr": r.last_lr,
        }
        self.pipe.write(Frame("progress", fields))


def _c10d() -> Any:
    return dist.distributed_c10d


def _release_group() -> None:
    """Destroy the process group, even a broken one, so that the next generation can init.

    ``destroy_process_group`` shuts the backend down first and may raise on a group whose
    peers are gone, leaving the default group registered; then its bookkeeping is cleared
    as ``destroy_process_group`` would (torch 2.13's ``distributed_c10d``).
    """
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # the group is broken: drop it without a shutdown
        c10d = _c10d()
        c10d._update_default_pg(None)
        for name in (
            "pg_map",
            "pg_names",
            "pg_group_ranks",
            "pg_backend_config",
            "pg_to_tag",
            "tags_to_pg",
            "pg_coalesce_state",
        ):
            getattr(c10d._world, name).clear()
        c10d._world.group_count = 0


def main() -> None:
    """Serve the daemon's frames until stdin closes."""
    pipe = BlockingPipe(sys.stdin.buffer, sys.stdout.buffer)
    sys.stdout = sys.stderr  # nothing but frames may reach the pipe
    try:
        init = pipe.read()
    except PipeClosed:
        return
    try:
        replica = _load_replica(init.fields)
    except Exception as exc:  # refused model, bad data, no device: the daemon says why
        pipe.write(Frame("fatal", {"message": f"{type(exc).__name__}: {exc}"}))
        return
    inbox = _Inbox(pipe)
    pipe.write(Frame("loaded", {"total_steps": replica.total_steps}))
    window: Frame | None = None  # the last ``window`` frame, for the generation after it
    while True:
        cmd = inbox.frames.get()
        if cmd.type == "window":
            window = cmd
        elif cmd.type == "generation":
            inbox.stop.clear()
            _Generation(pipe, inbox, replica, str(init.fields["bind_host"]), cmd).run(window)
            window = None


if __name__ == "__main__":
    main()
