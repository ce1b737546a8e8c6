"""Text from a trained character-level GPT: ``python -m examples.sample MODEL.pt``.

``MODEL.pt`` is a saved state dict of ``examples.char_gpt`` (``neuroshard model get JOB -o
MODEL.pt``), loaded with ``torch.load(weights_only=True)``; the model's sizes are read from
its tensors' shapes (``--heads`` cannot be, and must match the job's). Characters are drawn
one at a time from the softmax of the logits at the last position divided by
``--temperature``, the context cut to the model's block.
"""

from __future__ import annotations

import argparse
import sys

import torch

from examples.char_gpt import CharGPT
from examples.prepare import decode, encode


def load_char_gpt(path: str, heads: int = 4) -> CharGPT:
    """Build a ``CharGPT`` of the sizes a saved state dict has, and load it (eval mode).

    Raises:
        KeyError: the file is not a state dict of ``CharGPT``.
        RuntimeError: ``heads`` does not divide its width, or a tensor does not fit.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    vocab, dim = state["tok.weight"].shape
    block = state["pos.weight"].shape[0]
    layers = len({key.split(".")[1] for key in state if key.startswith("blocks.")})
    model = CharGPT(vocab, block, dim, heads, layers)
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def sample(model: CharGPT, prompt: str, chars: int, temperature: float = 0.8, seed: int = 0) -> str:
    """The prompt followed by ``chars`` characters drawn from the model.

    Args:
        model: a trained ``CharGPT`` in eval mode.
        prompt: the text to continue (at least one character).
        chars: how many characters to draw.
        temperature: > 0; lower is more conservative.
        seed: seeds the draws.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.from_numpy(encode(prompt)).unsqueeze(0)
    for _ in range(chars):
        logits = model(tokens[:, -model.block :])[0, -1] / temperature
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        tokens = torch.cat([tokens, nxt.unsqueeze(0)], dim=1)
    return decode(tokens[0].numpy())


def main(argv: list[str] | None = None) -> int:
    """Print a sample of the model's text."""
    p = argparse.ArgumentParser(prog="python -m examples.sample", description=__doc__)
    p.add_argument("model", help="a saved char_gpt state dict (neuroshard model get JOB -o F)")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a new line)")
    p.add_argument("--chars", type=int, default=300, help="characters to draw")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--heads", type=int, default=4, help="the job's model.args.heads")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    model = load_char_gpt(a.model, a.heads)
    print(sample(model, a.prompt, a.chars, a.temperature, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
