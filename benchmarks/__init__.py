"""echoloss kernel benchmarks: one harness, correctness-gated, results as JSON lines.

Run from the repository root: ``python -m benchmarks --device cpu --quick --output DIR``
(``--help`` for everything). ``docs/benchmarks.md`` describes the method, the schema and the
measured results.

Modules: :mod:`benchmarks.workload` (the loss step every provider computes),
:mod:`benchmarks.providers` (naive PyTorch, echoloss reference / Triton / fused-linear,
``torch.compile``, TRL, Liger), :mod:`benchmarks.harness` (gate, timing, memory, floor, metadata),
:mod:`benchmarks.launch` (GPU launch-parameter sweep), :mod:`benchmarks.plot`, :mod:`benchmarks.cli`.
"""
