"""``import echoloss`` stays cheap: no ``torch._dynamo``, no triton, no optional stack at import.

``torch._dynamo`` (and triton, which it imports) roughly doubles the cost of ``import echoloss``
over ``import torch``; the trainer's and adapters' stacks are optional extras. The cost itself is
measured by ``python -m benchmarks.import_time``, not here (timings in unit tests are noise)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echoloss._compile import compiler_disable

ROOT = Path(__file__).resolve().parents[1]
NEVER_AT_IMPORT = ("torch._dynamo", "torch._inductor", "triton")
#: optional stacks: not imported by echoloss (torch itself may import some, e.g. tqdm)
NOT_BY_ECHOLOSS = (
    "transformers",
    "tokenizers",
    "trl",
    "verifiers",
    "matplotlib",
    "tqdm",
)


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize(
    "code",
    [
        "import echoloss",
        # the public names resolve without loading the optional stacks either
        "import echoloss\nfor n in echoloss.__all__: getattr(echoloss, n)",
        "import echoloss.adapters, echoloss.io, echoloss.ops, echoloss.loss",
    ],
)
def test_import_loads_no_dynamo_triton_or_optional_stack(code):
    loaded = _modules_after(code)
    assert "echoloss" in loaded
    assert sorted(m for m in NEVER_AT_IMPORT if m in loaded) == []
    by_torch = _modules_after("import torch")
    assert sorted(m for m in NOT_BY_ECHOLOSS if m in loaded and m not in by_torch) == []


def test_compiler_disable_is_lazy_and_transparent():
    calls = []

    @compiler_disable
    def double(x: torch.Tensor) -> torch.Tensor:
        """Doubles."""
        calls.append(x)
        return 2 * x

    assert double.__name__ == "double" and double.__doc__ == "Doubles."
    assert double.__wrapped__ is not None
    assert torch.equal(double(torch.tensor([1.5])), torch.tensor([3.0]))
    assert len(calls) == 1


def test_compiler_disable_graph_breaks_like_torch_compiler_disable():
    """Under torch.compile the lazy wrapper behaves as ``torch.compiler.disable``: the caller is
    split into the same number of graphs with the same ops, the wrapped body never runs while
    compiling, and ``fullgraph=True`` refuses it."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    compiling: list[bool] = []

    def inner(x: torch.Tensor) -> torch.Tensor:
        compiling.append(torch.compiler.is_compiling())
        return (x * 2).sin()

    counts = {}
    for name, wrapped in [
        ("lazy", compiler_disable(inner)),
        ("torch", torch.compiler.disable(inner)),
    ]:
        torch._dynamo.reset()
        compiling.clear()
        counter = CompileCounter()

        def outer(x: torch.Tensor, f=wrapped) -> torch.Tensor:
            return f(x + 1) * 3

        compiled = torch.compile(outer, backend=counter)
        for _ in range(2):
            torch.testing.assert_close(compiled(torch.ones(4)), outer(torch.ones(4)))
        counts[name] = (counter.frame_count, counter.op_count)
        assert compiling and not any(compiling), name
        with pytest.raises(Exception, match=r"(?i)disable"):
            torch._dynamo.reset()
            torch.compile(outer, backend="eager", fullgraph=True)(torch.ones(4))
    torch._dynamo.reset()
    assert counts["lazy"] == counts["torch"], counts
