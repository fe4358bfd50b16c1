"""The reference trainer ``echoloss-train``: on-policy RL + echo on a built-in tool environment.

A readable recipe, not a framework: `echoloss.train.recipe` is one loop to read top to bottom.
``import echoloss`` never imports this package (it needs the ``train`` extra: transformers,
tokenizers, matplotlib, tqdm). ``docs/trainer.md`` is the user's guide.
"""
