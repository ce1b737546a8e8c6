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
    """Return the markdown rows ``| key | default | description |`` of a model's fields.

    Args:
        model: a config or job spec model.
        prefix: prepended to every key (``tls.``).

    Returns:
        One row per field, in declaration order; a nested model's default is shown as a
        dict, a required field's as ``required``.
    """
    rows = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump()
        shown = "required" if field.is_required() else f"`{default!r}`"
        desc = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}{key}` | {shown} | {desc} |")
    return rows


def main() -> None:
    """Print the reference tables of every config model and job spec, as the README has them."""
    models: list[tuple[str, type[BaseModel]]] = [
        ("coordinator.yaml", CoordinatorConfig),
        ("worker.yaml", WorkerConfig),
        ("log (both)", LogConfig),
        ("tls (both)", TlsConfig),
        ("auth (both)", AuthConfig),
        ("job_retention (coordinator)", JobRetention),
        ("train job", TrainJobSpec),
        ("memory job", MemoryJobSpec),
    ]
    for title, model in models:
        print(f"#### {title}\n\n| key | default | meaning |\n|---|---|---|")
        print("\n".join(table(model)))
        print()


if __name__ == "__main__":
    main()
