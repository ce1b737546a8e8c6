"""examples.char_gpt: shapes, causality, and its entry point as the example configs list it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.char_gpt import CharGPT, char_gpt
from shared.config import CoordinatorConfig, EntryModelSpec, WorkerConfig, load_config
from shared.training.models import build_model

REPO = Path(__file__).resolve().parents[3]


def test_logits_have_one_row_per_position_and_vocabulary_entry() -> None:
    model = char_gpt(vocab=11, block=8, dim=16, heads=2, layers=2)

    out = model(torch.randint(0, 11, (3, 8)))

    assert out.shape == (3, 8, 11) and out.dtype == torch.float32


def test_a_position_depends_on_earlier_tokens_only() -> None:
    # Changing token 5 changes the logits at positions 5.. and leaves 0..4 as they were.
    torch.manual_seed(0)
    model = char_gpt(vocab=11, block=8, dim=16, heads=2, layers=2).eval()
    tokens = torch.randint(0, 11, (1, 8))
    changed = tokens.clone()
    changed[0, 5] = (tokens[0, 5] + 1) % 11

    with torch.no_grad():
        a, b = model(tokens), model(changed)

    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_a_sequence_longer_than_the_block_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than block 8"):
        char_gpt(vocab=11, block=8, dim=16, heads=2)(torch.zeros(1, 9, dtype=torch.int64))


def test_dim_must_be_a_multiple_of_heads() -> None:
    with pytest.raises(ValueError, match="dim 10 is not a multiple of heads 4"):
        char_gpt(dim=10, heads=4)


def test_the_example_configs_list_the_example_models_and_build_them() -> None:
    coordinator = load_config(CoordinatorConfig, REPO / "configs/examples/coordinator.yaml")
    worker = load_config(WorkerConfig, REPO / "configs/examples/worker.yaml")
    spec = EntryModelSpec(entry="char_gpt", args={"vocab": 97, "dim": 16, "heads": 2})

    model = build_model(spec, (64,), 97, seed=0, allowed_models=coordinator.allowed_models)

    assert coordinator.allowed_models == worker.allowed_models
    assert set(coordinator.allowed_models) == {"char_gpt", "resnet18"}
    assert isinstance(model, CharGPT) and len(model.blocks) == 2


def test_a_saved_model_loads_back_at_its_sizes_and_continues_a_prompt(tmp_path: Path) -> None:
    from examples.sample import load_char_gpt, sample

    torch.manual_seed(0)
    saved = char_gpt(vocab=97, block=8, dim=16, heads=2, layers=3)
    torch.save(saved.state_dict(), tmp_path / "gpt.pt")

    model = load_char_gpt(str(tmp_path / "gpt.pt"), heads=2)
    text = sample(model, "Hello", chars=12, seed=1)

    assert (model.block, len(model.blocks)) == (8, 3)
    assert text.startswith("Hello") and len(text) == 17
    assert text == sample(model, "Hello", chars=12, seed=1)  # seeded
