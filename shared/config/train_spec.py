"""The ``train`` job spec: model, data, optimizer, schedule, strategy and its controls."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from shared.config.fields import (
    DATA_PATH_REF,
    LOSS_ENTRY_REF,
    MODEL_ENTRY_REF,
    ConfigModel,
    EntryName,
)


class MlpSpec(ConfigModel):
    """The built-in multilayer perceptron: Flatten, then Linear + ReLU per hidden width."""

    name: Literal["mlp"] = "mlp"
    hidden: list[Annotated[int, Field(ge=1, le=65536)]] = Field(
        default_factory=lambda: [128, 64], description="Hidden layer widths."
    )


class CnnSpec(ConfigModel):
    """The built-in CNN: two 3x3 conv layers with ReLU and max-pools, for 8x8 or 28x28 images."""

    name: Literal["cnn"] = "cnn"
    channels: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        default_factory=lambda: [16, 32], description="Channels of the two conv layers."
    )


class EntryModelSpec(ConfigModel):
    """A model built by an entry point the operator listed in ``allowed_models``.

    Written ``{entry: NAME, args: {...}}``; the coordinator and every worker look NAME up in
    their own ``allowed_models`` and check ``args`` against the factory's signature
    (``shared.training.entry_points``).
    """

    entry: EntryName = Field(
        description="Name of a model entry point in allowed_models of the coordinator and "
        "of the workers.",
        json_schema_extra=MODEL_ENTRY_REF,
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the entry point's factory."
    )


class EntryLossSpec(ConfigModel):
    """A loss built by an entry point the operator listed in ``allowed_losses``.

    Written ``{entry: NAME, args: {...}}``: the factory, called with ``args``, returns a
    callable ``loss(outputs, targets) -> [B]`` per-sample losses (the framework takes their
    mean); looked up and checked as model entries are (``shared.training.entry_points``).
    """

    entry: EntryName = Field(
        description="Name of a loss entry point in allowed_losses of the coordinator and "
        "of the workers.",
        json_schema_extra=LOSS_ENTRY_REF,
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the entry point's factory."
    )


class BuiltinData(ConfigModel):
    """A built-in data set: ``digits`` (scikit-learn's bundled 8x8 digits) or ``synthetic``."""

    name: Literal["digits", "synthetic"] = "digits"
    samples: int = Field(2000, ge=10, description="synthetic only: number of samples.")
    features: int = Field(64, ge=1, description="synthetic only: features per sample.")
    classes: int = Field(10, ge=2, description="synthetic only: number of classes.")

    @model_validator(mode="after")
    def _classes_fit(self) -> BuiltinData:
        if self.name == "synthetic" and self.classes > self.samples:
            raise ValueError(
                f"classes: {self.classes} is more than samples ({self.samples}); every class "
                "needs a sample"
            )
        return self


class FileData(ConfigModel):
    """A training set in an ``.npz`` file inside the coordinator's data roots."""

    path: str = Field(
        max_length=4096,
        description=".npz file with arrays x and y as the job's task needs them (see "
        "task), inside the coordinator's data_roots (relative: looked up in each root).",
        json_schema_extra=DATA_PATH_REF,
    )


class InitSpec(ConfigModel):
    """Where a train job's initial parameters come from: a saved model or an uploaded one.

    Written ``{job: ID}`` (that job's final model; ``best: true`` its best one), which the
    submitter must own (or be admin), or ``{dataset: NAME}``, a state dict uploaded with
    ``neuroshard data put W.pt --name NAME`` (stored as ``NAME.pt`` in the data roots).
    The state dict must fit the spec's model tensor for tensor, checked before the job is
    queued.
    """

    job: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Id of a finished train job whose saved model the parameters start from.",
    )
    dataset: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$",
        description="Name of an uploaded state dict (NAME.pt in the coordinator's data roots).",
    )
    best: bool = Field(
        False, description="job: start from its best model by test accuracy, not its final one."
    )

    @model_validator(mode="after")
    def _one_source(self) -> InitSpec:
        if (self.job is None) == (self.dataset is None):
            raise ValueError("give exactly one of job and dataset")
        if self.best and self.job is None:
            raise ValueError("best: only with job")
        return self


class OptimizerSpec(ConfigModel):
    """The optimizer: SGD (with momentum), Adam or AdamW (``torch.optim``)."""

    name: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(1e-3, gt=0, le=10, description="Peak learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd only.")
    weight_decay: float = Field(
        0.0, ge=0, le=1, description="L2 penalty (sgd, adam) or decoupled decay (adamw)."
    )


class LrScheduleSpec(ConfigModel):
    """The learning rate over the optimizer steps, after an optional linear warm-up.

    ``constant``: lr. ``cosine``: from lr down to ``lr * min_lr_factor`` over the remaining
    steps (Loshchilov & Hutter 2017, without restarts). ``linear``: from lr down to
    ``lr * min_lr_factor``. ``step``: lr times ``gamma`` every ``step_size`` steps. Warm-up
    rises linearly from ``lr / warmup_steps`` to lr (Goyal et al. 2017). Built from
    ``torch.optim.lr_scheduler`` and stepped once per optimizer step.
    """

    name: Literal["constant", "cosine", "linear", "step"] = "constant"
    warmup_steps: int = Field(0, ge=0, le=10_000_000, description="Linear warm-up, steps.")
    min_lr_factor: float = Field(
        0.0, ge=0, le=1, description="cosine, linear: the final lr as a fraction of lr."
    )
    step_size: int = Field(100, ge=1, description="step: optimizer steps between decays.")
    gamma: float = Field(0.1, gt=0, le=1, description="step: factor applied every step_size.")


class StragglerSpec(ConfigModel):
    """What a ``sync`` step does about workers slower than the others.

    The step deadline adapts: ``max(deadline_factor x median, median + 3 x 1.4826 x MAD)`` of
    the recent step times of the job's healthy workers, at most the coordinator's
    ``step_timeout_s`` (``coordinator.network.straggler.step_deadline_s``).
    """

    mode: Literal["wait", "backup", "drop"] = Field(
        "wait",
        description="wait: every piece of the step is waited for (up to step_timeout_s); "
        "backup: pieces still missing at the deadline are recomputed by workers that "
        "finished, the first answer wins (the step stays the full global batch); drop: at "
        "the deadline the step goes on with the pieces that arrived, reweighted by samples.",
    )
    deadline_factor: float = Field(
        2.0, gt=1, le=100, description="The deadline as a multiple of the median step time."
    )
    min_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="drop: the step goes on at the deadline only with at least this share "
        "of its samples (else it waits for more, up to step_timeout_s).",
    )


class CompressionSpec(ConfigModel):
    """Compression of the tensors a training step sends.

    ``sync`` and ``diloco``: gradients (pseudo-gradients) up and parameter deltas down are
    compressed with error feedback (``shared.training.compression``): ``fp16``, ``int8``
    (per-tensor scale), ``topk`` (the ``ratio`` largest magnitudes). ``allreduce``: torch's
    DDP communication hooks: ``fp16``, ``bf16`` (NCCL only), ``powersgd`` (rank ``rank``).
    """

    name: Literal["none", "fp16", "bf16", "int8", "topk", "powersgd"] = "none"
    ratio: float = Field(
        0.01, gt=0, le=1, description="topk: the fraction of each tensor's elements sent."
    )
    rank: int = Field(2, ge=1, le=64, description="powersgd: the low-rank approximation's rank.")


class SamplingSpec(ConfigModel):
    """Which rows each step trains on: the data order (``uniform``) or prioritized by loss.

    ``prioritized`` keeps one memory per training row in a table of the job's own (strength
    1 at the start); each step's global batch is drawn from it with P(i) = s_i^alpha /
    sum_j s_j^alpha (Schaul et al. 2016), every sample's loss weighted by (N P(i))^-beta /
    max over the batch, beta annealed linearly to ``beta_final``; the drawn rows' strengths
    are then set from their losses and every epoch decayed by ``decay_rate``
    (``coordinator.training.prioritized``; README "Prioritized training").
    """

    name: Literal["uniform", "prioritized"] = Field(
        "uniform",
        description="uniform: every shard's rows in the seeded data order (each row once an "
        "epoch); prioritized: each step's rows drawn from the job's priority table.",
    )
    alpha: float = Field(
        0.6,
        ge=0,
        allow_inf_nan=False,
        description="prioritized: the priority exponent, P(i) proportional to s_i^alpha "
        "(0: uniform over the rows of non-zero strength), finite and >= 0.",
    )
    beta: float = Field(
        0.4,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="prioritized: the importance-sampling exponent at the first step, in "
        "[0, 1] (0: no correction).",
    )
    beta_final: float = Field(
        1.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="prioritized: the exponent at the job's last step, reached linearly, "
        "in [0, 1].",
    )
    decay_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="prioritized: subtracted from every row's strength at each epoch end "
        "(the store's decay), in [0, 1]; a row decayed to 0 is not drawn again.",
    )
    priority: Literal["loss"] = Field(
        "loss",
        description="prioritized: what sets a drawn row's strength: loss, its per-sample "
        "loss mapped into [0, 1] by 0.01 + 0.99 (1 - exp(-loss / running mean loss)).",
    )
    resample_every_steps: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="diloco: inner steps whose rows are drawn at once, at the start of "
        "each window, a multiple of inner_steps; null: inner_steps (one draw per outer "
        "step). allreduce: steps whose rows are drawn at once (one generation each), cut at "
        "epoch ends; null: one epoch. sync draws every step.",
    )


_COMPRESSION_BY_STRATEGY = {
    "sync": ("none", "fp16", "int8", "topk"),
    "diloco": ("none", "fp16", "int8", "topk"),
    "allreduce": ("none", "fp16", "bf16", "powersgd"),
}


def _tag_by_name(default: str, alt_key: str) -> Discriminator:
    """A discriminator: a dict is tagged by its ``name`` key, or ``alt_key`` when present."""

    def tag(v: Any) -> str:
        if isinstance(v, dict):
            return alt_key if alt_key in v else str(v.get("name", default))
        return alt_key if getattr(v, "name", None) is None else str(v.name)

    return Discriminator(
        tag,
        custom_error_type="invalid_choice",
        custom_error_message=f"unknown name; expected one of the built-ins or {alt_key!r}",
    )


def _name_to_dict(v: Any) -> Any:
    """Accept the short form ``model: mlp`` for ``model: {name: mlp}``."""
    return {"name": v} if isinstance(v, str) else v


ModelField = Annotated[
    Annotated[MlpSpec, Tag("mlp")]
    | Annotated[CnnSpec, Tag("cnn")]
    | Annotated[EntryModelSpec, Tag("entry")],
    _tag_by_name("mlp", "entry"),
]
DataField = Annotated[
    Annotated[BuiltinData, Tag("digits")]
    | Annotated[BuiltinData, Tag("synthetic")]
    | Annotated[FileData, Tag("path")],
    _tag_by_name("digits", "path"),
]


class TrainJobSpec(ConfigModel):
    """A ``train`` job: a model trained on a data set by synchronous data parallelism.

    Each step every worker computes gradients on ``batch_size`` rows of its shard, and the
    parameter server averages them (weighted by rows) and steps the optimizer.
    """

    kind: Literal["train"] = Field(description="'train'.")
    name: str = Field("train", max_length=128, description="A label for people.")
    workers: int = Field(1, ge=1, le=1024, description="Workers the job needs.")
    model: ModelField = Field(
        default_factory=MlpSpec,
        description="'mlp', 'cnn', {name: mlp, hidden: [...]}, "
        "{name: cnn, channels: [...]} or {entry: NAME, args: {...}} (NAME listed in "
        "allowed_models).",
    )
    data: DataField = Field(
        default_factory=BuiltinData,
        description="'digits', 'synthetic', {name: ...} or {path: F.npz}.",
    )
    init: InitSpec | None = Field(
        None,
        description="{job: ID, best: false} or {dataset: NAME}: initial parameters and buffers "
        "from that job's saved model (yours, or any for admin) or an uploaded state dict "
        "NAME.pt; null: seeded by seed.",
    )
    task: Literal["classification", "regression", "language_model"] = Field(
        "classification",
        description="What is learnt (shared.training.tasks; arrays of any numeric dtype, "
        "converted a batch at a time): classification: x numbers, y integer labels, "
        "cross-entropy, accuracy; regression: x numbers, y numbers [N] or [N, D], mse or "
        "huber, MSE/MAE/R^2; language_model: x integer tokens [N, T], next-token "
        "cross-entropy over every position (targets x shifted by one unless y is given), "
        "perplexity and tokens/s.",
    )
    loss: Literal["default", "mse", "huber"] | EntryLossSpec = Field(
        "default",
        description="default: the task's loss (cross-entropy; regression: mse); mse or huber "
        "(regression); or {entry: NAME, args: {...}} (NAME listed in allowed_losses), a "
        "factory returning loss(outputs, targets) -> per-sample losses [B].",
    )
    vocab_size: int | None = Field(
        None,
        ge=2,
        le=16_777_216,
        description="language_model: the vocabulary size V (the model's output width; token "
        "ids must be < V); null: the largest token id + 1.",
    )
    optimizer: OptimizerSpec = Field(
        default_factory=OptimizerSpec,
        description="{name: sgd|adam|adamw, lr, momentum (sgd), weight_decay}.",
    )
    lr_schedule: LrScheduleSpec = Field(
        default_factory=LrScheduleSpec,
        description="{name: constant|cosine|linear|step, warmup_steps, min_lr_factor, "
        "step_size, gamma}.",
    )
    strategy: Literal["sync", "allreduce", "diloco"] = Field(
        "sync",
        description="sync: parameter server on the coordinator, gradients averaged every "
        "step. allreduce: the workers form a torch.distributed group and train with DDP. "
        "diloco: inner_steps local steps per worker, pseudo-gradients averaged, outer "
        "Nesterov step on the coordinator (Douillard et al. 2023).",
    )
    straggler: StragglerSpec = Field(
        default_factory=StragglerSpec,
        description="sync, diloco: {mode: wait|backup|drop, deadline_factor, min_fraction}.",
    )
    batch_policy: Literal["fixed", "proportional"] = Field(
        "fixed",
        description="sync, diloco: fixed: every worker computes batch_size rows a step; "
        "proportional: the global batch (workers x batch_size) is split by each worker's "
        "measured samples/s (transfer included).",
    )
    sampling: SamplingSpec = Field(
        default_factory=SamplingSpec,
        description="sync, diloco, allreduce (sharding none): 'uniform', 'prioritized' or "
        "{name: uniform|prioritized, alpha, beta, beta_final, decay_rate, priority: loss, "
        "resample_every_steps}: "
        "which rows each step trains on (README, Prioritized training).",
    )
    compression: CompressionSpec = Field(
        default_factory=CompressionSpec,
        description="{name: none|fp16|int8|topk (sync, diloco) or none|fp16|bf16|powersgd "
        "(allreduce), ratio, rank}.",
    )
    aggregation: Literal["mean", "trimmed_mean", "median"] = Field(
        "mean",
        description="sync, diloco: how the workers' gradients are combined: the "
        "sample-weighted mean, a coordinate-wise trimmed mean, or the coordinate-wise median.",
    )
    trim: float = Field(
        0.1,
        ge=0,
        lt=0.5,
        description="trimmed_mean: the share of values dropped at each end of every coordinate.",
    )
    max_grad_norm_ratio: float | None = Field(
        None,
        gt=1,
        description="sync, diloco: reject a worker's gradient whose L2 norm is more than this "
        "times the median of the step's norms, or less than the median over this; null: off.",
    )
    health_threshold: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="sync, diloco: a worker whose health score falls below this is excluded "
        "for probation_steps steps (0: never excluded); see the README for the formula.",
    )
    probation_steps: int = Field(
        20, ge=1, le=1_000_000, description="Steps an excluded worker sits out before a trial."
    )
    inner_steps: int = Field(
        10,
        ge=1,
        le=100_000,
        description="diloco: H, local (inner) optimizer steps per worker per outer step; the "
        "last outer step of an epoch may cover fewer.",
    )
    outer_lr: float = Field(0.7, gt=0, le=10, description="diloco: the outer Nesterov SGD lr.")
    outer_momentum: float = Field(
        0.9, ge=0, lt=1, description="diloco: the outer Nesterov SGD momentum."
    )
    min_workers: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="allreduce: fewest workers a generation may run with (default: workers).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="allreduce: torch.distributed backend; auto: nccl when the job trains "
        "on cuda, else gloo.",
    )
    collective_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="allreduce: a collective (or the rendezvous) waiting longer than this, "
        "seconds, ends the generation.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model trains; auto: cuda when every worker has it."
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Forward/backward under torch.autocast in this dtype (fp16 with a "
        "GradScaler); parameters and optimizer state stay float32.",
    )
    grad_accum_steps: int = Field(
        1,
        ge=1,
        le=1024,
        description="Mini-batches of batch_size per worker per optimizer step; the global "
        "batch is workers x batch_size x grad_accum_steps.",
    )
    clip_grad_norm: float | None = Field(
        None,
        gt=0,
        description="Clip the global gradient's L2 norm to this before each optimizer step; "
        "null: no clipping.",
    )
    sync_batchnorm: bool = Field(
        False,
        description="allreduce: BatchNorm statistics over the global batch "
        "(torch.nn.SyncBatchNorm on cuda, an all-reduce of sums on cpu).",
    )
    sharding: Literal["none", "fsdp"] = Field(
        "none",
        description="allreduce: none: every rank holds the whole model and optimizer state "
        "(DDP); fsdp: parameters, gradients and optimizer state are sharded across the ranks "
        "(torch FSDP2 fully_shard, each block of the model and the root), gathered to rank 0 "
        "for checkpoints.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each block's activations in the backward pass instead of "
        "keeping them (torch.utils.checkpoint, use_reentrant=False); the blocks are the "
        "model's `blocks` attribute or the children of an nn.Sequential.",
    )
    epochs: int | None = Field(
        None,
        ge=1,
        le=100000,
        description="Passes over the training split (default 10); paced: the most epochs "
        "that may be granted, and the horizon of the lr schedule.",
    )
    paced: bool = Field(
        False,
        description="Run one epoch per grant: the job waits at every epoch boundary (its "
        "first included) until its owner grants epochs (RunEpochs, DistributedLearner."
        "run_epoch) and ends SUCCEEDED on FinishJob or after its epochs; no time limit on "
        "the wait. Not with steps.",
    )
    steps: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Optimizer steps (diloco: inner steps per worker); overrides epochs.",
    )
    batch_size: int = Field(32, ge=1, le=65536, description="Samples per worker per step.")
    seed: int = Field(0, ge=0, description="Seeds model init, split and data order.")
    test_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="Held-out share of the data (unused when the data set has x_test).",
    )

    _strings = field_validator("model", "data", "sampling", mode="before")(
        classmethod(lambda cls, v: _name_to_dict(v))
    )

    @field_validator("model", mode="before")
    @classmethod
    def _no_import(cls, v: Any) -> Any:
        if isinstance(v, dict) and "import" in v:
            raise ValueError(
                "'import' is no longer accepted; name an entry point the operator listed in "
                "allowed_models: {entry: NAME, args: {...}}"
            )
        return v

    @model_validator(mode="after")
    def _epochs_or_steps(self) -> TrainJobSpec:
        if self.epochs is None and self.steps is None:
            self.epochs = 10
        if self.min_workers is None:
            self.min_workers = self.workers
        elif self.min_workers > self.workers:
            raise ValueError(
                f"min_workers: {self.min_workers} is more than workers ({self.workers})"
            )
        if self.sync_batchnorm and self.strategy != "allreduce":
            raise ValueError(
                "sync_batchnorm: needs strategy allreduce (with sync, the coordinator "
                "averages the workers' BatchNorm statistics instead)"
            )
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend: nccl needs device cuda (or auto), not cpu")
        allowed = _COMPRESSION_BY_STRATEGY[self.strategy]
        if self.compression.name not in allowed:
            raise ValueError(
                f"compression.name: {self.compression.name!r} is not available with strategy "
                f"{self.strategy} (expected one of {', '.join(allowed)})"
            )
        if self.paced and self.steps is not None:
            raise ValueError(
                "paced: a paced job runs whole epochs; give epochs (the most it may be "
                "granted), not steps"
            )
        self._diloco_controls()
        self._sampling_controls()
        self._sharding_controls()
        self._task_fields()
        return self

    def _sharding_controls(self) -> None:
        """Refuse what ``sharding: fsdp`` does not do, naming the field.

        FSDP shards the replicas of the workers' process group, which only ``allreduce``
        has. DDP's communication hooks (the allreduce compressions) do not exist for FSDP's
        reduce-scatter, and fp16's GradScaler would see only its rank's shard of the
        gradients when it looks for inf/NaN.
        """
        if self.sharding == "none":
            return
        if self.strategy != "allreduce":
            raise ValueError(
                f"sharding: fsdp needs strategy allreduce, not {self.strategy} (sync and "
                "diloco keep the whole model on the coordinator)"
            )
        if self.compression.name != "none":
            raise ValueError(
                f"compression.name: {self.compression.name!r} is not available with sharding "
                "fsdp (DDP communication hooks only; use none)"
            )
        if self.precision == "fp16":
            raise ValueError("precision: fp16 is not available with sharding fsdp (use bf16)")

    def _sampling_controls(self) -> None:
        """Refuse what ``sampling: prioritized`` does not do, naming the field.

        sync draws each step's batch, so a window is for diloco and allreduce only; diloco's
        must cover whole outer steps (the rows of an outer step are sent with its call, its
        losses come back at its end). allreduce with sharding fsdp is not supported: its
        ranks' shards do not outlive a generation, so each window would gather the state.
        """
        sampling = self.sampling
        if sampling.name == "uniform":
            return
        if self.strategy == "allreduce" and self.sharding == "fsdp":
            raise ValueError(
                "sampling.name: prioritized is not supported with sharding fsdp (use "
                "sharding none, or sampling uniform)"
            )
        every = sampling.resample_every_steps
        if every is None:
            return
        if self.strategy == "sync":
            raise ValueError(
                "sampling.resample_every_steps: only for strategy diloco or allreduce (sync "
                "draws every step's batch)"
            )
        if self.strategy == "diloco" and every % self.inner_steps:
            raise ValueError(
                f"sampling.resample_every_steps: {every} is not a multiple of inner_steps "
                f"({self.inner_steps}): a window covers whole outer steps"
            )

    def _task_fields(self) -> None:
        """Refuse fields that do not go with the job's task, naming them."""
        if self.loss in ("mse", "huber") and self.task != "regression":
            raise ValueError(f"loss: {self.loss} needs task regression, not {self.task}")
        if self.vocab_size is not None and self.task != "language_model":
            raise ValueError(f"vocab_size: needs task language_model, not {self.task}")
        if self.task != "classification" and isinstance(self.data, BuiltinData):
            raise ValueError(
                f"data: the built-in sets are classification data; task {self.task} needs "
                "{path: F.npz}"
            )

    def _diloco_controls(self) -> None:
        """Refuse what ``strategy: diloco`` does not do, naming the field.

        fp16 needs a loss scale kept across a worker's local steps (a GradScaler per worker),
        which the outer step cannot use; bf16 and fp32 need none.
        """
        if self.strategy == "diloco" and self.precision == "fp16":
            raise ValueError(
                "precision: fp16 is not available with strategy diloco (use bf16 or fp32)"
            )
