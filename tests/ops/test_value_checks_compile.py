"""The value-check program compiles for real GPUs (sm_80, sm_90), checked on CPU with Triton's
CUDA backend and its bundled ptxas: every rule, with and without the row mask, for every dtype
a check reads and for 32- and 64-bit sizes and strides, without register spills. Catches what
the interpreter cannot: a compile-time constant where a size equals 1, type unification of the
loop-carried lane state, the float64 bitcast of the bound."""

from __future__ import annotations

import itertools
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

    from echoloss.ops.value_checks import RULES, fused

VALUE_TYPES = ("*fp32", "*bf16", "*fp16", "*fp64", "*i64", "*i32", "*u8")


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
    return g[getattr(fn_obj, "fn", fn_obj).__name__]


def _compile(values: str, rule: int, has_rows: bool, ints: str, arch: int, flat: bool = False):
    kernel = _compiled(fused._value_check_kernel)
    types_ = {
        "values": values,
        "rows": "*u8" if has_rows else "*fp64",
        "out": "*fp64",
        "n": "i32",
        "inner": ints,
        "stride_outer": ints,
        "stride_inner": ints,
        "bound_bits": "i64",
    }
    consts = {"RULE": rule, "HAS_ROWS": has_rows, "FLAT": flat, "BLOCK": fused.BLOCK}
    names = list(kernel.arg_names)
    assert set(names) == set(types_) | set(consts)
    sig = {n: ("constexpr" if n in consts else types_[n]) for n in names}
    attrs = {(names.index(n),): _PTR_DIV16 for n in types_ if types_[n].startswith("*")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": fused.NUM_WARPS, "enable_fp_fusion": True},
    )


@needs_nvidia_backend
@pytest.mark.parametrize("arch", [80, 90])
def test_every_rule_and_dtype_compiles(arch):
    for values, rule, has_rows in itertools.product(VALUE_TYPES, range(len(RULES)), [False, True]):
        assert _compile(values, rule, has_rows, "i32", arch).asm.get("cubin"), (values, rule)


@needs_nvidia_backend
def test_64_bit_strides_compile_for_sm90():
    for values, flat in itertools.product(("*fp32", "*bf16"), [False, True]):
        assert _compile(values, 0, True, "i64", 90, flat).asm.get("cubin")


@needs_nvidia_backend
@pytest.mark.parametrize("arch", [80, 90])
def test_no_local_memory_spills(arch, tmp_path):
    for flat in (False, True):
        usage = _resources(_compile("*fp64", 0, True, "i64", arch, flat).asm["cubin"], tmp_path)
        assert "LOCAL:0" in usage, usage
