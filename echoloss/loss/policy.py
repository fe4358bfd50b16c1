"""Policy-loss variants: one small function each, on the RL rows only (``[n]`` tensors).

Every function takes a [`PolicyInputs`][echoloss.loss.policy.PolicyInputs] and returns a [`PolicyOutput`][echoloss.loss.policy.PolicyOutput]: the per-token loss
before normalisation and boolean flags that the metrics report as fractions of RL tokens. Echo
rows never reach these functions. The derivative of each loss w.r.t. ``logprobs`` is written in
its docstring (the tests check it against autograd); ``docs/loss.md`` has the full table.

Notation: ``lp`` = trainer logprob (differentiable), ``lp_old`` = the ratio's denominator
(detached), ``ρ = lp - lp_old``, ``r = exp(ρ)``, ``A`` = advantage (already times ``adv_tau``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, TypeVar, overload

import torch

from echoloss._ratios import sapo_temperature_problem
from echoloss._registry import Registry
from echoloss.loss.inputs import LossInputs
from echoloss.ops.row_algebra.policies import ROW_POLICIES, RowArgs, RowPolicy, sequence_mean

__all__ = [
    "POLICIES",
    "PolicyFn",
    "PolicyInputs",
    "PolicyOutput",
    "PolicySpec",
    "RecordRows",
    "cispo_loss",
    "dppo_loss",
    "gspo_loss",
    "list_policies",
    "ppo_clip_loss",
    "register_policy",
    "reinforce_loss",
    "sapo_loss",
    "sequence_mean",
]

# `sequence_mean` is the row algebra's (imported above), kept here as it always was.


class PolicyInputs(NamedTuple):
    """What a policy loss sees: the RL rows only, compacted to ``n`` entries.

    Attributes:
        logprobs: ``[n]`` trainer logprobs at the sampling temperature (differentiable).
        old_logprobs: ``[n]`` the ratio's denominator, detached: ``old_logprobs`` given to
            [`echoloss.echo_loss`][echoloss.loss.echo_loss], else the current logprobs (detached) when a mismatch
            correction is on, else the inference logprobs (prime-rl).
        advantages: ``[n]`` advantages times ``adv_tau``.
        sequence_index: ``[n]`` int64 local sequence of each row in ``[0, num_sequences)``, or
            None when ``sequence_ids`` was not given.
        num_sequences: number of local sequences ``sequence_index`` refers to.
        rows: every per-token field of the call's `echoloss.LossInputs` on the RL rows, by
            name (``[n]`` each, compacted on first access; a field the call did not give is
            absent): a policy reads a new per-token input here, with no edit to the loss.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    sequence_index: torch.Tensor | None
    num_sequences: int
    rows: Mapping[str, torch.Tensor] = MappingProxyType({})


class RecordRows(Mapping[str, torch.Tensor]):
    """The per-token fields of a `LossInputs` on some rows, as a read-only mapping.

    Each field is compacted (``index_select``) on first access, so a policy pays only for the
    fields it reads.

    Examples:
        >>> x = LossInputs(rl_mask=torch.tensor([True, False, True]),
        ...                advantages=torch.tensor([1.0, 0.0, 3.0]))
        >>> rows = RecordRows(x, torch.tensor([0, 2]))
        >>> rows["advantages"].tolist(), sorted(rows)
        ([1.0, 3.0], ['advantages', 'rl_mask'])
    """

    def __init__(self, record: LossInputs, index: torch.Tensor) -> None:
        self._record = record
        self._index = index  # [n] int64 rows of the record
        self._given: tuple[str, ...] | None = None  # listed on first use: a policy that never
        self._cache: dict[str, torch.Tensor] = {}  # reads its rows pays nothing (and compiles)

    @property
    def _names(self) -> tuple[str, ...]:
        if self._given is None:
            names = ("rl_mask", *(f.name for f in self._record.per_token_fields()))
            self._given = tuple(n for n in names if getattr(self._record, n) is not None)
        return self._given

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(
                f"{name!r} is not a per-token field given to this call (given: "
                f"{', '.join(self._names)}); add it to the LossInputs record"
            )
        if name not in self._cache:
            flat = self._record.flat(name)
            assert flat is not None  # in self._names
            self._cache[name] = flat.index_select(0, self._index)  # [n]
        return self._cache[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class PolicyOutput(NamedTuple):
    """Result of a policy loss.

    Attributes:
        loss: ``[n]`` per-token loss, before normalisation.
        flags: name → ``[n]`` bool; each is reported as ``<name>_frac`` (count / RL tokens).
    """

    loss: torch.Tensor
    flags: dict[str, torch.Tensor]


#: A policy: ``fn(inputs, config) -> PolicyOutput``; ``config`` is the call's ``LossConfig``
#: (typed ``Any`` here so that this module does not import the config, which imports it).
PolicyFn = Callable[[PolicyInputs, Any], PolicyOutput]


class BuiltinPolicyParameters(Protocol):
    """The ``LossConfig`` attributes the built-in policies read (``LossConfig`` has them all)."""

    @property
    def dppo_low(self) -> float: ...
    @property
    def dppo_high(self) -> float: ...
    @property
    def dual_clip(self) -> float | None: ...
    @property
    def cispo_max(self) -> float: ...
    @property
    def cispo_min(self) -> float | None: ...
    @property
    def sapo_temperature_pos(self) -> float: ...
    @property
    def sapo_temperature_neg(self) -> float: ...
    @property
    def log_ratio_clamp(self) -> float | None: ...
    @property
    def resolved_eps(self) -> tuple[float, float]: ...
    def policy_parameter(self, name: str) -> float | None: ...


def _sequences(inputs: PolicyInputs, policy: str) -> tuple[torch.Tensor, int]:
    """``(sequence_index, num_sequences)``, which a sequence-level ratio needs."""
    if inputs.sequence_index is None:
        raise ValueError(
            f"policy={policy!r} needs sequence_ids: the ratio is a per-sequence mean; pass "
            "sequence_ids=[N] int64 (row -> sequence, -1 for padding) to echo_loss"
        )
    return inputs.sequence_index, inputs.num_sequences


def _row_form(name: str, inputs: PolicyInputs, args: RowArgs) -> PolicyOutput:
    """Built-in policy ``name``'s row form (`echoloss.ops.row_algebra.policies`, the definition
    the row program is tested against) on ``inputs``."""
    row = ROW_POLICIES[name]
    if row.sequence_ratio:
        args = args._replace(seq=_sequences(inputs, name))
    loss, flags = row.loss(inputs.logprobs, inputs.old_logprobs, inputs.advantages, args)
    return PolicyOutput(loss, flags)


def dppo_loss(
    inputs: PolicyInputs, *, low: float, high: float, log_ratio_clamp: float | None = None
) -> PolicyOutput:
    """prime-rl's default: a probability-difference trust region, tokens dropped (not clipped).

    ``δ = exp(lp) - exp(lp_old)``. A token with ``A > 0`` is dropped when ``δ > high``; any other
    token (``A <= 0``, so ``A == 0`` too) when ``δ < -low``. ``loss = -keep · A · r``;
    ``d loss / d lp = -keep · A · r``. (prime-rl's ``kl_tau · ρ^2`` is added by the caller on every
    RL token, dropped or not.)

    Args:
        inputs: the RL rows.
        low, high: trust-region half-widths in probability space.
        log_ratio_clamp: clamp of ``ρ`` before ``exp`` (None = none).

    Returns:
        [`PolicyOutput`][echoloss.loss.policy.PolicyOutput] with flags ``masked``, ``masked_low`` (``A < 0``) and ``masked_high``
        (``A > 0``); a dropped ``A == 0`` token is in ``masked`` only, as in prime-rl.

    Examples:
        >>> lp = torch.tensor([-1.0, -1.0], requires_grad=True)
        >>> x = PolicyInputs(lp, torch.tensor([-1.0, -3.0]), torch.tensor([1.0, 1.0]), None, 0)
        >>> out = dppo_loss(x, low=0.2, high=0.2)
        >>> out.loss  # the second token's probability rose by 0.32 > 0.2 with A > 0: dropped
        tensor([-1., -0.], grad_fn=<NegBackward0>)
        >>> out.flags["masked_high"].tolist()
        [False, True]
    """
    return _row_form("dppo", inputs, RowArgs(low, high, clamp=log_ratio_clamp))


def ppo_clip_loss(
    inputs: PolicyInputs,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> PolicyOutput:
    """PPO clip with asymmetric bounds and optional dual clip.

    ``loss = -min(r·A, clip(r, 1 - eps_low, 1 + eps_high)·A)``; with dual clip ``c`` and ``A < 0``
    the loss is at most ``-c·A``. ``d loss / d lp = -A·r`` where the unclipped branch is active,
    0 where a clip is.

    Args:
        inputs: the RL rows.
        eps_low, eps_high: the clip range ``[1 - eps_low, 1 + eps_high]``.
        dual_clip: constant ``c > 1`` or None.
        log_ratio_clamp: clamp of ``ρ`` before ``exp`` (None = none).

    Returns:
        [`PolicyOutput`][echoloss.loss.policy.PolicyOutput] with flags ``clipped``, ``clipped_low`` (``A < 0, r < 1 - eps_low``),
        ``clipped_high`` (``A > 0, r > 1 + eps_high``) and, with dual clip, ``dual_clipped``.

    Examples:
        >>> lp = torch.tensor([0.0, 0.0], requires_grad=True)
        >>> x = PolicyInputs(lp, torch.log(torch.tensor([1.0, 0.5])), torch.ones(2), None, 0)
        >>> ppo_clip_loss(x, eps_low=0.2, eps_high=0.2).loss  # r = 1, r = 2 clipped to 1.2
        tensor([-1.0000, -1.2000], grad_fn=<NegBackward0>)
    """
    return _row_form("ppo_clip", inputs, RowArgs(eps_low, eps_high, dual_clip, log_ratio_clamp))


def cispo_loss(
    inputs: PolicyInputs,
    *,
    weight_max: float,
    weight_min: float | None = None,
    log_ratio_clamp: float | None = None,
    sequence_level: bool = False,
) -> PolicyOutput:
    """CISPO: a clipped, detached importance weight times the REINFORCE term.

    ``loss = -sg(clamp(r, weight_min, weight_max)) · A · lp``; ``d loss / d lp = -w · A``: every
    token keeps a gradient (none is dropped). ``sequence_level``: the weight is of the
    sequence's ratio ``s_i = exp(mean_{t ∈ RL_i} ρ_t)`` for every RL token of sequence ``i``
    (TRL's ``cispo`` with ``importance_sampling_level="sequence"``); still detached, so the
    derivative stays ``-w_i · A``.

    Args:
        inputs: the RL rows (``sequence_index`` required with ``sequence_level``).
        weight_max: upper bound of the weight (``LossConfig.cispo_max``).
        weight_min: lower bound, or None.
        log_ratio_clamp: clamp of ``ρ`` (of the mean ``ρ`` at the sequence level) before
            ``exp`` (None = none).
        sequence_level: the sequence's ratio instead of the token's.

    Returns:
        [`PolicyOutput`][echoloss.loss.policy.PolicyOutput] with flags ``clipped``, ``clipped_low``, ``clipped_high`` (the
        weight hit a bound).

    Examples:
        >>> lp = torch.tensor([-1.0], requires_grad=True)
        >>> x = PolicyInputs(lp, torch.tensor([-1.0]), torch.tensor([2.0]), None, 0)
        >>> cispo_loss(x, weight_max=5.0).loss  # -1 · 2 · (-1)
        tensor([2.], grad_fn=<NegBackward0>)
    """
    name = "cispo_sequence" if sequence_level else "cispo"
    return _row_form(name, inputs, RowArgs(weight_min, weight_max, clamp=log_ratio_clamp))


def gspo_loss(
    inputs: PolicyInputs,
    *,
    eps_low: float,
    eps_high: float,
    log_ratio_clamp: float | None = None,
) -> PolicyOutput:
    """GSPO: PPO clip on the sequence-level ratio ``s_i = exp(mean_{t ∈ RL_i} ρ_t)``.

    Every RL token of sequence ``i`` gets ``-min(s_i·A_t, clip(s_i, 1 - eps_low, 1 + eps_high)·A_t)``.
    ``d loss / d lp_k = -Σ_{t ∈ RL_i} A_t · s_i / |RL_i|`` for ``k`` in sequence ``i`` while
    unclipped. The GSPO paper averages per sequence: pair it with
    ``rl_normalization="sequence_mean_token_mean"`` to reproduce it.

    Args:
        inputs: the RL rows; ``sequence_index`` is required.
        eps_low, eps_high: clip range of the sequence ratio.
        log_ratio_clamp: clamp of the mean log ratio before ``exp`` (None = none).

    Returns:
        [`PolicyOutput`][echoloss.loss.policy.PolicyOutput] with the ``clipped*`` flags of [`ppo_clip_loss`][echoloss.loss.policy.ppo_clip_loss], per token.

    Examples:
        >>> lp = torch.tensor([0.0, 0.0], requires_grad=True)
        >>> x = PolicyInputs(lp, torch.tensor([0.0, 0.0]), torch.ones(2), torch.tensor([0, 0]), 1)
        >>> gspo_loss(x, eps_low=3e-4, eps_high=4e-4).loss
        tensor([-1., -1.], grad_fn=<NegBackward0>)
    """
    return _row_form("gspo", inputs, RowArgs(eps_low, eps_high, clamp=log_ratio_clamp))


def sapo_loss(
    inputs: PolicyInputs,
    *,
    temperature_pos: float,
    temperature_neg: float,
    log_ratio_clamp: float | None = None,
    sequence_level: bool = False,
) -> PolicyOutput:
    """SAPO: a soft, sigmoid-gated trust region in place of the clip.

    ``loss = -σ(τ·(r - 1)) · 4/τ · A`` with ``τ = temperature_pos`` where ``A > 0`` and
    ``temperature_neg`` elsewhere (TRL's ``sapo``). The gate's slope at ``r = 1`` is 1, so near
    the old policy it is the plain policy gradient, and it decays smoothly as ``r`` leaves 1
    instead of dropping to 0 at a clip bound: ``d loss / d lp = -4·A·σ·(1 - σ)·r``.
    ``sequence_level``: ``r`` is the sequence's ratio ``s_i = exp(mean_{t ∈ RL_i} ρ_t)``
    (``importance_sampling_level="sequence"``) and the gradient flows through the mean:
    ``d loss / d lp_k = -Σ_{t ∈ RL_i} 4·A_t·σ_t·(1 - σ_t) · s_i / |RL_i|`` ``σ·(1 - σ)·r`` is
    computed as ``exp(ρ - |z|) / (1 + exp(-|z|))²`` (``z = τ·(r - 1)``) where ``r`` can leave
    the float range (no ``log_ratio_clamp``, or one above ``log`` of the dtype's maximum):
    finite for every finite ``ρ``, 0 where the gate is saturated.

    Args:
        inputs: the RL rows (``sequence_index`` required with ``sequence_level``).
        temperature_pos, temperature_neg: the gate's temperatures, in
            ``echoloss._ratios.SAPO_TEMPERATURE_RANGE`` (``[1e-6, 1e6]``).
        log_ratio_clamp: clamp of ``ρ`` (of the mean ``ρ`` at the sequence level) before
            ``exp`` (None = none).
        sequence_level: the sequence's ratio instead of the token's.

    Returns:
        [`PolicyOutput`][echoloss.loss.policy.PolicyOutput] without flags (nothing is clipped).

    Examples:
        >>> lp = torch.tensor([0.0, 0.0], requires_grad=True)
        >>> x = PolicyInputs(lp, torch.zeros(2), torch.tensor([1.0, -1.0]), None, 0)
        >>> sapo_loss(x, temperature_pos=1.0, temperature_neg=2.0).loss  # σ(0)·4/τ·A at r = 1
        tensor([-2.,  1.], grad_fn=<MulBackward0>)
    """
    name = "sapo_sequence" if sequence_level else "sapo"
    for arg, value in (("temperature_pos", temperature_pos), ("temperature_neg", temperature_neg)):
        bad = sapo_temperature_problem(arg, value)
        if bad is not None:
            raise ValueError(bad)
    args = RowArgs(temperature_neg, temperature_pos, clamp=log_ratio_clamp)
    return _row_form(name, inputs, args)


def reinforce_loss(inputs: PolicyInputs) -> PolicyOutput:
    """REINFORCE without a ratio: ``loss = -A · lp``; ``d loss / d lp = -A``.

    Examples:
        >>> lp = torch.tensor([-0.5], requires_grad=True)
        >>> reinforce_loss(PolicyInputs(lp, lp.detach(), torch.tensor([2.0]), None, 0)).loss
        tensor([1.], grad_fn=<NegBackward0>)
    """
    return _row_form("reinforce", inputs, RowArgs())


# ---------------------------------------------------------------- the registry


#: The ``LossConfig`` fields that parameterise one policy or another: those the built-in policies
#: read (`ROW_POLICIES`). A policy declares which of them it reads; ``LossConfig`` rejects a
#: non-default value of any other (it would be ignored).
POLICY_PARAMETERS: tuple[str, ...] = tuple(
    dict.fromkeys(name for row in ROW_POLICIES.values() for name in row.reads)
)


@dataclass(frozen=True)
class PolicySpec:
    """What a policy needs, declared once; the loss and ``LossConfig`` act on these declarations.

    Attributes:
        name: the value of ``LossConfig.policy``.
        fn: ``fn(PolicyInputs, LossConfig) -> PolicyOutput`` on the RL rows, or None for a
            function supplied per call (``policy="custom"`` with ``policy_fn=``).
        reads: the [`POLICY_PARAMETERS`][echoloss.loss.policy.POLICY_PARAMETERS] it reads (None = any: a caller-supplied function
            may read every field).
        uses_ratio: the loss is a function of ``lp - lp_old``: needs ``old_logprobs`` or
            ``inference_logprobs`` for the ratio's denominator.
        needs_sequences: needs ``sequence_ids`` (a per-sequence quantity).
        defaults: policy defaults of the ``LossConfig`` fields left as None (``kl_tau``,
            ``eps_low``, ``eps_high``).
        echo_safe: the function can be trusted next to echo rows it never sees (False for a
            caller-supplied function until ``allow_echo_with_custom_policy`` confirms it).
        all_rows: the function may be given every row at once instead of the RL rows
            compacted: rows that are not RL then carry log ratio 0 (``logprobs`` and
            ``old_logprobs`` both 0), advantage 0 and sequence ``num_sequences - 1`` (a
            padding sequence), and their outputs are discarded. True for the built-in
            policies; it lets the loss run without reading the number of RL rows on the host.
    """

    name: str
    fn: PolicyFn | None
    reads: tuple[str, ...] | None = ()
    uses_ratio: bool = True
    needs_sequences: bool = False
    defaults: Mapping[str, float] = field(default_factory=dict)
    echo_safe: bool = True
    all_rows: bool = False


_REGISTRY: Registry[PolicySpec] = Registry("policy", register_with="register_policy")
#: Read-only view of the registered policies, name → :class:`PolicySpec`.
POLICIES: Mapping[str, PolicySpec] = _REGISTRY.view

_Policy = TypeVar("_Policy", bound=PolicyFn)


@overload
def register_policy(
    name: str,
    fn: PolicyFn,
    *,
    reads: tuple[str, ...] = (),
    uses_ratio: bool = True,
    needs_sequences: bool = False,
    defaults: Mapping[str, float] | None = None,
    overwrite: bool = False,
    all_rows: bool = False,
) -> PolicySpec: ...


@overload
def register_policy(
    name: str,
    fn: None = None,
    *,
    reads: tuple[str, ...] = (),
    uses_ratio: bool = True,
    needs_sequences: bool = False,
    defaults: Mapping[str, float] | None = None,
    overwrite: bool = False,
    all_rows: bool = False,
) -> Callable[[_Policy], _Policy]: ...


def register_policy(
    name: str,
    fn: PolicyFn | None = None,
    *,
    reads: tuple[str, ...] = (),
    uses_ratio: bool = True,
    needs_sequences: bool = False,
    defaults: Mapping[str, float] | None = None,
    overwrite: bool = False,
    all_rows: bool = False,
) -> PolicySpec | Callable[[_Policy], _Policy]:
    """Make ``LossConfig(policy=name)`` use ``fn``: one function, one registration.

    Like every registry of echoloss (advantage functions, echo filters): a direct call
    ``register_policy(name, fn, ...)`` (returns the [`PolicySpec`][echoloss.loss.policy.PolicySpec]) or a decorator
    ``@register_policy(name, ...)`` (returns the function), one ``overwrite`` flag, and a listing
    ([`list_policies`][echoloss.loss.policy.list_policies]).

    ``fn(inputs, config)`` receives the RL rows only ([`PolicyInputs`][echoloss.loss.policy.PolicyInputs]) and returns the
    per-token loss before normalisation and optional flags ([`PolicyOutput`][echoloss.loss.policy.PolicyOutput]); the loss adds
    ``kl_tau``, the reference KL, the entropy bonus, the mismatch weight and the normaliser.

    Args:
        name: the policy's name (not already registered).
        fn: the policy function.
        reads: the [`POLICY_PARAMETERS`][echoloss.loss.policy.POLICY_PARAMETERS] of ``LossConfig`` it reads; any other set to a
            non-default value is rejected when the config is built.
        uses_ratio: whether it needs a ratio denominator (``old_logprobs`` or
            ``inference_logprobs``); False = on-policy functions of ``lp`` and ``A`` only.
        needs_sequences: whether it needs ``sequence_ids``.
        defaults: values of ``kl_tau`` / ``eps_low`` / ``eps_high`` when the config leaves them None.
        overwrite: replace a different policy registered earlier under ``name`` (registering
            the same function with the same declarations again is a no-op); the built-in
            policies cannot be replaced.
        all_rows: ``fn`` may receive every row, with neutral values on the rows that are not
            RL (see [`PolicySpec`][echoloss.loss.policy.PolicySpec]); False (the default) gives
            it the RL rows compacted, which costs one host sync per call on CUDA.

    Returns:
        The registered [`PolicySpec`][echoloss.loss.policy.PolicySpec]; without ``fn``, a
        decorator that registers the function and returns it unchanged.

    Examples:
        >>> import torch
        >>> from echoloss.loss import LossConfig, echo_loss_from_logprobs
        >>> def signed_nll(inputs, config):  # -sign(A) · lp
        ...     return PolicyOutput(-torch.sign(inputs.advantages) * inputs.logprobs, {})
        >>> _ = register_policy("signed_nll_doc", signed_nll, uses_ratio=False)
        >>> lp = torch.tensor([-0.5, -1.0], requires_grad=True)
        >>> x = LossInputs(rl_mask=torch.tensor([True, True]), advantages=torch.tensor([3.0, -2.0]))
        >>> out = echo_loss_from_logprobs(lp, x, config=LossConfig(policy="signed_nll_doc"))
        >>> out.loss
        tensor(-0.2500, grad_fn=<AddBackward0>)
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be an identifier-like str, got {name!r}")
    if fn is None:

        def decorate(policy: _Policy) -> _Policy:
            register_policy(
                name,
                policy,
                reads=reads,
                uses_ratio=uses_ratio,
                needs_sequences=needs_sequences,
                defaults=defaults,
                overwrite=overwrite,
                all_rows=all_rows,
            )
            return policy

        return decorate
    if not callable(fn):
        raise TypeError(f"fn must be callable fn(inputs, config) -> PolicyOutput, got {fn!r}")
    if isinstance(reads, str) or not isinstance(reads, (tuple, list)):
        raise TypeError(f"reads must be a tuple of LossConfig policy parameters, got {reads!r}")
    unknown = [r for r in reads if r not in POLICY_PARAMETERS]
    if unknown:
        raise ValueError(
            f"reads must name LossConfig policy parameters {POLICY_PARAMETERS}, got {unknown}"
        )
    flags = (
        ("uses_ratio", uses_ratio),
        ("needs_sequences", needs_sequences),
        ("all_rows", all_rows),
        ("overwrite", overwrite),
    )
    for flag, value in flags:
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, got {value!r}")
    spec = PolicySpec(
        name,
        fn,
        tuple(reads),
        uses_ratio=uses_ratio,
        needs_sequences=needs_sequences,
        defaults=MappingProxyType(_checked_defaults(defaults)),
        all_rows=bool(all_rows),
    )
    return _REGISTRY.register(name, spec, overwrite=overwrite)


def is_builtin_policy(name: str) -> bool:
    """Whether ``name`` is one of echoloss's own policies, whose derivative is finite wherever
    its loss is (tested at ratios past the float range); a registered or per-call policy's
    backward is checked by the loss (`LossConfig.check_finite`).

    Examples:
        >>> is_builtin_policy("sapo"), is_builtin_policy("custom")
        (True, True)
    """
    return _REGISTRY.is_builtin(name)


def list_policies() -> list[str]:
    """The names ``LossConfig.policy`` accepts, sorted.

    Examples:
        >>> [p for p in list_policies() if p in ("dppo", "gspo")]
        ['dppo', 'gspo']
    """
    return _REGISTRY.names()


#: The ``LossConfig`` fields a policy may default, and the range ``LossConfig`` accepts for each.
_DEFAULTABLE: dict[str, tuple[str, Callable[[float], bool]]] = {
    "kl_tau": ("≥ 0", lambda v: v >= 0),
    "eps_low": ("in [0, 1) (the clip's lower bound is 1 - eps_low)", lambda v: 0 <= v < 1),
    "eps_high": ("≥ 0", lambda v: v >= 0),
}


def _checked_defaults(defaults: Mapping[str, float] | None) -> dict[str, float]:
    """A policy's defaults, held to the rules ``LossConfig`` applies to the same fields."""
    if defaults is None:
        return {}
    if not isinstance(defaults, Mapping):
        raise TypeError(f"defaults must be a mapping of LossConfig fields, got {defaults!r}")
    out: dict[str, float] = {}
    for key, value in defaults.items():
        if key not in _DEFAULTABLE:
            raise ValueError(
                f"defaults[{key!r}]: a policy may default only {sorted(_DEFAULTABLE)} (the "
                "LossConfig fields left as None), got the key {key!r}"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"defaults[{key!r}] must be a float, got {value!r}")
        expected, ok = _DEFAULTABLE[key]
        if not (math.isfinite(value) and ok(value)):
            raise ValueError(f"defaults[{key!r}] must be finite and {expected}, got {value!r}")
        out[key] = float(value)
    return out


def check_policy_output(out: object, lp: torch.Tensor, name: str) -> PolicyOutput:
    """A policy's result, checked like ``LossConfig`` checks its inputs: a ``PolicyOutput`` whose
    loss is ``[n]`` float and connected to ``lp`` (when ``lp`` requires grad), and whose flags
    are ``[n]`` bool masks. No host read: every check is on metadata.

    Examples:
        >>> lp = torch.zeros(2, requires_grad=True)
        >>> check_policy_output(PolicyOutput(-lp.detach(), {}), lp, "mine")
        Traceback (most recent call last):
        ...
        ValueError: the loss of policy 'mine' must be connected to inputs.logprobs (it is detached, so the RL rows would get no gradient), got float32 [2] on cpu without grad_fn; compute it from inputs.logprobs without .detach() or torch.no_grad()
    """
    who = f"the output of policy {name!r}"
    if not isinstance(out, PolicyOutput):
        raise TypeError(
            f"{who} must be an echoloss.PolicyOutput(loss, flags), got {type(out).__name__}; "
            "return PolicyOutput(per_token_loss, {}) (a bare tensor has no flags)"
        )
    loss, flags = out
    if not isinstance(loss, torch.Tensor) or loss.shape != lp.shape:
        got = (
            f"{str(loss.dtype).removeprefix('torch.')} {list(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise ValueError(
            f"the loss of policy {name!r} must be a [n_rl] = {list(lp.shape)} tensor (one entry "
            f"per RL row), got {got}"
        )
    if not loss.dtype.is_floating_point:
        raise TypeError(f"the loss of policy {name!r} must be a float tensor, got {loss.dtype}")
    if lp.requires_grad and torch.is_grad_enabled() and not loss.requires_grad:
        raise ValueError(
            f"the loss of policy {name!r} must be connected to inputs.logprobs (it is detached, "
            f"so the RL rows would get no gradient), got {str(loss.dtype).removeprefix('torch.')} "
            f"{list(loss.shape)} on {loss.device} without grad_fn; compute it from "
            "inputs.logprobs without .detach() or torch.no_grad()"
        )
    if not isinstance(flags, Mapping):
        raise TypeError(f"the flags of policy {name!r} must be a dict name -> [n] bool tensor")
    for key, flag in flags.items():
        if not isinstance(key, str):
            raise TypeError(f"the flags of policy {name!r} must have str names, got {key!r}")
        if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool or flag.shape != lp.shape:
            raise ValueError(
                f"flag {key!r} of policy {name!r} must be a bool tensor of shape "
                f"[n_rl] = {list(lp.shape)} (one entry per RL row), got "
                + (
                    f"{str(flag.dtype).removeprefix('torch.')} {list(flag.shape)}"
                    if isinstance(flag, torch.Tensor)
                    else type(flag).__name__
                )
            )
    return out


def get_policy(name: str) -> PolicySpec:
    """The registered [`PolicySpec`][echoloss.loss.policy.PolicySpec] of ``name``.

    Examples:
        >>> get_policy("gspo").needs_sequences
        True
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(
            f"policy must be one of {list_policies()}, got {name!r}; register a new one with "
            "echoloss.loss.register_policy(name, fn)"
        )
    return spec


def _builtin(name: str, row: RowPolicy) -> PolicyFn:
    """The registered function of built-in policy ``name``: its row form with the bounds, dual
    clip and clamp the config sets (`RowPolicy.bounds`, `RowPolicy.reads`)."""

    def policy(inputs: PolicyInputs, config: BuiltinPolicyParameters) -> PolicyOutput:
        low, high = (None if b is None else config.policy_parameter(b) for b in row.bounds)
        dual_clip = config.dual_clip if "dual_clip" in row.reads else None
        return _row_form(name, inputs, RowArgs(low, high, dual_clip, config.log_ratio_clamp))

    policy.__name__ = policy.__qualname__ = name
    return policy


# Every built-in policy, from its one declaration.
for _name, _row in ROW_POLICIES.items():
    register_policy(
        _name,
        _builtin(_name, _row),
        reads=_row.reads,
        uses_ratio=_row.uses_ratio,
        needs_sequences=_row.sequence_ratio,
        defaults=_row.defaults,
        all_rows=True,
    )
# A function given per call as ``policy_fn=`` (kept for callers of the keyword form): it may read
# any field, and must confirm that it does not need the echo rows it never sees.
_REGISTRY.register(
    "custom", PolicySpec("custom", None, reads=None, uses_ratio=False, echo_safe=False)
)
_REGISTRY.freeze_builtins()
