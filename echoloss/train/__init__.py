"""The reference trainer ``echoloss-train``: on-policy RL + echo on a built-in tool environment.

A readable recipe, not a framework: `echoloss.train.recipe` has ``setup()`` (a run-state record)
and ``step()`` (nine numbered steps, one short function each); the training regimes are
`echoloss.train.regimes`, the research probes `echoloss.train.probes`, the environments
`echoloss.train.envs` (the `Env` protocol and the one registry table).
``import echoloss`` never imports this package (it needs the ``train`` extra: transformers,
tokenizers, matplotlib, tqdm). ``docs/trainer.md`` is the user's guide.
"""
