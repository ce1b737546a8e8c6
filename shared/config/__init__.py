"""Typed configuration: daemon configs and job specs, loaded from YAML and validated.

Every model forbids unknown keys; a validation error is turned into one line that names the
field (``ConfigError``), which the CLI prints and the coordinator returns as INVALID_ARGUMENT.
Every field has a default and a description with its unit; ``shared.config_doc`` prints the
reference tables of the README from them.

One module per concern, every public name re-exported here (import from ``shared.config``):
``fields`` (base model, errors, markers, validators), ``daemons`` (CoordinatorConfig,
WorkerConfig and their sections), ``train_spec`` and ``memory_spec`` (the job kinds), and
``loading`` (YAML and JSON in, validated models out).
"""

from shared.config.daemons import (
    AuthConfig,
    CoordinatorConfig,
    JobRetention,
    LogConfig,
    TlsConfig,
    WorkerConfig,
)
from shared.config.fields import (
    DATA_PATH_REF,
    ENTRY_NAME_PATTERN,
    ENTRY_TABLE_KEY,
    ENTRY_TARGET_PATTERN,
    LOSS_ENTRY_REF,
    MODEL_ENTRY_REF,
    TRUST_KEY,
    ConfigError,
    check_entry_name,
    check_entry_target,
    format_validation_error,
    removed_key,
)
from shared.config.loading import (
    JobSpec,
    job_spec_from_json,
    load_config,
    load_yaml,
    parse_job_spec,
)
from shared.config.memory_spec import ACCESS_BYTES, MemoryJobSpec, TraceAccess, ZipfAccess
from shared.config.train_spec import (
    BuiltinData,
    CnnSpec,
    CompressionSpec,
    EntryLossSpec,
    EntryModelSpec,
    FileData,
    InitSpec,
    LrScheduleSpec,
    MlpSpec,
    OptimizerSpec,
    SamplingSpec,
    StragglerSpec,
    TrainJobSpec,
)

__all__ = [
    "ACCESS_BYTES",
    "DATA_PATH_REF",
    "ENTRY_NAME_PATTERN",
    "ENTRY_TABLE_KEY",
    "ENTRY_TARGET_PATTERN",
    "LOSS_ENTRY_REF",
    "MODEL_ENTRY_REF",
    "TRUST_KEY",
    "AuthConfig",
    "BuiltinData",
    "CnnSpec",
    "CompressionSpec",
    "ConfigError",
    "CoordinatorConfig",
    "EntryLossSpec",
    "EntryModelSpec",
    "FileData",
    "InitSpec",
    "JobRetention",
    "JobSpec",
    "LogConfig",
    "LrScheduleSpec",
    "MemoryJobSpec",
    "MlpSpec",
    "OptimizerSpec",
    "SamplingSpec",
    "StragglerSpec",
    "TlsConfig",
    "TraceAccess",
    "TrainJobSpec",
    "WorkerConfig",
    "ZipfAccess",
    "check_entry_name",
    "check_entry_target",
    "format_validation_error",
    "job_spec_from_json",
    "load_config",
    "load_yaml",
    "parse_job_spec",
    "removed_key",
]
