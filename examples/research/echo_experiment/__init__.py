"""The ECHO experiments of docs/experiment.md: their driver, statistics, figures and page blocks.

Research code beside the library, not part of the installed ``echoloss`` package: it drives the
reference trainer (``echoloss.train``) through its command line and reads what the runs write.
Run it with ``python examples/research/echo_experiment/run.py`` (see `run`).
"""
