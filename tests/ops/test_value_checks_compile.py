"""The value-check program compiles for real GPUs (sm_80, sm_90), checked on CPU with Triton's
CUDA backend and its bundled ptxas: one program serves every rule, dtype and layout (they are
values of a check's slot), so one compile per target covers them all, with the slot integers
32- or 64-bit as Triton types them from their values, and without register spills. Catches
what the interpreter cannot: the integer-to-pointer casts of every dtype branch, type
unification of the loop-carried lane state across the branches, the float64 bitcast of the
bound."""

from __future__ import annotations

import types

import pytest
from _fused_cases import HAS_TRITON
from test_fused_compile import _PTR_DIV16, _resources, needs_nvidia_backend

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

if HAS_TRITON:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from echoloss.ops.value_checks import fused


def _compiled(fn_obj):
    """A compiled-mode copy of the kernel and its JIT helpers (this folder may hold interpreter
    versions), sharing one namespace."""
    g = dict(getattr(fn_obj, "fn", fn_obj).__globals__)
    for name, value in list(vars(fused).items()):
        if type(value).__name__ in ("JITFunction", "InterpretedFunction") and name.startswith("_"):
            raw = getattr(value, "fn", value)
            g[name] = JITFunction(
                types.FunctionType(raw.__code__, g, raw.__name__, raw.__defaults__, raw.__closure__)
            )
    # triton.language's own combine functions (`_sum`, `_min`) read that module's globals:
    # their copies here are this module's same-bodied ones (`a + b`, `minimum`)
    g["_sum"], g["_min"] = g["_add"], g["_least"]
    return g[getattr(fn_obj, "fn", fn_obj).__name__]


def _compile(ints: str, arch: int):
    """The kernel with every slot integer of type ``ints`` except the addresses and bound
    (always 64-bit)."""
    kernel = _compiled(fused._value_checks_kernel)
    consts = {"BLOCK": fused.BLOCK}
    names = list(kernel.arg_names)
    wide = ("values", "rows", "bound")
    sig = {
        n: "constexpr"
        if n in consts
        else "*fp64"
        if n == "out"
        else "i64"
        if n.rstrip("0123456789") in wide
        else ints
        for n in names
    }
    assert len(names) == 2 + fused.SLOTS * len(fused._SLOT_ARGS)
    attrs = {(names.index("out"),): _PTR_DIV16}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": fused.NUM_WARPS, "enable_fp_fusion": True},
    )


@needs_nvidia_backend
@pytest.mark.parametrize("ints", ["i32", "i64"])
@pytest.mark.parametrize("arch", [80, 90])
def test_the_program_compiles(arch, ints):
    assert _compile(ints, arch).asm.get("cubin")


@needs_nvidia_backend
@pytest.mark.parametrize("arch", [80, 90])
def test_no_local_memory_spills(arch, tmp_path):
    usage = _resources(_compile("i64", arch).asm["cubin"], tmp_path)
    assert "LOCAL:0" in usage, usage
