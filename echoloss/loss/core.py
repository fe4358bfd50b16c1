"""The loss entry points: ``L = L_RL(RL rows) + L_echo(echo rows)``, sharing one log-softmax.

Every entry point takes one `LossInputs` record and differs only in how it gets the
log-probabilities: [`echo_loss`][echoloss.loss.echo_loss] from logits (through
[`echoloss.ops.selective_logprobs`][echoloss.ops.selective_logprobs], participating rows only),
[`echo_loss_from_logprobs`][echoloss.loss.echo_loss_from_logprobs] from logprobs computed elsewhere,
and `echoloss.echo_loss_from_hidden` from hidden states and the LM head (`echoloss.loss.hidden`).
The entry points that score labels share one preamble (`start_scored_call`); everything after the
logprobs is `loss_from_logprobs`, which runs one of three forms of the same ``[N]`` algebra:

- the fused row program (`echoloss.loss.fused`, one Triton launch) where it applies;
- the PyTorch algebra (`echoloss.loss.algebra`), the definition the others are tested against;
- its compiled region (`echoloss.loss.compiled`) when turned on.

Value checks go through `echoloss.ops.value_checks.DeferredChecks` (raised at once on CPU, deferred on
CUDA: ``docs/loss.md``, "When a value error is raised"); what they say is
`echoloss.loss.diagnosis`.

The keyword form (``echo_loss(logits, labels, rl_mask=..., ...)``) takes the record's fields by
name (``**fields``) and builds the record with `LossInputs.from_keywords`: no entry point spells a
field, so a new field of the record is a new keyword of every entry point.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from echoloss._compile import compiler_disable
from echoloss._deferred import on_device_path, raise_deferred_errors
from echoloss._validate import check_per_token, check_tensor, describe, problem
from echoloss.loss.algebra import torch_algebra
from echoloss.loss.checks import check_config, check_requirements, resolve_inputs
from echoloss.loss.compiled import compiled_algebra, compiling
from echoloss.loss.config import LossConfig
from echoloss.loss.diagnosis import check_entropy
from echoloss.loss.fused import fused_algebra, fused_algebra_applies, fused_algebra_covers
from echoloss.loss.inputs import LossInputs
from echoloss.loss.normalization import (
    ECHO_DIVIDED,
    NO_DIVISORS,
    Divisors,
    Normalizers,
    checked_divisors,
)
from echoloss.loss.policy import PolicyFn, PolicySpec
from echoloss.ops.selective_logprobs import selective_logprobs
from echoloss.ops.selective_logprobs.op import (
    labels_checked_on_device,
    selective_logprobs_checked_by_caller,
)
from echoloss.ops.value_checks import DeferredChecks

__all__ = [
    "LossOutput",
    "ScoredCall",
    "echo_loss",
    "echo_loss_from_logprobs",
    "label_check_on_device",
    "logprobs_loss",
    "loss_from_logprobs",
    "row_temperature_and_entropy",
    "start_scored_call",
]


class LossOutput(NamedTuple):
    """Result of [`echo_loss`][echoloss.loss.echo_loss].

    Attributes:
        loss: 0-dim loss (RL term + echo term), connected to the graph even when no row
            participates (then exactly 0 with zero gradients).
        metrics: detached 0-dim fp32 tensors keyed ``<name>/all`` and ``<name>/<env>``; see
            ``docs/loss.md`` for the list.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def label_check_on_device(
    labels: Any, num_classes: int, device: torch.device
) -> tuple[torch.Tensor, int] | None:
    """The ``label_check`` of `loss_from_logprobs` for an entry point whose logprob op leaves
    the labels' range to the loss: ``(labels [N] int64, V)`` on the device path (the fused
    algebra checks them in its own launch, the PyTorch algebra queues the op's check; the op
    then queues none: about twenty launches fewer), None on the host path (the op checks them
    at once). Labels that are not a tensor are left to the op's error.

    Examples:
        >>> label_check_on_device(torch.tensor([1, 2]), 5, torch.device("cpu")) is None
        True
    """
    if not on_device_path(device) or not isinstance(labels, torch.Tensor):
        return None
    return labels.reshape(-1).long(), num_classes


def loss_from_logprobs(
    lp: torch.Tensor,
    ent: torch.Tensor | None,
    x: LossInputs,
    cfg: LossConfig,
    normalizers: Normalizers | None,
    policy_fn: PolicyFn | None,
    *,
    source: str,
    spec: PolicySpec | None = None,
    checks: DeferredChecks | None = None,
    divisors: Divisors = NO_DIVISORS,
    label_check: tuple[torch.Tensor, int] | None = None,
) -> LossOutput:
    """The loss algebra shared by every entry point, on ``[N]`` logprobs already scored.

    Every step works on ``[N]`` tensors with the RL and echo rows selected by mask arithmetic,
    so on the device path nothing is read back to the host (built-in policies; see
    ``echoloss/_deferred.py`` for when value errors are raised there).

    Args:
        lp: ``[N]`` logprobs (differentiable); rows that do not participate are never read.
        ent: ``[N]`` entropy or None.
        x: the validated record.
        cfg: the loss config.
        normalizers: global counts or None (this call is the whole batch).
        policy_fn: the per-call policy of ``policy="custom"``, else None.
        source: the argument the logprobs came from, for error messages.
        spec: the policy's spec when the requirements were already checked.
        checks: the call's value checks so far (submitted here); None = a new set.
        divisors: the caller's denominators of the two terms (`Divisors`), replacing the
            loss's own; each a Python float or a 0-dim fp32 tensor on ``lp``'s device.
        label_check: ``(labels [N], V)`` when the logprob op left the range check of the
            participating labels to this call (device path, fused algebra expected): the
            fused launch checks them; the PyTorch algebra queues the op's own check.

    Returns:
        [`LossOutput`][echoloss.loss.LossOutput].
    """
    checks = DeferredChecks(lp.device) if checks is None else checks
    divisors = checked_divisors(divisors, lp.device, checks)
    if divisors.echo is not None and cfg.echo_normalization not in ECHO_DIVIDED:
        raise ValueError(
            f"divisors.echo: replaces the divisor of echo_normalization {ECHO_DIVIDED}, got "
            f"echo_normalization={cfg.echo_normalization!r} (pass None)"
        )
    if spec is None:
        spec = check_requirements(x, cfg, policy_fn, checks)
    if fused_algebra_applies(lp, ent, x, cfg, normalizers, policy_fn):
        loss, metrics = fused_algebra(
            lp, ent, x, cfg, normalizers, source, checks, divisors, label_check
        )
    else:
        if label_check is not None and on_device_path(lp.device):
            labels_checked_on_device(label_check[0], x.rl | x.echo, label_check[1])
        algebra = torch_algebra
        if compiling() and on_device_path(lp.device):
            algebra = compiled_algebra()
        loss, metrics = algebra(
            lp, ent, x, cfg, normalizers, policy_fn, source, spec, checks, divisors
        )
    checks.submit()
    return LossOutput(loss, metrics)


def echo_loss_from_logprobs(
    logprobs: torch.Tensor,
    inputs: LossInputs | None = None,
    *,
    entropy: torch.Tensor | None = None,
    config: LossConfig | None = None,
    normalizers: Normalizers | None = None,
    policy_fn: PolicyFn | None = None,
    **fields: Any,
) -> LossOutput:
    """The loss of [`echo_loss`][echoloss.loss.echo_loss] from per-token logprobs (and entropy) computed elsewhere.

    ``logprobs`` must already be at the right temperature per row (sampling temperature on RL
    rows; see ``LossConfig.echo_temperature`` for echo rows): the record's ``labels`` and
    ``temperature`` are not read here. Values on rows that do not participate are never read.

    Args:
        logprobs: ``[N]`` float, differentiable.
        inputs: the per-token inputs (`echoloss.LossInputs`, shape ``[N]``).
        entropy: ``[N]`` per-token entropy: required when ``config.entropy_coef != 0``; used for
            the ``entropy`` metric when given.
        config, normalizers, policy_fn: as in [`echo_loss`][echoloss.loss.echo_loss].
        **fields: the keyword form, instead of ``inputs``: fields of `echoloss.LossInputs` by
            name (``rl_mask=``, ``advantages=``, ...).

    Returns:
        [`LossOutput`][echoloss.loss.LossOutput].

    Examples:
        >>> from echoloss.loss import LossInputs
        >>> lp = torch.tensor([-0.2, -0.4], requires_grad=True)
        >>> x = LossInputs(rl_mask=torch.tensor([True, False]), echo_weights=torch.tensor([0.0, 0.5]),
        ...                advantages=torch.tensor([1.0, 0.0]),
        ...                inference_logprobs=torch.tensor([-0.2, 0.0]))
        >>> out = echo_loss_from_logprobs(lp, x)
        >>> out.loss  # RL: -1·1·r(=1) / 1 token; echo: -0.5·(-0.4) / 1 token
        tensor(-0.8000, grad_fn=<AddBackward0>)
        >>> out.loss.backward(); lp.grad
        tensor([-1.0000, -0.5000])
    """
    raise_deferred_errors(block=False)
    return logprobs_loss(logprobs, inputs, entropy, config, normalizers, policy_fn, fields)


def logprobs_loss(
    logprobs: torch.Tensor,
    inputs: LossInputs | None,
    entropy: torch.Tensor | None,
    config: LossConfig | None,
    normalizers: Normalizers | None,
    policy_fn: PolicyFn | None,
    fields: dict[str, Any],
    *,
    checks: DeferredChecks | None = None,
    divisors: Divisors = NO_DIVISORS,
    label_check: tuple[torch.Tensor, int] | None = None,
) -> LossOutput:
    """The body of `echo_loss_from_logprobs`, for callers (the ``echoloss.nn`` modules) that
    bring their own value ``checks`` (checked before these, reported in one submission), a
    caller's ``divisors`` or the ``label_check`` their logprob op left to the loss (see
    `loss_from_logprobs`)."""
    logprobs = check_tensor("logprobs", logprobs)
    if not logprobs.dtype.is_floating_point:
        raise TypeError(problem("logprobs", "a float tensor", describe(logprobs)))
    if isinstance(inputs, torch.Tensor):
        raise TypeError(problem("inputs", "an echoloss.LossInputs record", describe(inputs)))
    x = resolve_inputs(
        inputs, fields, shape=logprobs.shape, device=logprobs.device, source="logprobs"
    )
    cfg = check_config(config)
    checks = DeferredChecks(logprobs.device) if checks is None else checks
    ent = None
    if entropy is not None:
        ent = check_per_token("entropy", entropy, x.shape, x.device, "float").reshape(-1)  # [N]
        if cfg.check_finite:
            check_entropy(ent, x.rl, checks)
    return loss_from_logprobs(
        logprobs.reshape(-1),
        ent,
        x,
        cfg,
        normalizers,
        policy_fn,
        source="logprobs",
        checks=checks,
        divisors=divisors,
        label_check=label_check,
    )


def row_temperature_and_entropy(
    temperature: float | torch.Tensor,
    config: LossConfig,
    *,
    rl: torch.Tensor,
    echo: torch.Tensor,
    lead: torch.Size,
) -> tuple[float | torch.Tensor, bool]:
    """The temperature each row is scored at, and whether the entropy must be computed.

    Echo rows are scored at T = 1 unless ``config.echo_temperature == "sampling"``
    (``docs/loss.md``, "Echo temperature"); RL rows keep their sampling temperature. The entropy
    is needed when there are RL rows and it is reported or trained. Shared by every entry point
    that computes logprobs for the loss (logits, fused-linear).

    Args:
        temperature: a float, or ``lead``-shaped per-row temperatures (already checked).
        config: the loss config.
        rl: ``[N]`` bool RL rows (flat).
        echo: ``[N]`` bool echo rows (flat).
        lead: the leading (row) shape of the logits.

    Returns:
        ``(temperature, need_entropy)``; the temperature is ``lead``-shaped when echo rows
        change it, else as given. A scalar temperature becomes an fp64 tensor (every digit of a
        Python float kept; the op casts it to its compute dtype).

    Examples:
        >>> t, ent = row_temperature_and_entropy(
        ...     0.5, LossConfig(), rl=torch.tensor([True, False]),
        ...     echo=torch.tensor([False, True]), lead=torch.Size([2]))
        >>> t.tolist(), ent
        ([0.5, 1.0], True)
    """
    temp: float | torch.Tensor = temperature
    device_path = on_device_path(rl.device)
    # On the device path whether there are echo / RL rows is not read: the per-row
    # temperature is built whenever echo rows could change it, the entropy computed whenever
    # it is reported or trained.
    if config.echo_temperature == "one" and (device_path or bool(echo.any())):
        if isinstance(temperature, torch.Tensor):
            temp = temperature.reshape(-1).masked_fill(echo, 1.0).view(lead)
        elif float(temperature) != 1.0:
            full = torch.full(lead, float(temperature), dtype=torch.float64, device=rl.device)
            temp = full.view(-1).masked_fill_(echo, 1.0).view(lead)
    need_entropy = (device_path or bool(rl.any())) and (
        config.compute_entropy or config.entropy_coef != 0
    )
    return temp, need_entropy


class ScoredCall(NamedTuple):
    """What an entry point that scores labels knows before its logprobs (`start_scored_call`)."""

    x: LossInputs  # the call's record, checked against the scored tensor's rows
    labels: torch.Tensor  # x.labels (required)
    cfg: LossConfig
    checks: DeferredChecks  # the call's value checks, the requirements' queued
    spec: PolicySpec  # the policy's spec (its requirements checked)
    temperature: float | torch.Tensor  # each row's (`row_temperature_and_entropy`)
    need_entropy: bool


def start_scored_call(
    inputs: Any,
    fields: dict[str, Any],
    config: Any,
    policy_fn: PolicyFn | None,
    *,
    lead: torch.Size,
    device: torch.device,
    source: str,
    entry: str,
) -> ScoredCall:
    """The preamble of the entry points that score labels (`echo_loss` from ``logits``,
    ``echo_loss_from_hidden`` from ``hidden``): the record (``lead``-shaped, on ``device``,
    labels required), the config, the call's checks with the requirements queued, each row's
    temperature and whether the entropy is needed. ``entry`` names the entry point in errors.

    Examples:
        >>> call = start_scored_call(None, {"labels": torch.tensor([1]),
        ...                                 "rl_mask": torch.tensor([False])}, None, None,
        ...                          lead=torch.Size([1]), device=torch.device("cpu"),
        ...                          source="logits", entry="echo_loss")
        >>> call.cfg.policy, call.need_entropy
        ('dppo', False)
    """
    x = resolve_inputs(inputs, fields, shape=lead, device=device, source=source)
    if x.labels is None:
        raise ValueError(
            f"labels is required by {entry} ([N] int64, the token each {source} row predicts): "
            "set LossInputs(labels=...) (from_targets takes them from next_token_targets)"
        )
    cfg = check_config(config)
    checks = DeferredChecks(device)
    spec = check_requirements(x, cfg, policy_fn, checks)
    temp, need_ent = row_temperature_and_entropy(
        x.temperature, cfg, rl=x.rl, echo=x.echo, lead=lead
    )
    return ScoredCall(x, x.labels, cfg, checks, spec, temp, need_ent)


@compiler_disable
def echo_loss(
    logits: torch.Tensor,
    inputs: LossInputs | torch.Tensor | None = None,
    *,
    config: LossConfig | None = None,
    normalizers: Normalizers | None = None,
    backend: str = "auto",
    chunk_size: int | None = None,
    policy_fn: PolicyFn | None = None,
    **fields: Any,
) -> LossOutput:
    """RL loss on action rows plus echo cross-entropy on observation rows, from logits.

    ``loss = L_RL + L_echo``. ``L_RL`` is the configured policy loss (``config.policy``) over RL
    rows, plus ``kl_tau · ρ²``, the optional reference KL and entropy bonus, normalised by
    ``config.rl_normalization``. ``L_echo = Σ_{echo rows} w_t · (-log p_t)`` normalised by
    ``config.echo_normalization``: no importance ratio, trust region, KL, advantage or
    ``adv_tau``, so ``d loss / d log p_t = -w_t / N_echo`` under the default normaliser. Both terms
    share one chunked log-softmax ([`echoloss.selective_logprobs`][echoloss.ops.selective_logprobs]), computed only on rows that
    participate. ``docs/loss.md`` has every formula and decision.

    Two call forms, the same loss:

    - ``echo_loss(logits, inputs)`` with a `echoloss.LossInputs` record (built by
      ``LossInputs.from_targets(next_token_targets(batch))`` or by hand);
    - the keyword form ``echo_loss(logits, labels, rl_mask=..., echo_weights=..., ...)``: every
      field of the record by name (`LossInputs.from_keywords` builds the record), so every field
      the record gains is a keyword here too.

    Args:
        logits: ``[N, V]`` (or ``[B, T, V]``, then every per-token input is ``[B, T]``), any float
            dtype; logprobs are computed in fp32 (fp64 for fp64 logits).
        inputs: the per-token inputs (`echoloss.LossInputs`, ``labels`` required), or the
            labels tensor of the keyword form.
        config: [`echoloss.LossConfig`][echoloss.loss.config.LossConfig]; None = defaults (dppo, token means).
        normalizers: global counts ([`echoloss.Normalizers`][echoloss.loss.normalization.Normalizers]) of the optimiser step; None
            means "this call is the whole batch".
        backend: ``"auto"``, ``"reference"`` or ``"triton"`` (see [`echoloss.selective_logprobs`][echoloss.ops.selective_logprobs]).
        chunk_size: rows per chunk of the logprob computation (None = automatic).
        policy_fn: ``fn(PolicyInputs, LossConfig) -> PolicyOutput`` for ``policy="custom"``
            (or register it once with [`echoloss.loss.register_policy`][echoloss.loss.policy.register_policy]).
        **fields: the keyword form, instead of a record: fields of `echoloss.LossInputs` by
            name, with the same meaning and shapes.

    Returns:
        [`LossOutput`][echoloss.loss.LossOutput] ``(loss, metrics)``.

    Raises:
        TypeError, ValueError: on a bad input (the message names the argument and the fix), on
            echo rows with ``mode="sft"``, with a custom policy unless allowed, or on a
            participating row whose logprob is not finite (NaN/inf logits; ``check_finite``).

    Examples:
        Golden case B (logits chosen so that log p = [-0.2, -0.4]):

        >>> import torch
        >>> from echoloss.loss import LossConfig, LossInputs, Normalizers
        >>> lp = torch.tensor([-0.2, -0.4])
        >>> logits = torch.stack([lp, torch.log(-torch.expm1(lp))], 1).requires_grad_()
        >>> x = LossInputs(labels=torch.tensor([0, 0]), rl_mask=torch.tensor([True, True]),
        ...                echo_weights=torch.tensor([0.0, 2.0]), advantages=torch.tensor([1.0, 2.0]),
        ...                inference_logprobs=lp)
        >>> cfg = LossConfig(dppo_low=10, dppo_high=10, kl_tau=0)
        >>> out = echo_loss(logits, x, config=cfg, normalizers=Normalizers(rl_tokens=1, echo_tokens=4))
        >>> # RL rows: row 0 only (row 1 is echoed); echo_loss_scale 4 as in the golden case
        >>> round(out.loss.item(), 5)  # RL -1.0 + echo -(2·-0.4)/4 = 0.2
        -0.8
        >>> float(out.metrics["echo_tokens/all"])
        1.0
    """
    raise_deferred_errors(block=False)
    logits = check_tensor("logits", logits)
    if not logits.dtype.is_floating_point or logits.dim() not in (2, 3):
        raise TypeError(problem("logits", "a float tensor [N, V] or [B, T, V]", describe(logits)))
    lead = logits.shape[:-1]
    call = start_scored_call(
        inputs, fields, config, policy_fn, lead=lead, device=logits.device, source="logits",
        entry="echo_loss",
    )  # fmt: skip
    x, cfg, checks = call.x, call.cfg, call.checks
    # The fused algebra checks the labels' range in its own launch (about ten launches fewer).
    lp_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    fused = on_device_path(logits.device) and fused_algebra_covers(
        logits.device, lp_dtype, call.need_entropy, x, cfg, normalizers, policy_fn
    )
    op = selective_logprobs_checked_by_caller if fused else selective_logprobs
    with checks.collecting():  # the op's checks of labels and temperatures join the call's
        res = op(
            logits,
            call.labels,
            temperature=call.temperature,
            return_entropy=call.need_entropy,
            chunk_size=chunk_size,
            mask=(x.rl | x.echo).view(lead),
            backend=backend,
        )
    lp, ent = res if isinstance(res, tuple) else (res, None)
    lp = lp.reshape(-1)  # [N]
    ent = None if ent is None else ent.reshape(-1)  # [N]
    if ent is not None and cfg.entropy_coef == 0:
        ent = ent.detach()
    return loss_from_logprobs(
        lp,
        ent,
        x,
        cfg,
        normalizers,
        policy_fn,
        source="logits",
        spec=call.spec,
        checks=checks,
        label_check=(call.labels.reshape(-1), logits.shape[-1]) if fused else None,
    )
