"""The README's examples: example models and the data preparation of their data sets.

The daemons never import this package; they build its models through an operator's
``allowed_models``, as any user's models.

- ``examples.char_gpt``: a character-level GPT (``char_gpt``), a small decoder-only
  transformer;
- ``examples.resnet``: ResNet-18 for 32x32 images (``resnet18``), torchvision's architecture
  and parameter names, written here;
- ``examples.prepare``: ``python -m examples.prepare`` writes the example data sets
  (``chars.npz`` from Debian's fortunes, ``digits32.npz``, ``diabetes.npz``);
- ``examples.debian_text``: fetches a Debian package's files without root;
- ``examples.sample``: ``python -m examples.sample MODEL.pt`` prints a trained GPT's text.

``configs/examples/coordinator.yaml`` and ``worker.yaml`` list the models for the daemons.
"""
