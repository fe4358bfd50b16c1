"""The built-in policies of the row algebra, each declared once: its row form and its facts.

A policy is one `RowPolicy` of `ROW_POLICIES`: its per-row loss in PyTorch (`RowPolicy.loss`, the
definition: the gold of its branch of the Triton program, ``fused.py``, and the function the loss
registers under its name, ``echoloss.loss.policy``), the flags it reports, the ``LossConfig``
parameters it reads and the two of them the program reads as ``(low, high)``, whether its ratio
is the sequence's, its sequence-level sibling and the code of its branch of the program. What
else names the policies derives from this table: the op's `POLICIES` and flag names, the loss's
registry entries and the policies it runs fused or chunk by chunk, ``LossConfig``'s policy
parameters, the ``echoloss.nn`` modules' sequence-level mapping.

A row form takes what the program's branch takes: ``lp`` (the logprob, differentiable),
``base`` (the ratio's denominator, detached) and ``adv`` (the advantage times ``adv_tau``),
``[n]`` tensors on the same rows, and the scalars `RowArgs`; it returns ``(loss [n], flags)``,
the flags by name in the order the program counts them. Rows that are not RL may be passed with
neutral values (log ratio 0, advantage 0, the padding sequence): their outputs are discarded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import torch

from echoloss._ratios import exp_may_overflow, exp_ratio, sapo_gate

__all__ = [
    "ROW_POLICIES",
    "RowArgs",
    "RowLoss",
    "RowPolicy",
    "sequence_mean",
    "sequence_ratio",
]

Flags = dict[str, torch.Tensor]


class RowArgs(NamedTuple):
    """The scalars of a row form (the program's arguments of the same names).

    Attributes:
        low, high: the policy's bounds (`RowPolicy.bounds`); None = unread (``low`` of cispo:
            no lower bound).
        dual_clip: ppo_clip's dual-clip constant, or None.
        clamp: clamp of the log ratio (of the mean log ratio) before ``exp``; None = none.
        seq: ``(index [n], num)``, each row's sequence among ``num``, for a sequence-level
            ratio (None otherwise).
    """

    low: float | None = None
    high: float | None = None
    dual_clip: float | None = None
    clamp: float | None = None
    seq: tuple[torch.Tensor, int] | None = None


#: A policy's row form: ``(lp, base, adv, args) -> (loss, flags)``.
RowLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, RowArgs], tuple[torch.Tensor, Flags]]


@dataclass(frozen=True)
class RowPolicy:
    """One built-in policy (see the module docstring).

    Attributes:
        code: the row program's ``POLICY`` of its branch (``fused.py``; 4 is ``mode="sft"``).
        loss: its row form in PyTorch.
        flags: the flags it reports (``<flag>_frac``), in the order the program counts them
            (ppo_clip adds ``dual_clipped`` with a dual clip).
        reads: the ``LossConfig`` policy parameters it reads (``LossConfig`` rejects a
            non-default value of any other).
        bounds: the two parameters the program and the row form read as ``(low, high)``
            (None: unread).
        sequence_ratio: its ratio is the sequence's, ``exp(clamp(mean ρ))`` over its RL rows:
            it needs ``sequence_ids``, and a row's loss depends on the other rows of its
            sequence (it is not chunk-additive).
        sequence_level: the policy that is this one on the sequence's ratio, or None.
        uses_ratio: its loss is a function of ``lp - base`` (needs a ratio denominator).
        defaults: its defaults of the ``LossConfig`` fields left as None.
    """

    code: int
    loss: RowLoss
    flags: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    bounds: tuple[str | None, str | None] = (None, None)
    sequence_ratio: bool = False
    sequence_level: str | None = None
    uses_ratio: bool = True
    defaults: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))


def _clamped(x: torch.Tensor, clamp: float | None) -> torch.Tensor:
    return x if clamp is None else x.clamp(-clamp, clamp)


def _exp(x: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """``exp`` of a log ratio ``x`` clamped at ``clamp``, differentiable. Where it can overflow,
    `exp_ratio`: a flat objective's 0 gradient stays 0 (autograd's ``0·inf`` would be NaN);
    a clamp that keeps ``exp`` finite needs no guard (and no launches for it)."""
    return exp_ratio(x) if exp_may_overflow(clamp, x.dtype) else torch.exp(x)


def sequence_mean(values: torch.Tensor, index: torch.Tensor, num: int) -> torch.Tensor:
    """``[num]`` mean of ``values [n]`` per group ``index [n]`` (0 for an empty group).

    Examples:
        >>> sequence_mean(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]), 3)
        tensor([2., 5., 0.])
    """
    sums = values.new_zeros(num).index_add(0, index, values)
    # index_add of ones, not bincount: bincount reads the maximum index on the host.
    counts = values.new_zeros(num).index_add_(0, index, torch.ones_like(values))
    return sums / counts.clamp(min=1)


def sequence_ratio(log_ratio: torch.Tensor, args: RowArgs) -> torch.Tensor:
    """``[n]``: each row's ``s_i = exp(clamp(mean_{t ∈ i} ρ_t))`` of its sequence ``i``
    (``args.seq``; differentiable, the exponential taken once per sequence).

    Examples:
        >>> seq = (torch.tensor([0, 0, 1]), 2)
        >>> sequence_ratio(torch.tensor([0.0, 2.0, 0.0]), RowArgs(seq=seq)).tolist()
        [2.7182817459106445, 2.7182817459106445, 1.0]
    """
    assert args.seq is not None  # RowPolicy.sequence_ratio: the caller passes the sequences
    index, num = args.seq
    return _exp(_clamped(sequence_mean(log_ratio, index, num), args.clamp), args.clamp)[index]


def _log_ratio(
    lp: torch.Tensor, base: torch.Tensor, args: RowArgs, per_sequence: bool
) -> torch.Tensor:
    """``[n]``: each row's clamped log ratio (of its sequence's mean with ``per_sequence``)."""
    if per_sequence:
        assert args.seq is not None  # RowPolicy.sequence_ratio
        index, num = args.seq
        return _clamped(sequence_mean(lp - base, index, num), args.clamp)[index]
    return _clamped(lp - base, args.clamp)


def _ratio(lp: torch.Tensor, base: torch.Tensor, args: RowArgs, per_sequence: bool) -> torch.Tensor:
    if per_sequence:
        return sequence_ratio(lp - base, args)
    return _exp(_clamped(lp - base, args.clamp), args.clamp)


def _dppo(
    lp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, a: RowArgs
) -> tuple[torch.Tensor, Flags]:
    """prime-rl's trust region in probability space: a token outside it is dropped."""
    assert a.low is not None and a.high is not None  # RowPolicy.bounds
    with torch.no_grad():
        delta = lp.exp() - base.exp()
        pos = adv > 0
        dropped = torch.where(pos, delta > a.high, delta < -a.low)
        keep = ~dropped
    # The dropped branch sees log ratio 0 (a constant), so exp never overflows there.
    log_ratio = torch.where(keep, lp - base, torch.zeros_like(lp))
    loss = -(keep.to(lp.dtype) * adv * torch.exp(_clamped(log_ratio, a.clamp)))
    return loss, {
        "masked": dropped,
        "masked_low": dropped & (adv < 0),
        "masked_high": dropped & pos,
    }


def _clip_objective(
    ratio: torch.Tensor, adv: torch.Tensor, a: RowArgs
) -> tuple[torch.Tensor, Flags]:
    """``min(r·A, clip(r, 1 − low, 1 + high)·A)`` and the flags of the clip."""
    assert a.high is not None  # RowPolicy.bounds
    lo = 1.0 - (a.low or 0.0)
    obj = torch.minimum(ratio * adv, ratio.clamp(lo, 1.0 + a.high) * adv)
    with torch.no_grad():
        high = (adv > 0) & (ratio > 1.0 + a.high)
        low = (adv < 0) & (ratio < lo)
    return obj, {"clipped": high | low, "clipped_low": low, "clipped_high": high}


def _ppo_clip(
    lp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, a: RowArgs
) -> tuple[torch.Tensor, Flags]:
    """PPO's clipped objective on the token's ratio, with ``A < 0`` floored at ``dual_clip·A``."""
    obj, flags = _clip_objective(_ratio(lp, base, a, False), adv, a)
    if a.dual_clip is not None:
        neg = adv < 0
        floor = a.dual_clip * adv
        with torch.no_grad():
            flags["dual_clipped"] = neg & (obj < floor)
        obj = torch.where(neg, torch.maximum(obj, floor), obj)
    return -obj, flags


def _gspo(
    lp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, a: RowArgs
) -> tuple[torch.Tensor, Flags]:
    """ppo_clip's objective on the sequence's ratio."""
    obj, flags = _clip_objective(_ratio(lp, base, a, True), adv, a)
    return -obj, flags


def _cispo_weighted(
    lp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, a: RowArgs, per_sequence: bool
) -> tuple[torch.Tensor, Flags]:
    """A clipped, detached importance weight times the REINFORCE term."""
    assert a.high is not None  # RowPolicy.bounds
    with torch.no_grad():
        ratio = _ratio(lp, base, a, per_sequence)
        weight = ratio.clamp(min=a.low, max=a.high)
        high = ratio > a.high
        low = ratio < a.low if a.low is not None else torch.zeros_like(high)
    return -(weight * adv * lp), {"clipped": high | low, "clipped_low": low, "clipped_high": high}


def _cispo(
    lp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, a: RowArgs
) -> tuple[torch.Tensor, Flags]:
    """CISPO on the token's ratio."""
    return _cispo_weighted(lp, base, adv, a, False)


def _cispo_sequence(
    lp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, a: RowArgs
) -> tuple[torch.Tensor, Flags]:
    """CISPO on the sequence's ratio (still detached)."""
    return _cispo_weighted(lp, base, adv, a, True)


def _sapo_gated(
    lp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, a: RowArgs, per_sequence: bool
) -> tuple[torch.Tensor, Flags]:
    """``-σ(τ·(r − 1))·4/τ·A``, ``τ = high`` (τ⁺) where ``A > 0``, else ``low`` (τ⁻).

    Where ``r`` can leave the float range (no clamp, or one above ``log`` of the dtype's
    maximum) the gate is `sapo_gate`, whose derivative ``τ·σ(1 − σ)·r`` is
    ``τ·exp(ρ − |z|)/(1 + exp(−|z|))²``: finite, 0 where the gate saturates (autograd of the
    sigmoid gives ``0·inf = NaN`` there)."""
    assert a.low is not None and a.high is not None  # RowPolicy.bounds
    x = _log_ratio(lp, base, a, per_sequence)
    tau = torch.where(adv > 0, a.high, a.low)  # fp32
    if tau.dtype != x.dtype:  # τ in x's dtype: .to(fp64) of the fp32 τ would keep 1.05's rounding
        pos, neg = (torch.tensor(t, dtype=x.dtype) for t in (a.high, a.low))
        tau = torch.where(adv > 0, pos, neg)
    if exp_may_overflow(a.clamp, x.dtype):
        gate = sapo_gate(x, tau)
    else:  # a clamp keeps r finite: autograd's τ·σ(1 − σ)·r is finite (and costs fewer launches)
        gate = torch.sigmoid(tau * (torch.exp(x) - 1))
    return -(gate * (4 / tau)) * adv, {}


def _sapo(
    lp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, a: RowArgs
) -> tuple[torch.Tensor, Flags]:
    """SAPO's gate on the token's ratio."""
    return _sapo_gated(lp, base, adv, a, False)


def _sapo_sequence(
    lp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, a: RowArgs
) -> tuple[torch.Tensor, Flags]:
    """SAPO's gate on the sequence's ratio (the gradient flows through its mean)."""
    return _sapo_gated(lp, base, adv, a, True)


def _reinforce(
    lp: torch.Tensor, base: torch.Tensor, adv: torch.Tensor, a: RowArgs
) -> tuple[torch.Tensor, Flags]:
    """REINFORCE without a ratio: ``-A · lp``."""
    return -(adv * lp), {}


_CLIP_FLAGS = ("clipped", "clipped_low", "clipped_high")
_EPS = ("eps_low", "eps_high")
_CISPO = ("cispo_min", "cispo_max")
_SAPO = ("sapo_temperature_neg", "sapo_temperature_pos")

#: Every built-in policy, by the name ``LossConfig.policy`` takes.
ROW_POLICIES: Mapping[str, RowPolicy] = MappingProxyType(
    {
        "dppo": RowPolicy(
            0,
            _dppo,
            ("masked", "masked_low", "masked_high"),
            reads=("dppo_low", "dppo_high"),
            bounds=("dppo_low", "dppo_high"),
            defaults=MappingProxyType({"kl_tau": 1e-3}),
        ),
        "ppo_clip": RowPolicy(
            1,
            _ppo_clip,
            _CLIP_FLAGS,
            reads=(*_EPS, "dual_clip"),
            bounds=_EPS,
            sequence_level="gspo",
            defaults=MappingProxyType({"eps_low": 0.2, "eps_high": 0.2}),
        ),
        "cispo": RowPolicy(
            2,
            _cispo,
            _CLIP_FLAGS,
            reads=("cispo_max", "cispo_min"),
            bounds=_CISPO,
            sequence_level="cispo_sequence",
        ),
        "reinforce": RowPolicy(3, _reinforce, uses_ratio=False),
        "gspo": RowPolicy(
            5,
            _gspo,
            _CLIP_FLAGS,
            reads=_EPS,
            bounds=_EPS,
            sequence_ratio=True,
            defaults=MappingProxyType({"eps_low": 3e-4, "eps_high": 4e-4}),
        ),
        "cispo_sequence": RowPolicy(
            6,
            _cispo_sequence,
            _CLIP_FLAGS,
            reads=("cispo_max", "cispo_min"),
            bounds=_CISPO,
            sequence_ratio=True,
        ),
        "sapo": RowPolicy(
            7,
            _sapo,
            reads=_SAPO[::-1],
            bounds=_SAPO,
            sequence_level="sapo_sequence",
        ),
        "sapo_sequence": RowPolicy(
            8,
            _sapo_sequence,
            reads=_SAPO[::-1],
            bounds=_SAPO,
            sequence_ratio=True,
        ),
    }
)

#: The row program's code of ``mode="sft"`` (the NLL of the RL rows; not a policy).
SFT_CODE = 4
