"""The loss's value checks and what it says when a value is not finite.

Three kinds, all queued on the call's `echoloss.ops.value_checks.DeferredChecks` (raised at once on the
host path, deferred on the device path) so that the PyTorch and the fused algebra report the same
errors in the same order:

- the scored rows (`check_scored_rows`): every RL or echo row's logprob finite (and ≤ 0 when the
  caller passed logprobs), naming the first bad row and its likely cause;
- per-row values the loss reads (`check_finite_rows`, `check_entropy`): a policy's per-token
  loss, the entropy;
- the final loss (`check_final_loss`, `defer_final_loss_check`): one ``isfinite`` of the 0-dim
  loss; only when it fails are the suspects read (`final_loss_message`), to name the input that
  most likely overflowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from echoloss._deferred import first_true, not_finite
from echoloss._validate import problem
from echoloss.loss.config import LossConfig
from echoloss.loss.inputs import LOGPROB_TOLERANCE, LossInputs
from echoloss.loss.normalization import NO_DIVISORS, Divisors
from echoloss.ops.value_checks import DeferredChecks

__all__ = ["ENTROPY_TOLERANCE", "NonFiniteLossError", "check_final_loss", "check_scored_rows"]


class NonFiniteLossError(ValueError):
    """The loss (or a participating row's logprob) is not finite: the message names the term or
    row, the likely input and the fix. A ``ValueError``, so callers catching bad input catch it;
    trainers catch this class to stop with the message instead of training on."""


_SOURCE_CAUSE = {
    "logits": "NaN or +inf in that row of the logits, or -inf at its label",
    "hidden": "NaN or inf in that row of hidden (or in the LM-head weight), or a logit of "
    "-inf at its label",
    "logprobs": "a NaN or infinite logprob",
    # EchoFusedLinearGRPOLoss: its own argument names (a NaN bias spoils every row, not _input)
    "_input": "NaN or inf in that row of _input, or in lin_weight or bias (the LM head: a NaN "
    "there spoils every row), or a logit of -inf at its label",
}


def scored_rows_message(source: str) -> Callable[[Sequence[float]], Exception | None]:
    """The error of `check_scored_rows` from its numbers ``(any bad, first bad row, bad rows,
    that row's logprob, whether it is an RL row)``."""

    def message(v: Sequence[float]) -> Exception | None:
        if not v[0]:
            return None
        r, kind, value = int(v[1]), ("an RL" if v[4] else "an echo"), v[3]
        if math.isfinite(value):  # a positive "logprob": a negative log-likelihood passed
            return ValueError(
                problem(
                    f"{source}[{r}]",
                    f"a log-probability ≤ 0 (up to {LOGPROB_TOLERANCE}) on {kind} row",
                    repr(round(value, 6)),
                    "pass log p, not the negative log-likelihood -log p",
                )
            )
        return NonFiniteLossError(
            problem(
                f"{source} row {r}",
                f"a finite log-probability on {kind} row",
                f"{value} ({int(v[2])} bad row(s); cause: {_SOURCE_CAUSE[source]})",
                "find where the model's output overflows (e.g. fp16 activations), or set "
                "LossConfig(check_finite=False) to skip this check",
            )
        )

    return message


def check_scored_rows(
    lp: torch.Tensor,
    rl: torch.Tensor,
    echo: torch.Tensor,
    source: str,
    checks: DeferredChecks | None = None,
) -> None:
    """O(N): every RL or echo row's logprob ``lp [N]`` is finite, else name the first bad row.

    A NaN or +inf anywhere in a row of logits makes its log-sum-exp, hence its logprob,
    non-finite, and -inf at the label gives -inf: one ``isfinite`` over the ``[N]`` logprobs
    catches all of them without reading the ``[N, V]`` logits again. Logprobs given by the
    caller (``source="logprobs"``) must also be ≤ 0 (up to ``LOGPROB_TOLERANCE``), like every
    other logprob input. On the device path the check runs there and the error is deferred
    (``echoloss/_deferred.py``); ``checks`` collects it with the call's other checks (None = its
    own, submitted here).

    Examples:
        >>> check_scored_rows(torch.tensor([-0.1, float("nan")]), torch.tensor([True, False]),
        ...                   torch.tensor([False, True]), "logits")
        Traceback (most recent call last):
        ...
        echoloss.loss.diagnosis.NonFiniteLossError: logits row 1 must be a finite log-probability on an echo row, got nan (1 bad row(s); cause: NaN or +inf in that row of the logits, or -inf at its label); ...
    """
    if lp.numel() == 0:
        return
    own = checks is None
    checks = DeferredChecks(lp.device) if checks is None else checks
    part = rl | echo  # [N] bool
    bad = part & not_finite(lp)  # [N] bool
    if source == "logprobs":
        bad = bad | (part & (lp > LOGPROB_TOLERANCE))  # [N] bool
    row = first_true(bad)  # 0-dim
    message = scored_rows_message(source)
    one = row.view(1)
    checks.add(
        [bad.any(), row, bad.sum(), lp.detach().index_select(0, one), rl.index_select(0, one)],
        message,
    )
    if own:
        checks.submit()


def _defer_first_bad_row(
    checks: DeferredChecks,
    bad: torch.Tensor,
    values: torch.Tensor,
    error: Callable[[int, float], Exception],
) -> None:
    """Queue ``error(row, value)`` for the first True row of ``bad [N] bool`` (on the device:
    no host read until the checks are read)."""
    row = first_true(bad)
    message = first_bad_row_message(error)
    checks.add([bad.any(), row, values.detach().index_select(0, row.view(1))], message)


def first_bad_row_message(
    error: Callable[[int, float], Exception],
) -> Callable[[Sequence[float]], Exception | None]:
    """The message of `_defer_first_bad_row` from ``(any bad, first bad row, its value)``."""

    def message(v: Sequence[float]) -> Exception | None:
        return error(int(v[1]), v[2]) if v[0] else None

    return message


def check_finite_rows(
    name: str, values: torch.Tensor, rows: torch.Tensor, why: str, checks: DeferredChecks
) -> None:
    """``values [N]`` finite on ``rows [N] bool`` (else name the first bad row)."""
    if values.numel() == 0:
        return
    error = not_finite_error(name, why)
    checks.add_rows(  # (bad, count, first row, its value): one launch on CUDA
        values, rows, "not_finite", lambda v: error(int(v[2]), v[3]) if v[0] else None
    )


def not_finite_error(name: str, why: str) -> Callable[[int, float], Exception]:
    """The error of `check_finite_rows` for ``(row, value)``."""
    return lambda row, value: ValueError(
        problem(
            f"{name} at row {row}",
            f"finite ({why})",
            f"{value}",
            "or set LossConfig(check_finite=False) to skip this check",
        )
    )


class _Suspects(NamedTuple):
    """What a non-finite term is diagnosed from (read only when the final check fails)."""

    x: LossInputs
    rl_idx: torch.Tensor
    echo_idx: torch.Tensor
    ent: torch.Tensor | None
    cfg: LossConfig
    divisors: Divisors = NO_DIVISORS  # the caller's divisors (device ones read only here)


def _largest(name: str, values: torch.Tensor | None, rows: torch.Tensor) -> tuple[float, str]:
    """``(max |value|, "name (largest |value| = v at row r)")`` over ``rows``; (0, "") if none."""
    if values is None or rows.numel() == 0:
        return 0.0, ""
    v = values.detach().reshape(-1).index_select(0, rows).double().abs()  # [n]
    k = int(v.nan_to_num(nan=math.inf).argmax())
    big = float(v[k])
    return (
        math.inf if math.isnan(big) else big
    ), f"{name} (largest |value| {big:.3g} at row {int(rows[k])})"


def _rl_suspects(s: _Suspects) -> list[tuple[float, str]]:
    cfg = s.cfg
    out = [_largest("advantages", s.x.advantages, s.rl_idx)]
    if cfg.adv_tau != 1.0:
        out.append((cfg.adv_tau, f"adv_tau={cfg.adv_tau:g}"))
    if cfg.resolved_kl_tau:
        out.append((cfg.resolved_kl_tau, f"kl_tau={cfg.resolved_kl_tau:g}"))
    if cfg.kl_coef:
        out.append((cfg.kl_coef, f"kl_coef={cfg.kl_coef:g}"))
    if cfg.entropy_coef:
        big, _ = _largest("entropy", s.ent, s.rl_idx)
        out.append((abs(cfg.entropy_coef) * max(big, 1.0), f"entropy_coef={cfg.entropy_coef:g}"))
    given = s.divisors.rl
    if isinstance(given, torch.Tensor):
        # The divisor the call used (a device tensor; read on the host only to build this error).
        d = float(given)
        what = f"{cfg.rl_normalization}'s divisor of this call: the batch's RL tokens per process"
        out.append((_inverse(d), f"the RL divisor {d:g} ({what})"))
    elif given is not None:  # a host divisor
        out.append((_inverse(given), f"the RL divisor {given:g} (Divisors.rl of this call)"))
    elif cfg.rl_normalization == "token_sum_constant" and given is None:
        c = cfg.rl_normalization_constant
        assert c is not None  # LossConfig
        out.append((1.0 / c, f"rl_normalization_constant={c:g} (the divisor)"))
    return [o for o in out if o[1]]


def _inverse(d: float) -> float:
    """``1/d`` as a suspect's weight; a divisor of 0 (or not finite) is the first suspect."""
    return 1.0 / d if d != 0 and math.isfinite(d) else math.inf


def _echo_suspects(s: _Suspects) -> list[tuple[float, str]]:
    out = [_largest("echo_weights", s.x.echo_weights, s.echo_idx)]
    if isinstance(s.divisors.echo, torch.Tensor):  # read on the host only for this error
        d = float(s.divisors.echo)
        what = f"{s.cfg.echo_normalization}'s divisor of this call: the batch's echo tokens per process"
        out.append((_inverse(d), f"the echo divisor {d:g} ({what})"))
    elif s.divisors.echo is not None:
        d = s.divisors.echo
        out.append((_inverse(d), f"the echo divisor {d:g} (Divisors.echo of this call)"))
    if s.cfg.echo_normalization == "sequence_mean" and s.cfg.echo_z_epsilon:
        out.append((0.0, f"echo_z_epsilon={s.cfg.echo_z_epsilon:g}"))
    return [o for o in out if o[1]]


def check_final_loss(
    loss: torch.Tensor, rl_term: torch.Tensor, echo_term: torch.Tensor, suspects: Any = None
) -> None:
    """O(1): the 0-dim loss is finite, else raise naming the non-finite term and the likely input.

    Every per-token input is checked where it enters, but finite inputs can still overflow the
    sum: advantages or echo weights of 3e38, ``kl_tau=1e308``, ``entropy_coef=-1e38``, a
    divisor of 1e-300. One ``isfinite`` of the 0-dim loss (one host read) catches all of them;
    the diagnosis below runs only when it fails.

    Examples:
        >>> check_final_loss(torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0.0))
        >>> check_final_loss(torch.tensor(float("inf")), torch.tensor(float("inf")), torch.tensor(0.0))
        Traceback (most recent call last):
        ...
        echoloss.loss.diagnosis.NonFiniteLossError: loss must be finite, got inf (loss_rl (the RL term) = inf, loss_echo (the echo term) = 0); ...
    """
    if bool(torch.isfinite(loss)):
        return
    raise _final_loss_error(
        float(loss.detach()), float(rl_term.detach()), float(echo_term.detach()), suspects
    )


def _final_loss_error(
    loss: float, rl_term: float, echo_term: float, suspects: _Suspects | None
) -> NonFiniteLossError:
    """The error of a non-finite loss from the host values of the loss and its two terms."""
    terms = {"loss_rl (the RL term)": rl_term, "loss_echo (the echo term)": echo_term}
    parts = [f"{k} = {v:g}" for k, v in terms.items()]
    causes = []
    if suspects is not None:
        for term, finder in ((rl_term, _rl_suspects), (echo_term, _echo_suspects)):
            if not math.isfinite(term):
                found = sorted((o for o in finder(suspects) if o[0] > 0), key=lambda o: -o[0])
                if found:
                    causes.append(found[0][1] + "".join(f"; {f[1]}" for f in found[1:3]))
    fix = (
        "the checked inputs were finite, so a product, the sum or its scaling overflowed"
        + (f"; likely input: {' | '.join(causes)}" if causes else "")
        + "; bring that input to a realistic range (advantages and echo weights of order 1, "
        "coefficients well below 1e30, normalisers ≥ 1), or set LossConfig(check_finite=False) "
        "to skip this check"
    )
    got = f"{loss:g} ({', '.join(parts)})"
    return NonFiniteLossError(problem("loss", "finite", got, fix))


def defer_final_loss_check(
    loss: torch.Tensor,
    rl_term: torch.Tensor,
    echo_term: torch.Tensor,
    x: LossInputs,
    ent: torch.Tensor | None,
    cfg: LossConfig,
    checks: DeferredChecks,
    divisors: Divisors = NO_DIVISORS,
) -> None:
    """`check_final_loss` through ``checks``: the diagnosis (which reads the suspects' values,
    the device ``divisors`` included) runs only when the error is raised."""

    message = final_loss_message(x, ent, cfg, divisors)
    checks.add([not_finite(loss), loss, rl_term, echo_term], message)


def final_loss_message(
    x: LossInputs, ent: torch.Tensor | None, cfg: LossConfig, divisors: Divisors
) -> Callable[[Sequence[float]], Exception | None]:
    """The error of `defer_final_loss_check` from ``(not finite, loss, rl_term, echo_term)``."""

    def message(v: Sequence[float]) -> Exception | None:
        if not v[0]:
            return None
        rl_idx, echo_idx = x.rl.nonzero().squeeze(1), x.echo.nonzero().squeeze(1)
        suspects = _Suspects(x, rl_idx, echo_idx, ent, cfg, divisors)
        return _final_loss_error(v[1], v[2], v[3], suspects)

    return message


#: Most negative entropy accepted from a caller: an entropy is ≥ 0; one computed in fp32 from a
#: near-one-hot distribution may round a few ulps below 0, never by this much.
ENTROPY_TOLERANCE = 1e-3


def check_entropy(ent: torch.Tensor, rl: torch.Tensor, checks: DeferredChecks) -> None:
    """The caller's entropy on RL rows (where it is read): finite and ≥ 0 (up to rounding)."""
    if ent.numel() == 0:
        return
    _defer_first_bad_row(
        checks,
        rl & ~((ent >= -ENTROPY_TOLERANCE) & (ent < math.inf)),  # [N] NaN fails both
        ent,
        lambda row, value: ValueError(
            problem(
                f"entropy[{row}]",
                f"a finite entropy ≥ 0 (up to -{ENTROPY_TOLERANCE}) on an RL row",
                repr(value),
                "pass the per-token entropy -Σ p log p of the model's distribution",
            )
        ),
    )
