"""Print the configuration reference (markdown tables) from the pydantic models.

``python -m shared.config_doc`` regenerates the README's "Config reference" section; a unit
test checks the README mentions every field.
"""

from __future__ import annotations

from pydantic import BaseModel

from shared.config import (
    AuthConfig,
    CoordinatorConfig,
    JobRetention,
    LogConfig,
    MemoryJobSpec,
    TlsConfig,
    TrainJobSpec,
    WorkerConfig,
)


def table(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Markdown rows ``| key | default | description |`` of a model's fields."""
    rows = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        if field.default_factory is not None:
            default = field.default_factory()  # type: ignore[call-arg]
            default = default.model_dump() if isinstance(default, BaseModel) else default
        else:
            default = field.default
        shown = "required" if field.is_required() else f"`{default!r}`"
        desc = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}{key}` | {shown} | {desc} |")
    return rows


def main() -> None:
    """Print the reference tables of every config model."""
    for title, model in [
        ("coordinator.yaml", CoordinatorConfig),
        ("worker.yaml", WorkerConfig),
        ("log (both)", LogConfig),
        ("tls (both)", TlsConfig),
        ("auth (both)", AuthConfig),
        ("job_retention (coordinator)", JobRetention),
        ("train job", TrainJobSpec),
        ("memory job", MemoryJobSpec),
    ]:
        print(f"#### {title}\n\n| key | default | meaning |\n|---|---|---|")
        print("\n".join(table(model)))  # type: ignore[arg-type]
        print()


if __name__ == "__main__":
    main()
