"""The learner's and actors' network: a double DQN with n-step returns on CartPole-v1.

Transitions travel as packed records (:data:`TRANSITION`, 41 bytes): the observation [4]
float32, the action, the n-step discounted return, the observation n steps later, and the
discount to apply to its value (gamma^n, 0 when the episode ended within the n steps).

Sources: double DQN (van Hasselt et al. 2016), n-step returns and actor epsilons as in Ape-X
(Horgan et al. 2018, section 4: eps_i = eps^(1 + i / (N - 1) * alpha_eps), eps 0.4,
alpha_eps 7), importance weights (N P(i))^-beta / max (Schaul et al. 2016, section 3.4).

Shapes: B transitions of a batch, O = 4 observation features, A = 2 actions.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

OBS = 4
ACTIONS = 2
# One transition before packing: (obs [O], action, n-step return, next obs [O], discount).
Step = tuple[np.ndarray, int, float, np.ndarray, float]
TRANSITION = np.dtype(
    [
        ("obs", "<f4", (OBS,)),
        ("action", "u1"),
        ("ret", "<f4"),
        ("next_obs", "<f4", (OBS,)),
        ("discount", "<f4"),
    ]
)


def q_network(hidden: int = 128) -> nn.Module:
    """Return the Q network: [B, O] float32 observations -> [B, A] float32 action values."""
    return nn.Sequential(
        nn.Linear(OBS, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, ACTIONS),
    )


def actor_epsilon(i: int, n: int, eps: float = 0.4, alpha: float = 7.0) -> float:
    """Ape-X's exploration rate of actor ``i`` of ``n`` (Horgan et al. 2018, section 4)."""
    return eps if n == 1 else eps ** (1.0 + i / (n - 1) * alpha)


def pack(records: npt.NDArray[np.void]) -> list[bytes]:
    """Return each [B] :data:`TRANSITION` record as its own 41-byte payload."""
    raw = records.astype(TRANSITION, copy=False).tobytes()
    size = TRANSITION.itemsize
    return [raw[i * size : (i + 1) * size] for i in range(len(records))]


def unpack(payloads: list[bytes]) -> npt.NDArray[np.void]:
    """Return [B] :data:`TRANSITION` records from their payloads.

    Raises:
        ValueError: a payload is not one record long.
    """
    if any(len(p) != TRANSITION.itemsize for p in payloads):
        raise ValueError(f"a transition payload is not {TRANSITION.itemsize} bytes")
    return np.frombuffer(b"".join(payloads), dtype=TRANSITION)


class NStep:
    """Turns one environment's steps into n-step transitions (Sutton and Barto, 7.1)."""

    def __init__(self, n: int, gamma: float) -> None:
        """Collect returns over ``n`` steps discounted by ``gamma``."""
        self.n, self.gamma = n, gamma
        self._steps: deque[tuple[np.ndarray, int, float]] = deque()

    def add(
        self,
        obs: np.ndarray,
        action: int,
        reward: float,
        next_obs: np.ndarray,
        done: bool,
        cut: bool,
    ) -> list[Step]:
        """Add one step; return the transitions it completes as TRANSITION tuples.

        ``done``: the episode terminated (no bootstrap); ``cut``: it was truncated (bootstrap
        from ``next_obs``); both flush the pending steps.
        """
        self._steps.append((obs, action, reward))
        out: list[Step] = []
        if len(self._steps) == self.n:
            out.append(self._emit(next_obs, done))
            self._steps.popleft()
        if done or cut:
            while self._steps:
                out.append(self._emit(next_obs, done))
                self._steps.popleft()
        return out

    def _emit(self, next_obs: np.ndarray, done: bool) -> Step:
        ret = 0.0
        for k, (_, _, r) in enumerate(self._steps):
            ret += (self.gamma**k) * r
        obs, action, _ = self._steps[0]
        discount = 0.0 if done else self.gamma ** len(self._steps)
        return (obs, action, ret, next_obs, discount)


@dataclass
class LearnerConfig:
    """The learner's hyperparameters (units: steps are learner steps)."""

    lr: float = 5e-4
    target_every: int = 250
    huber_delta: float = 1.0
    grad_clip: float = 10.0


class Learner:
    """A double DQN learner with importance-weighted Huber loss."""

    def __init__(self, cfg: LearnerConfig, seed: int) -> None:
        """Build the online and target networks (seeded) and the Adam optimizer."""
        torch.manual_seed(seed)
        self.cfg = cfg
        self.net = q_network()
        self.target = copy.deepcopy(self.net)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=cfg.lr)
        self.steps = 0

    def td_errors(self, batch: npt.NDArray[np.void], net: nn.Module | None = None) -> np.ndarray:
        """Return |TD error| [B] float32 of transitions under ``net`` (default the online one)."""
        with torch.no_grad():
            td = self._td(batch, net or self.net, net or self.target)
        return td.abs().numpy()

    def _td(
        self, batch: npt.NDArray[np.void], online: nn.Module, target: nn.Module
    ) -> torch.Tensor:
        obs = torch.from_numpy(batch["obs"].copy())
        nxt = torch.from_numpy(batch["next_obs"].copy())
        act = torch.from_numpy(batch["action"].astype(np.int64))
        q = online(obs).gather(1, act[:, None])[:, 0]
        with torch.no_grad():
            best = online(nxt).argmax(1, keepdim=True)
            boot = target(nxt).gather(1, best)[:, 0]
            y = (
                torch.from_numpy(batch["ret"].copy())
                + torch.from_numpy(batch["discount"].copy()) * boot
            )
        td: torch.Tensor = y - q
        return td

    def step(self, batch: npt.NDArray[np.void], weights: np.ndarray) -> np.ndarray:
        """One gradient step on [B] transitions with importance weights [B]; return |TD| [B]."""
        td = self._td(batch, self.net, self.target)
        w = torch.from_numpy(weights.astype(np.float32))
        loss = (
            w
            * nn.functional.huber_loss(
                td, torch.zeros_like(td), reduction="none", delta=self.cfg.huber_delta
            )
        ).mean()
        self.opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(self.net.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.steps += 1
        if self.steps % self.cfg.target_every == 0:
            self.target.load_state_dict(self.net.state_dict())
        return td.detach().abs().numpy()


def importance_weights(probs: np.ndarray, size: int, beta: float) -> np.ndarray:
    """Return (N P(i))^-beta / max_j (N P(j))^-beta for [B] draw probabilities (Schaul 2016)."""
    w: np.ndarray = (size * probs.astype(np.float64)) ** (-beta)
    out: np.ndarray = (w / w.max()).astype(np.float32)
    return out


def greedy_return(net: nn.Module, env_seed: int, episodes: int) -> list[float]:
    """Return the undiscounted return of ``episodes`` greedy episodes of CartPole-v1."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    out = []
    for e in range(episodes):
        obs, _ = env.reset(seed=env_seed + e)
        total, over = 0.0, False
        while not over:
            with torch.no_grad():
                a = int(net(torch.from_numpy(obs)[None]).argmax(1))
            obs, r, term, trunc, _ = env.step(a)
            total += float(r)
            over = term or trunc
        out.append(total)
    env.close()
    return out
