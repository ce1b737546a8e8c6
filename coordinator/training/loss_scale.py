"""The dynamic loss scale of an fp16 ``sync`` job, kept by the parameter server.

In fp16 small gradients underflow to zero, so the loss is multiplied by a scale S before the
backward pass and the gradients divided by S after it (Micikevicius et al. 2018, "Mixed
Precision Training", section 3.2). With one optimizer (the coordinator's) and many backward
passes (one per shard, on the workers), the scale lives with the optimizer: every StepHeader
carries S, each worker scales its loss by S, unscales its gradients in float32 and reports
whether they are all finite, and the coordinator updates S as ``torch.amp.GradScaler.update``
does:

- a step where any shard's gradients are not finite is skipped (no optimizer step) and S is
  multiplied by ``backoff_factor``;
- after ``growth_interval`` finite steps in a row, S is multiplied by ``growth_factor``.

The defaults are GradScaler's (torch.amp.GradScaler, torch 2.13: init_scale 2**16, growth 2.0,
backoff 0.5, interval 2000).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScale:
    """GradScaler's scale-update rule, without tensors (the gradients are on the workers).

    Attributes:
        enabled: False (fp32, bf16): ``scale`` stays 1.0 and ``update`` does nothing.
        scale: S, the factor the workers multiply the loss by.
        growth_factor: S is multiplied by this after ``growth_interval`` finite steps.
        backoff_factor: S is multiplied by this after a non-finite step.
        growth_interval: finite steps in a row before S grows.
        growth_tracker: finite steps in a row since S last changed.
    """

    enabled: bool
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0

    def __post_init__(self) -> None:
        """A disabled scale is 1.0: workers then run the plain fp32 arithmetic."""
        if not self.enabled:
            self.scale = 1.0

    def update(self, finite: bool) -> None:
        """Update S after one step, as ``torch.amp.GradScaler.update``.

        Args:
            finite: every shard's unscaled gradients were finite at this step.
        """
        if not self.enabled:
            return
        if not finite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float | int]:
        """The scale and the tracker, for a checkpoint."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what ``state_dict`` returned.

        Raises:
            KeyError: a key is missing; TypeError/ValueError: a value is not a number.
        """
        if self.enabled:
            self.scale = float(state["scale"])
            self.growth_tracker = int(state["growth_tracker"])
