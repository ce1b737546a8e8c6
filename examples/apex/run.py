"""Run Ape-X on CartPole-v1: N actor processes and one learner around one replay table.

    python -m examples.apex --coordinator localhost:50051 --sampling prioritized --seed 0

Actors (``--actors`` processes, spawned) step their own environment with Ape-X's epsilons,
turn steps into 3-step transitions, compute each one's initial priority (|TD error| under
their copy of the network, clipped to [1e-3, 1]) and insert them in batches into the table
(ids: actor << 40 | counter). The learner draws ``--batch`` transitions with P(i) proportional
to s_i^alpha (``--sampling uniform``: alpha 0), weights each loss by (N P(i))^-beta / max with
beta annealed from 0.4 to 1, steps a double DQN and writes back |TD| clipped to [1e-3, 1] as
strengths; every 100 learner steps it decays the table by ``--decay`` (staleness). The
learner draws the next batch while it trains on this one and writes priorities back while the
next step runs (two clients, one thread each). It copies its
weights to the actors every 25 steps through shared memory.

The replay ratio is held at ``--replay-ratio`` sampled transitions per environment step (both
sides wait on shared counters, as Reverb's SampleToInsertRatio rate limiter), so prioritized
and uniform runs compare at equal learning per environment step whatever the machine's load.
Solve criterion (the standard one for CartPole-v1): mean return >= 475 over 100 episodes of
the greedy policy, checked every ``--eval-every`` environment steps (10 episodes first; the
100 only when those pass). Rewards are scaled by 0.01 inside the learner (Q values in [0, 1], so
|TD| lies mostly in [0, 1]); returns are reported unscaled.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

REWARD_SCALE = 0.01
N_STEP = 3
GAMMA = 0.99
PRIORITY_FLOOR = 1e-3


@dataclass
class RunConfig:
    """One Ape-X run (units: env steps are environment steps summed over actors)."""

    seed: int = 0
    actors: int = 3
    alpha: float = 0.6
    batch: int = 64
    replay_ratio: float = 8.0  # samples the learner trains on per env step
    # Samples the learner may fall behind env_steps x replay_ratio before the actors wait (the
    # error buffer of Reverb's SampleToInsertRatio rate limiter).
    rate_limit_slack: int = 20_000
    capacity: int = 50_000
    decay: float = 1e-4
    min_size: int = 1_000
    max_env_steps: int = 150_000
    eval_every: int = 4_000
    beta_steps: int = 100_000
    insert_batch: int = 32
    lr: float = 5e-4


@dataclass
class RunResult:
    """What a run reports: solve point (None if not solved) and the evaluation curve."""

    solved_env_steps: int | None
    solved_wall_s: float | None
    env_steps: int
    learner_steps: int
    wall_s: float
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # env steps, s, eval10
    errors: list[str] = field(default_factory=list)


def _actor(
    i: int,
    cfg: RunConfig,
    replay_factory: Callable[[], Any],
    params: Any,
    counters: Any,
    stop: Any,
) -> None:
    import gymnasium as gym
    import torch

    from examples.apex.dqn import (
        TRANSITION,
        Learner,
        LearnerConfig,
        NStep,
        Step,
        actor_epsilon,
        pack,
    )

    torch.set_num_threads(1)
    replay = replay_factory()
    local = Learner(LearnerConfig(), cfg.seed)
    rng = np.random.default_rng([cfg.seed, i])
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=cfg.seed * 1000 + i)
    nstep, eps = NStep(N_STEP, GAMMA), actor_epsilon(i, cfg.actors)
    pending: list[Step] = []
    next_id, version = 0, -1
    while not stop.is_set():
        if counters["version"].value != version:
            version = counters["version"].value
            torch.nn.utils.vector_to_parameters(params.clone(), local.net.parameters())
            local.target.load_state_dict(local.net.state_dict())
        env_steps, learned = counters["env"].value, counters["sampled"].value
        if (
            env_steps > cfg.min_size
            and env_steps * cfg.replay_ratio > learned + cfg.rate_limit_slack
        ):
            time.sleep(0.002)  # rate limiter: the learner is behind
            continue
        with torch.no_grad():
            q = local.net(torch.from_numpy(obs)[None])[0].numpy()
        a = int(rng.integers(2)) if rng.random() < eps else int(q.argmax())
        nxt, r, term, trunc, _ = env.step(a)
        pending += nstep.add(obs, a, float(r) * REWARD_SCALE, nxt, term, trunc)
        obs = env.reset()[0] if term or trunc else nxt
        with counters["env"].get_lock():
            counters["env"].value += 1
        if len(pending) >= cfg.insert_batch:
            recs = np.array(pending, dtype=TRANSITION)
            pending = []
            prio = np.clip(local.td_errors(recs), PRIORITY_FLOOR, 1.0).astype(np.float32)
            ids = (np.uint64(i) << np.uint64(40)) + np.arange(
                next_id, next_id + len(recs), dtype=np.uint64
            )
            next_id += len(recs)
            replay.insert(ids, prio, pack(recs))


def _seed(rng: np.random.Generator) -> int:
    return int(rng.integers(1 << 62))


class _Pipe:
    """One replay client on its own thread; ``call`` runs a method there and returns a future."""

    def __init__(self, replay_factory: Callable[[], Any]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._replay = self._pool.submit(replay_factory).result()

    def call(self, method: str, *args: Any) -> Future[Any]:
        if method == "write_back":
            return self._pool.submit(self._write_back, *args)
        return self._pool.submit(getattr(self._replay, method), *args)

    def _write_back(self, ids: np.ndarray, priorities: np.ndarray, decay: float) -> None:
        self._replay.update(ids, priorities)
        if decay:
            self._replay.decay(decay)

    def close(self) -> None:
        close = getattr(self._replay, "close", None)
        if close is not None:
            self._pool.submit(close).result()
        self._pool.shutdown(wait=True, cancel_futures=True)


def run(
    cfg: RunConfig,
    replay_factory: Callable[[], Any],
    on_env_steps: Callable[[int], None] | None = None,
) -> RunResult:
    """Run one Ape-X training to the solve criterion or ``cfg.max_env_steps``.

    Args:
        cfg: the run's settings.
        replay_factory: picklable; makes a replay (examples.apex.replay.Replay) in each process.
        on_env_steps: called by the learner with the env step count after each check (the
            benchmark kills a worker from it).
    """
    import torch

    from examples.apex.dqn import Learner, LearnerConfig, greedy_return, importance_weights, unpack

    torch.set_num_threads(1)
    learner = Learner(LearnerConfig(lr=cfg.lr), cfg.seed)
    ctx = mp.get_context("spawn")
    params = (
        torch.nn.utils.parameters_to_vector(learner.net.parameters())
        .detach()
        .clone()
        .share_memory_()  # type: ignore[no-untyped-call]
    )
    counters = {
        "env": ctx.Value("q", 0),
        "sampled": ctx.Value("q", 0),
        "version": ctx.Value("q", 0),
    }
    stop = ctx.Event()
    actors = [
        ctx.Process(
            target=_actor, args=(i, cfg, replay_factory, params, counters, stop), daemon=True
        )
        for i in range(cfg.actors)
    ]
    for p in actors:
        p.start()
    # The learner's two replay clients, each in its own thread (a SyncClient is one thread's):
    # the next batch is drawn while this one trains, and priorities are written back while
    # the next step runs (at most one write in flight), as Ape-X's learner does.
    sampler, writer = _Pipe(replay_factory), _Pipe(replay_factory)
    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    next_batch: Future[Any] | None = None
    write: Future[Any] | None = None
    result = RunResult(None, None, 0, 0, 0.0)
    next_eval = cfg.eval_every
    try:
        while True:
            env_steps = counters["env"].value
            if env_steps >= next_eval:
                next_eval += cfg.eval_every
                ret10 = float(np.mean(greedy_return(learner.net, 10**6, 10)))
                result.curve.append((env_steps, time.perf_counter() - t0, ret10))
                if on_env_steps is not None:
                    on_env_steps(env_steps)
                if ret10 >= 475 and np.mean(greedy_return(learner.net, 10**6, 100)) >= 475:
                    result.solved_env_steps, result.solved_wall_s = (
                        env_steps,
                        time.perf_counter() - t0,
                    )
                    break
            if env_steps >= cfg.max_env_steps:
                break
            if not all(p.is_alive() for p in actors):
                raise RuntimeError("an actor process died")
            if (
                env_steps < cfg.min_size
                or counters["sampled"].value >= env_steps * cfg.replay_ratio
            ):
                time.sleep(0.002)
                continue
            if next_batch is None:
                next_batch = sampler.call("sample", cfg.batch, cfg.alpha, _seed(rng), cfg.min_size)
            drawn = next_batch.result()
            next_batch = sampler.call("sample", cfg.batch, cfg.alpha, _seed(rng), cfg.min_size)
            beta = min(1.0, 0.4 + 0.6 * env_steps / cfg.beta_steps)
            td = learner.step(
                unpack(drawn.payloads), importance_weights(drawn.probs, drawn.size, beta)
            )
            if write is not None:
                write.result()
            priorities = np.clip(td, PRIORITY_FLOOR, 1.0).astype(np.float32)
            decay = cfg.decay if (learner.steps % 100 == 0 and cfg.decay > 0) else 0.0
            write = writer.call("write_back", drawn.ids, priorities, decay)
            with counters["sampled"].get_lock():
                counters["sampled"].value += cfg.batch
            if learner.steps % 25 == 0:
                params.copy_(torch.nn.utils.parameters_to_vector(learner.net.parameters()).detach())
                with counters["version"].get_lock():
                    counters["version"].value += 1
    finally:
        stop.set()
        for pipe in (sampler, writer):
            pipe.close()
        for p in actors:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    result.env_steps = counters["env"].value
    result.learner_steps = learner.steps
    result.wall_s = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> None:
    """The command line: one run against a cluster's table; prints the result as JSON."""
    from examples.apex.replay import ClusterReplayFactory

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--coordinator", default=None, help="host:port (default $NEUROSHARD_COORDINATOR)"
    )
    p.add_argument("--table", default="apex")
    p.add_argument("--sampling", choices=["prioritized", "uniform"], default="prioritized")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--actors", type=int, default=3)
    p.add_argument("--max-env-steps", type=int, default=150_000)
    a = p.parse_args(argv)
    cfg = RunConfig(
        seed=a.seed,
        actors=a.actors,
        alpha=0.6 if a.sampling == "prioritized" else 0.0,
        max_env_steps=a.max_env_steps,
    )
    factory = ClusterReplayFactory(a.coordinator, a.table)
    factory.create(cfg.capacity)
    try:
        result = run(cfg, factory)
    finally:
        factory.drop()
    print(json.dumps({"config": asdict(cfg), **asdict(result)}))
