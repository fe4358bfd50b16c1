"""The reference trainer ``echoloss-train``: on-policy RL + echo on a built-in tool environment.

A readable recipe, not a framework: `echoloss.train.recipe` has ``setup()`` (a run-state record)
and ``step()`` (nine numbered steps, one short function each); the training regimes are
`echoloss.train.regimes`, the evaluations `echoloss.train.probes`, the environments
`echoloss.train.envs` (the `Env` protocol, its optional capabilities and the one registry
table). The ECHO experiments that drive this trainer live beside the package, in
``examples/research/echo_experiment``.
``import echoloss`` never imports this package (it needs the ``train`` extra: transformers,
tokenizers, matplotlib, tqdm). ``docs/trainer.md`` is the user's guide.
"""
