"""The kernels compile for real GPUs, checked on CPU: Triton's CUDA backend and its bundled ptxas
run without a device. Catches what the interpreter cannot (type unification of loop-carried
values, constexpr branches, JIT-only semantics) and checks the generated code: 128-bit vector
loads/stores on contiguous rows and no register spills at the default launch parameters."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import types
from pathlib import Path

import pytest
from _fused_cases import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

if HAS_TRITON:
    import triton
    from triton.runtime.jit import JITFunction

    from echoloss.ops.selective_logprobs import fused

    #: The shipped launch parameters, read at import (the ops conftest lowers the blocks per test).
    DEFAULT_LAUNCH = dict(fused.LAUNCH)

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        _NVIDIA = (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()
    except ImportError:  # pragma: no cover - a Triton without these entry points
        _NVIDIA = False
else:  # pragma: no cover
    _NVIDIA = False

# ASTSource's signature/constexprs/attrs form is the one of Triton 3.9 (the version paired with
# torch 2.13); older releases spell the specialisation differently.
_TRITON_39 = HAS_TRITON and tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9)
needs_nvidia_backend = pytest.mark.skipif(
    not (_NVIDIA and _TRITON_39), reason="needs Triton >= 3.9 with its CUDA backend"
)

_PTR_DIV16 = [["tt.divisibility", 16]]


def _compiled_kernel(kernel):
    """A compiled-mode copy of ``kernel`` (the module may hold interpreter versions): same source,
    with the combine functions re-created as compiled JIT functions."""
    raw = getattr(kernel, "fn", kernel)
    g = dict(raw.__globals__)
    g["_max_combine"] = JITFunction(
        getattr(fused._max_combine_local, "fn", None) or fused._max_combine_local
    )
    g["_sum_combine"] = JITFunction(
        getattr(fused._sum_combine_local, "fn", None) or fused._sum_combine_local
    )
    fn = types.FunctionType(raw.__code__, g, raw.__name__, raw.__defaults__, raw.__closure__)
    return JITFunction(fn, do_not_specialize=["rows_per_batch"])


def _compile(kernel, types_, constexprs, *, div16, arch=90, warps=8):
    """``triton.compile`` as a launch would: pointers 16-byte aligned, ``div16`` ints multiples
    of 16 (Triton's default specialisation of sizes and strides)."""
    names = list(types_)
    sig = {n: ("constexpr" if n in constexprs else types_[n]) for n in names}
    attrs = {(names.index(n),): _PTR_DIV16 for n in names if types_[n].startswith("*")}
    attrs.update({(names.index(n),): _PTR_DIV16 for n in div16})
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(
        src, target=target, options={"num_warps": warps, "enable_fp_fusion": True}
    )


def _fwd_types(dt):
    return {
        "LOGPROB": "*fp32",
        "LSE": "*fp32",
        "ENTROPY": "*fp32",
        "LOGITS": f"*{dt}",
        "LABELS": "*i64",
        "ROWS": "*i64",
        "MASK": "*u8",
        "INV_T": "*fp32",
        "inv_t_scalar": "fp32",
        "n_cols": "i32",
        "rows_per_batch": "i32",
        "stride_b": "i32",
        "stride_t": "i32",
        "stride_v": "i32",
        "HAS_ROWS": "constexpr",
        "HAS_MASK": "constexpr",
        "PER_ROW_T": "constexpr",
        "NEED_ENTROPY": "constexpr",
        "WIDE_COLS": "constexpr",
        "BLOCK_V": "constexpr",
    }


def _bwd_types(dt):
    return {
        "DLOGITS": f"*{dt}",
        "LOGITS": f"*{dt}",
        "LABELS": "*i64",
        "SLOT": "*i32",
        "LSE": "*fp32",
        "GRAD_LP": "*fp32",
        "GRAD_ENT": "*fp32",
        "ENTROPY": "*fp32",
        "INV_T": "*fp32",
        "inv_t_scalar": "fp32",
        "n_cols": "i32",
        "rows_per_batch": "i32",
        "stride_b": "i32",
        "stride_t": "i32",
        "stride_v": "i32",
        "out_stride_b": "i32",
        "out_stride_t": "i32",
        "out_stride_v": "i32",
        "HAS_ENT": "constexpr",
        "PER_ROW_T": "constexpr",
        "WIDE_COLS": "constexpr",
        "ROUND_BF16_BY_BITS": "constexpr",
        "BLOCK_V": "constexpr",
        "TILE_V": "constexpr",
        "SLOT_IS_MASK": "constexpr",
        "SKIP_ZERO": "constexpr",
    }


_DIV = ["n_cols", "stride_b", "stride_t", "out_stride_b", "out_stride_t"]


def _resources(cubin: bytes, tmp_path) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists() and shutil.which("cuobjdump") is None:
        pytest.skip("cuobjdump not available")
    f = tmp_path / "k.cubin"
    f.write_bytes(cubin)
    exe = str(tool) if tool.exists() else "cuobjdump"
    return subprocess.run([exe, "-res-usage", str(f)], capture_output=True, text=True).stdout


@needs_nvidia_backend
@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
def test_every_variant_compiles_for_sm90(dt):
    fwd, bwd = (
        _compiled_kernel(fused._logprobs_fwd_kernel),
        _compiled_kernel(fused._logprobs_bwd_kernel),
    )
    for rows, mask, per_t, ent, wide in itertools.product([False, True], repeat=5):
        if rows and mask:
            continue  # the mask applies only to the all-rows grid
        consts = {
            "HAS_ROWS": rows,
            "HAS_MASK": mask,
            "PER_ROW_T": per_t,
            "NEED_ENTROPY": ent,
            "WIDE_COLS": wide,
        }
        k = _compile(
            fwd, _fwd_types(dt), {**consts, "stride_v": 1, "BLOCK_V": 4096}, div16=_DIV[:3]
        )
        assert k.asm.get("cubin")
    for per_t, ent, wide, slot_mode in itertools.product(
        [False, True], [False, True], [False, True], ["slots", "mask", "mask-skip-zero"]
    ):
        consts = {
            "HAS_ENT": ent,
            "PER_ROW_T": per_t,
            "WIDE_COLS": wide,
            "ROUND_BF16_BY_BITS": False,
            "SLOT_IS_MASK": slot_mode != "slots",
            "SKIP_ZERO": slot_mode == "mask-skip-zero",
        }
        consts.update(stride_v=1, out_stride_v=1, BLOCK_V=4096, TILE_V=16384)
        types_ = _bwd_types(dt) | ({} if slot_mode == "slots" else {"SLOT": "*u8"})
        k = _compile(bwd, types_, consts, div16=_DIV)
        assert k.asm.get("cubin")
    # The one-warp-per-row phase 1 of the launch table (V ≥ one_warp_from_v).
    for mask, ent in itertools.product([False, True], repeat=2):
        consts = {
            "HAS_ROWS": False,
            "HAS_MASK": mask,
            "PER_ROW_T": True,
            "NEED_ENTROPY": ent,
            "WIDE_COLS": False,
            "stride_v": 1,
            "BLOCK_V": DEFAULT_LAUNCH["one_warp_block"],
        }
        k = _compile(fwd, _fwd_types(dt), consts, div16=_DIV[:3], warps=1)
        assert k.asm.get("cubin")


@needs_nvidia_backend
@pytest.mark.parametrize("arch", [80, 90])
def test_contiguous_rows_vectorise_without_spills(arch, tmp_path):
    """bf16, contiguous rows, V a multiple of 16: 16-byte loads (and stores in backward), and no
    local-memory spills at the default ``LAUNCH`` block/warps."""
    fwd, bwd = (
        _compiled_kernel(fused._logprobs_fwd_kernel),
        _compiled_kernel(fused._logprobs_bwd_kernel),
    )
    consts = {
        "HAS_ROWS": False,
        "HAS_MASK": True,
        "PER_ROW_T": True,
        "NEED_ENTROPY": True,
        "WIDE_COLS": False,
    }
    consts.update(stride_v=1, BLOCK_V=DEFAULT_LAUNCH["fwd_block"])
    consts_fwd = dict(consts)
    kf = _compile(
        fwd,
        _fwd_types("bf16"),
        consts,
        div16=_DIV[:3],
        arch=arch,
        warps=DEFAULT_LAUNCH["fwd_warps"],
    )
    consts = {"HAS_ENT": True, "PER_ROW_T": True, "WIDE_COLS": False, "ROUND_BF16_BY_BITS": False}
    # The device path's launch: the row mask as slots, zero-coefficient rows skipped.
    consts.update(SLOT_IS_MASK=True, SKIP_ZERO=True)
    consts.update(
        stride_v=1,
        out_stride_v=1,
        BLOCK_V=DEFAULT_LAUNCH["bwd_block"],
        TILE_V=DEFAULT_LAUNCH["bwd_tile"],
    )
    kb = _compile(
        bwd,
        _bwd_types("bf16") | {"SLOT": "*u8"},
        consts,
        div16=_DIV,
        arch=arch,
        warps=DEFAULT_LAUNCH["bwd_warps"],
    )
    # The one-warp-per-row entry of the launch table (fused.forward_launch at large V).
    kw = _compile(
        fwd,
        _fwd_types("bf16"),
        {**consts_fwd, "BLOCK_V": DEFAULT_LAUNCH["one_warp_block"]},
        div16=_DIV[:3],
        arch=arch,
        warps=1,
    )
    assert re.search(r"ld\.global\S*\.v4\.b32", kw.asm["ptx"]), "one-warp loads are not 128-bit"
    assert re.search(r"ld\.global\S*\.v4\.b32", kf.asm["ptx"]), "forward loads are not 128-bit"
    assert re.search(r"ld\.global\S*\.v4\.b32", kb.asm["ptx"]), "backward loads are not 128-bit"
    assert re.search(r"st\.global\S*\.v4\.b32", kb.asm["ptx"]), "backward stores are not 128-bit"
    for k in (kf, kb, kw):
        usage = _resources(k.asm["cubin"], tmp_path)
        assert "LOCAL:0" in usage, usage


@needs_nvidia_backend
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize(("src", "dst"), [("bf16", "bf16"), ("fp32", "bf16"), ("fp16", "fp16")])
def test_fused_linear_scale_kernel_compiles_and_vectorises(arch, src, dst, tmp_path):
    """The fused-linear op's gradient product (``fused_linear/fused.py``) compiles for sm_80 and
    sm_90 at its shipped block, with 128-bit loads and stores and no register spills."""
    from echoloss.ops.fused_linear import fused as scale

    k = _compile(
        _compiled_kernel(scale._scaled_kernel),
        {"X": f"*{src}", "S": "*fp32", "Y": f"*{dst}", "n": "i32",
         "ROUND_BF16_BY_BITS": "constexpr", "BLOCK": "constexpr"},
        {"ROUND_BF16_BY_BITS": False, "BLOCK": scale.BLOCK},
        div16=["n"],
        arch=arch,
        warps=4,
    )  # fmt: skip
    ptx = k.asm["ptx"]
    assert re.search(r"ld\.global\S*\.v4\.b32", ptx), "loads are not 128-bit"
    assert re.search(r"st\.global\S*\.v4\.b32", ptx), "stores are not 128-bit"
    assert "LOCAL:0" in _resources(k.asm["cubin"], tmp_path)
