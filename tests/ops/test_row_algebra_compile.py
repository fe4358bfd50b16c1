"""The fused row-algebra kernel compiles for real GPUs (sm_80, sm_90), checked on CPU with
Triton's CUDA backend and its bundled ptxas: every policy, with and without the optional
inputs, the value checks and the labels' range check, and no register spills."""

from __future__ import annotations

import itertools
import types

import pytest
from _fused_cases import HAS_TRITON
from test_fused_compile import _PTR_DIV16, _resources, needs_nvidia_backend

from echoloss.ops.row_algebra.policies import ROW_POLICIES

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

if HAS_TRITON:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from echoloss.ops.row_algebra import STAT_SLOTS, fused

TYPES = {
    "LP": "*fp32",
    "ENT": "*fp32",
    "RL": "*u8",
    "ECHO": "*u8",
    "W": "*fp32",
    "ADV": "*fp32",
    "OLD": "*fp32",
    "LQ": "*fp32",
    "RL_DIV": "*fp32",
    "ECHO_DIV": "*fp32",
    "LABELS": "*i64",
    "ENV": "*i64",
    "GROUP": "*i32",
    "CNT_RL": "*i32",
    "CNT_Z": "*i32",
    "SEQS": "*i32",
    "REF": "*fp32",
    "SUM_IN": "*fp32",
    "A": "*fp32",
    "B": "*fp32",
    "LOSS": "*fp32",
    "STATS": "*fp32",
    "CHECKS": "*fp64",
    "n": "i32",
    **dict.fromkeys(
        [
            "adv_tau",
            "low",
            "high",
            "dual_c",
            "clamp",
            "kl_tau",
            "ent_coef",
            "rl_div_value",
            "echo_div_value",
            "z_eps",
            "mm_max",
            "mm_min",
            "kl_coef",
            "lp_tolerance",
        ],
        "fp32",
    ),
    "vocab": "i32",
    "adv_inner": "i32",
    "adv_s_outer": "i32",
    "adv_s_inner": "i32",
}
FLAGS = (
    "HAS_LOW",
    "DUAL",
    "HAS_CLAMP",
    "HAS_KL_TAU",
    "HAS_ENT",
    "TRAIN_ENT",
    "ENT_METRIC",
    "HAS_W",
    "HAS_ADV",
    "HAS_LQ",
    "CHECK",
    "LP_GIVEN",
    "CHECK_LABELS",
    "HAS_ENV",
    "SEQ",
    "HAS_MM_MIN",
    "HAS_KL_COEF",
)


def _compiled(fn_obj):
    """A compiled-mode copy of a kernel of ``fused.py`` and of every JIT helper of the module
    (this folder may hold interpreter versions), all sharing one namespace so that helpers
    calling helpers resolve to compiled ones."""
    g = dict(getattr(fn_obj, "fn", fn_obj).__globals__)

    def rebuild(obj):
        raw = getattr(obj, "fn", obj)
        fn = types.FunctionType(raw.__code__, g, raw.__name__, raw.__defaults__, raw.__closure__)
        return JITFunction(fn)

    for name, value in list(vars(fused).items()):
        if type(value).__name__ in ("JITFunction", "InterpretedFunction") and name.startswith("_"):
            g[name] = rebuild(value)
    g["_sum"], g["_max"], g["_min"] = g["_sum_local"], g["_max_local"], g["_min_local"]
    return g[getattr(fn_obj, "fn", fn_obj).__name__]


#: The sequence-groups program: its arguments' types.
GROUP_TYPES = {
    "SKEY": "*i64",
    "ORDER": "*i64",
    "RL": "*u8",
    "ECHO": "*u8",
    "OBS": "*u8",
    "GROUP": "*i32",
    "CNT_RL": "*i32",
    "CNT_Z": "*i32",
    "SEQS": "*i32",
    "LP": "*fp32",
    "OLD": "*fp32",
    "LQ": "*fp32",
    "ADV": "*fp32",
    "SUM_OUT": "*fp32",
    "n": "i32",
    "id_inner": "i32",
    "id_s_outer": "i32",
    "id_s_inner": "i32",
    "adv_inner": "i32",
    "adv_s_outer": "i32",
    "adv_s_inner": "i32",
    "adv_tau": "fp32",
    "clamp": "fp32",
    "mm_max": "fp32",
    "mm_min": "fp32",
}


def _compile(consts, arch, kernel_obj=None, types_=None):
    kernel = _compiled(fused._row_algebra_kernel if kernel_obj is None else kernel_obj)
    types_ = TYPES if types_ is None else types_
    names = list(kernel.arg_names)  # the kernel's own order
    assert set(names) == set(types_) | set(consts), set(names) ^ (set(types_) | set(consts))
    sig = {n: ("constexpr" if n in consts else types_[n]) for n in names}
    attrs = {(names.index(n),): _PTR_DIV16 for n in types_ if types_[n].startswith("*")}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": fused.NUM_WARPS, "enable_fp_fusion": True},
    )


#: The program's codes of the policies on the sequence's ratio (gspo, cispo_sequence,
#: sapo_sequence).
_SEQUENCE_RATIO_CODES = (5, 6, 8)


def _consts(policy, on, base=1, rl_div_mode=0, echo_mode=0, echo_div_mode=None):
    return {
        "POLICY": policy,
        **dict.fromkeys(FLAGS, on),
        "ADV_FLAT": not on,  # [B] advantages expanded over T: read through their strides
        "BASE": base,
        "RL_DIV_MODE": rl_div_mode,
        "ECHO_DIV_MODE": (1 if on else 0) if echo_div_mode is None else echo_div_mode,
        "RL_PER_SEQ": on,
        "ECHO_MODE": echo_mode,
        "MISMATCH": 1 if on else 0,
        "KL_EST": 3,
        "SEQ": on or policy in _SEQUENCE_RATIO_CODES,  # read: the sequences' sums
        "NUM_STATS": len(STAT_SLOTS),
        "BLOCK": fused.BLOCK,
    }


@needs_nvidia_backend
@pytest.mark.parametrize("arch", [80, 90])
def test_every_policy_compiles(arch):
    codes = sorted(fused._POLICY_CODE.values())  # every declared policy and sft
    assert codes == list(range(len(codes)))
    for policy, on in itertools.product(codes, [False, True]):
        assert _compile(_consts(policy, on), arch).asm.get("cubin")


@needs_nvidia_backend
def test_modes_compile_for_sm90():
    # Every pair of values of (ratio base, RL divisor mode, echo mode) in 16 compiles (all
    # 48 combinations took ~2 minutes with a cold Triton cache): each mode is its own
    # constexpr branch, so a mode that does not compile fails alone or with its partner
    for rl_div, echo in itertools.product(range(4), range(4)):
        base = (rl_div + echo) % 3  # with each rl_div (each echo) base takes all 3 values
        assert _compile(_consts(1, True, base, rl_div, echo), 90).asm.get("cubin")
    for echo, echo_div in itertools.product(range(4), range(3)):  # the echo divisor's sources
        assert _compile(_consts(1, True, 1, 2, echo, echo_div), 90).asm.get("cubin")


@needs_nvidia_backend
def test_corrections_compile_for_sm90():
    for policy, mismatch, kl_est in itertools.product((2, 5), range(5), range(1, 4)):
        consts = {**_consts(policy, True), "MISMATCH": mismatch, "KL_EST": kl_est}
        assert _compile(consts, 90).asm.get("cubin")


@needs_nvidia_backend
@pytest.mark.parametrize("arch", [80, 90])
def test_sequence_groups_program_compiles_without_spills(arch, tmp_path):
    for (on, base, token_mm), in_order in itertools.product(
        ((False, 0, 0), (True, 1, 1), (True, 0, 2), (True, 2, 0)), (False, True)
    ):
        consts = {
            "IN_ORDER": in_order,
            "ID_FLAT": not (in_order and on),  # in order, a [B, T] view read through strides
            "ADV_FLAT": not on,
            "HAS_OBS": on,
            "SUMS": on,
            "BASE": base,
            "HAS_LQ": on,
            "HAS_ADV": on,
            "TOKEN_MM": token_mm,
            "HAS_MM_MIN": on,
            "HAS_CLAMP": on,
            "BLOCK": fused.BLOCK,
        }
        compiled = _compile(consts, arch, fused._sequence_groups_kernel, GROUP_TYPES)
        assert "LOCAL:0" in _resources(compiled.asm["cubin"], tmp_path)


@needs_nvidia_backend
@pytest.mark.parametrize(
    "policy",
    [ROW_POLICIES[p].code for p in ("ppo_clip", "sapo_sequence")],
    ids=["ppo_clip", "sapo_sequence"],
)
@pytest.mark.parametrize("arch", [80, 90])
def test_no_local_memory_spills(arch, policy, tmp_path):
    usage = _resources(_compile(_consts(policy, True), arch).asm["cubin"], tmp_path)
    assert "LOCAL:0" in usage, usage
