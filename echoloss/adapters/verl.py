"""verl: the echo term as a registered policy loss (extra ``verl``, verl 0.9).

verl picks its actor loss by name (``actor_rollout_ref.actor.policy_loss.loss_mode``) from
``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``. `register_echo_policy_loss` adds a
loss there that is verl's own ``base`` loss (``"vanilla"`` PPO-clip by default, unchanged)
plus the echo cross-entropy on the response tokens with an echo weight:

``loss = base(...) + agg_loss(-log_prob · w, w > 0, loss_agg_mode, **echo_batch_info)``

with verl's own ``agg_loss`` and the same ``loss_agg_mode``, but the echo term's own global
counts (echo tokens and echo sequences of the mini-batch, not the RL ones), so one term never
dilutes the other. The weights ``w`` are a per-response-token batch field ``echo_weights``
(``[bs, response_length]`` float, 0 = not echoed): verl's policy-loss signature does not carry
batch fields, so `echo_ppo_loss` (a drop-in for verl's actor loss ``ppo_loss``) reads
the field and hands it to the registered loss; `echo_inputs` does the same around any
other call site. Calling the registered loss without echo inputs is an error, never a silent
plain-PPO step.

Tool-result tokens of a verl agent loop are in the response with ``response_mask = 0``: their
``log_prob`` is computed by verl anyway, so the echo term costs no extra forward.
`echoloss.adapters.convert.verl_fields` builds the fields from echoloss samples.
``docs/guides/verl.md`` has the Hydra snippet and the measured equivalences.

Importing this module imports neither verl nor ray; the registry is touched only by
`register_echo_policy_loss`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from echoloss._validate import check_count, problem
from echoloss.loss.inputs import LOGPROB_TOLERANCE

__all__ = [
    "VERL_AGG_MODES",
    "echo_agg_loss",
    "echo_batch_info",
    "echo_inputs",
    "echo_ppo_loss",
    "register_echo_policy_loss",
]

#: verl 0.9's ``loss_agg_mode`` values (``core_algos.agg_loss``).
VERL_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


def _core_algos() -> Any:
    try:
        import verl.trainer.ppo.core_algos as core_algos
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "echoloss.adapters.verl needs verl (verl.trainer.ppo.core_algos): "
            "pip install 'echoloss[verl]'"
        ) from e
    return core_algos


@dataclass(frozen=True)
class _EchoInputs:
    weights: torch.Tensor  # [bs, L] float ≥ 0
    batch_info: Mapping[str, Any]


_CURRENT: contextvars.ContextVar[_EchoInputs | None] = contextvars.ContextVar(
    "echoloss_verl_echo_inputs", default=None
)


def echo_batch_info(
    echo_weights: torch.Tensor,
    *,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: int | None = None,
) -> dict[str, Any]:
    """verl's ``global_batch_info`` for the echo term (its own counts, never the RL ones).

    Args:
        echo_weights: ``[bs, L]`` this micro-batch's echo weights.
        dp_size: data-parallel size (verl multiplies each rank's loss by it).
        batch_num_tokens: echo tokens of the whole mini-batch over every rank (``token-mean``);
            None = this micro-batch's (allowed with ``dp_size == 1`` only, as in verl).
        global_batch_size: sequences with an echo token in the mini-batch over every rank
            (``seq-mean-*``); None = this micro-batch's (``dp_size == 1`` only).
        loss_scale_factor: ``seq-mean-token-sum-norm``'s constant (None = response length).

    Examples:
        >>> echo_batch_info(torch.tensor([[0.0, 0.5], [0.0, 0.0]]))
        {'dp_size': 1, 'batch_num_tokens': None, 'global_batch_size': None, 'loss_scale_factor': None}
    """
    if echo_weights.dim() != 2:
        raise ValueError(
            f"echo_weights: expected [bs, response_length], got {list(echo_weights.shape)}"
        )
    return _checked_info(
        {
            "dp_size": dp_size,
            "batch_num_tokens": batch_num_tokens,
            "global_batch_size": global_batch_size,
            "loss_scale_factor": loss_scale_factor,
        },
        echo_weights,
    )


def _checked_info(info: Mapping[str, Any], echo_weights: torch.Tensor) -> dict[str, Any]:
    """verl's batch info for the echo term, every count checked where it enters.

    ``dp_size`` multiplies the loss and the counts divide it: each must be a finite whole
    number ≥ 1 (a global count also ≥ this micro-batch's own: it sums every rank). Unknown
    keys are refused (verl's ``agg_loss`` would take them as keywords).
    """
    unknown = sorted(set(info) - set(_INFO_KEYS))
    if unknown:
        raise ValueError(problem("batch_info", f"keys among {_INFO_KEYS}", str(unknown)))
    out = dict(info)
    mask = echo_weights > 0
    out["dp_size"] = int(check_count("dp_size", info.get("dp_size", 1), minimum=1, integer=True))
    local = {
        "batch_num_tokens": int(mask.sum()),
        "global_batch_size": int(mask.any(dim=-1).sum()) if mask.dim() == 2 else 0,
    }
    for key, own in local.items():
        value = info.get(key)
        if value is None:
            continue
        # 0 only for a batch without echo tokens (then this micro-batch has none either).
        n = check_count(key, value, minimum=0, integer=True, fix="None = this micro-batch's count")
        if n < max(own, 1) and not (n == 0 and own == 0):
            raise ValueError(
                problem(
                    key,
                    f"≥ {own} (this micro-batch's own echo count; it sums every rank)",
                    repr(n),
                )
            )
        out[key] = int(n)
    factor = info.get("loss_scale_factor")
    if factor is not None:
        out["loss_scale_factor"] = check_count("loss_scale_factor", factor, minimum=1e-30)
    return out


def _check_scale(w: torch.Tensor, info: Mapping[str, Any], dtype: torch.dtype) -> None:
    """Each echo token's gradient is ``-w · dp_size`` divided by counts ≥ 1 (and by
    ``loss_scale_factor``): that product must stay finite in ``dtype``, or the backward pass
    turns the parameters into inf while the loss itself may still be finite."""
    if w.numel() == 0:
        return
    dp = float(info["dp_size"])
    factor = info.get("loss_scale_factor")
    shrink = min(1.0, float(factor)) if factor is not None else 1.0
    largest = float(w.max())
    limit = torch.finfo(dtype).max * shrink / dp
    if largest > limit:
        raise ValueError(
            problem(
                "echo_weights",
                f"at most {limit:.3g} (times dp_size={info['dp_size']}"
                + (f" / loss_scale_factor={factor:g}" if factor is not None else "")
                + f", each echo token's gradient must stay finite in {dtype})",
                f"a largest weight of {largest:.3g}",
                "echo weights are λ of order 1e-3 to 1",
            )
        )


_INFO_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


def echo_agg_loss(
    log_prob: torch.Tensor,
    echo_weights: torch.Tensor,
    *,
    loss_agg_mode: str,
    batch_info: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """The echo term with verl's ``agg_loss``: ``agg_loss(-log_prob · w, w > 0, mode, ...)``.

    ``token-mean`` is echoloss's ``echo_normalization="token_mean"``; ``seq-mean-token-mean``
    is ``"sequence_mean"`` with ``|O_i|`` = the echoed tokens of sequence ``i``; ``token-sum``
    is ``"sum"``; ``seq-mean-token-sum`` divides each sequence's sum by the echo sequences
    (``docs/guides/verl.md`` has the measured values).

    Args:
        log_prob: ``[bs, L]`` current log-probabilities of the response tokens.
        echo_weights: ``[bs, L]`` float ≥ 0 (0 = not echoed).
        loss_agg_mode: one of `VERL_AGG_MODES`.
        batch_info: `echo_batch_info` (None = this micro-batch alone).

    Returns:
        0-dim echo loss.
    """
    if loss_agg_mode not in VERL_AGG_MODES:
        raise ValueError(
            f"loss_agg_mode={loss_agg_mode!r}: expected one of {', '.join(VERL_AGG_MODES)}"
        )
    if echo_weights.shape != log_prob.shape:
        raise ValueError(
            f"echo_weights: expected the shape of log_prob {list(log_prob.shape)}, got "
            f"{list(echo_weights.shape)}"
        )
    w = echo_weights.to(log_prob.dtype)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("echo_weights: expected finite weights ≥ 0 (0 = not echoed)")
    info = _checked_info(batch_info, w) if batch_info is not None else echo_batch_info(w)
    _check_scale(w, info, log_prob.dtype)
    mask = w > 0
    bad = mask & ~(torch.isfinite(log_prob) & (log_prob <= LOGPROB_TOLERANCE))
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            problem(
                f"log_prob[{i}, {j}]",
                f"a finite log-probability ≤ 0 (up to {LOGPROB_TOLERANCE}) on an echoed token",
                repr(float(log_prob[i, j].detach())),
                "a NaN or -inf logprob comes from the model's logits; a positive one is a "
                "negative log-likelihood passed as log p",
            )
        )
    if not bool(mask.any()):
        # No echo token: the term is 0 in every mode (verl's agg_loss would divide 0 by a zero
        # count). Connected through an empty slice: log_prob's unused rows are never read.
        return log_prob.reshape(-1).narrow(0, 0, 0).sum()
    # Zero outside the mask before the product: -log_prob may be inf on unused rows.
    loss_mat = torch.where(mask, -log_prob * w, torch.zeros_like(log_prob))
    loss: torch.Tensor = _core_algos().agg_loss(
        loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=loss_agg_mode, **info
    )
    if not bool(torch.isfinite(loss)):  # finite factors whose products or sum overflow
        k = int(torch.where(mask, w, 0.0).reshape(-1).argmax())
        raise ValueError(
            f"echo_weights: the echo term is {float(loss.detach())} with finite inputs: "
            f"-log_prob · w overflows {str(log_prob.dtype).removeprefix('torch.')} (largest "
            f"weight {float(w.reshape(-1)[k]):.3g} at flat index {k}, "
            f"loss_agg_mode={loss_agg_mode!r}); use echo weights of order 1 (λ ≤ 1)"
        )
    return loss


@contextlib.contextmanager
def echo_inputs(
    echo_weights: torch.Tensor, *, batch_info: Mapping[str, Any] | None = None
) -> Iterator[None]:
    """Within this block, the registered echo loss reads these echo weights.

    Examples:
        >>> with echo_inputs(torch.zeros(1, 2)):
        ...     pass
    """
    token = _CURRENT.set(_EchoInputs(echo_weights, batch_info or echo_batch_info(echo_weights)))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def register_echo_policy_loss(
    name: str = "echo", *, base: str = "vanilla", replace: bool = False
) -> Callable[..., Any]:
    """Register ``name`` in verl's policy-loss registry: verl's ``base`` loss plus echo.

    Args:
        name: the registry name (``policy_loss.loss_mode=<name>`` in the Hydra config).
        base: a loss already in verl's registry (``"vanilla"``, ``"gspo"``, ``"cispo"``, ...),
            computed unchanged.

    Returns:
        The registered function, with verl's ``PolicyLossFn`` signature plus keyword-only
        ``echo_weights`` and ``echo_batch_info`` (else taken from `echo_inputs`).

        replace: allow ``name`` to replace a loss another library registered in verl's
            registry (verl's own ``"vanilla"``, ...); without it, such a name is an error, since
            the replacement would change that loss for every caller of verl. An echo loss
            registered earlier by this function may be re-registered (a re-run cell).

    Raises:
        ValueError: ``base`` is not registered in verl, or is this loss itself, or ``name`` is
            taken and ``replace`` is False.
    """
    core = _core_algos()
    if not isinstance(name, str) or not name:
        raise ValueError(problem("name", "a non-empty str", repr(name)))
    if base == name:
        raise ValueError(f"base={base!r}: the echo loss cannot wrap itself; pick verl's loss")
    taken = core.POLICY_LOSS_REGISTRY.get(name)
    if taken is not None and not replace and not getattr(taken, "_echoloss_echo_loss", False):
        owner = getattr(taken, "__module__", "?")
        raise ValueError(
            problem(
                "name",
                "a name not in verl's policy-loss registry",
                f"{name!r} (registered by {owner}: replacing it would change that loss for "
                "every caller)",
                "pick a new name such as 'echo', or pass replace=True to replace it on purpose",
            )
        )
    if base not in core.POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"base={base!r} is not in verl's policy-loss registry; expected one of "
            f"{', '.join(sorted(core.POLICY_LOSS_REGISTRY))}"
        )
    base_fn = core.POLICY_LOSS_REGISTRY[base]

    def echo_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
        *,
        echo_weights: torch.Tensor | None = None,
        echo_batch_info: Mapping[str, Any] | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if echo_weights is None:
            current = _CURRENT.get()
            if current is None:
                raise ValueError(
                    f"policy loss {name!r}: no echo weights reached the loss. verl's actor loss "
                    "does not pass batch fields to policy losses: set the actor loss to "
                    "echoloss.adapters.verl.echo_ppo_loss (it reads the 'echo_weights' field), "
                    "or call inside echoloss.adapters.verl.echo_inputs(...)"
                )
            echo_weights, echo_batch_info = current.weights, current.batch_info
        pg_loss, metrics = base_fn(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=advantages,
            response_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            config=config,
            rollout_is_weights=rollout_is_weights,
        )
        echo = echo_agg_loss(
            log_prob, echo_weights, loss_agg_mode=loss_agg_mode, batch_info=echo_batch_info
        )
        metrics = dict(metrics)
        metrics["actor/echo_loss"] = float(echo.detach())
        metrics["actor/echo_tokens"] = int((echo_weights > 0).sum())
        return pg_loss + echo, metrics

    echo_policy_loss.__name__ = f"compute_policy_loss_{name}"
    echo_policy_loss._echoloss_echo_loss = True  # type: ignore[attr-defined]
    core.register_policy_loss(name)(echo_policy_loss)
    return echo_policy_loss


def echo_ppo_loss(
    config: Any, model_output: Any, data: Any, dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's actor loss ``verl.workers.utils.losses.ppo_loss`` with the echo inputs attached.

    Reads the batch field ``echo_weights`` (``[bs, response_length]``, padded or nested like
    ``response_mask``) and the optional non-tensor fields ``echo_batch_num_tokens`` /
    ``echo_global_batch_size`` (the echo term's global counts, required with ``dp_size > 1``),
    then runs verl's ``ppo_loss`` unchanged; its policy loss must be a registered echo loss
    (`register_echo_policy_loss`). Use it where verl sets the actor loss:
    ``actor_rollout_wg.set_loss_fn(functools.partial(echo_ppo_loss, config=actor_config))``.
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    if "echo_weights" not in data:
        raise ValueError(
            "echo_ppo_loss: the batch has no 'echo_weights' field ([bs, response_length] float, "
            "0 = not echoed); add it to the batch (echoloss.adapters.convert.verl_fields)"
        )
    weights = data.select("echo_weights").to_padded_tensor()["echo_weights"]
    info = echo_batch_info(
        weights,
        dp_size=int(data["dp_size"]),
        batch_num_tokens=tu.get_non_tensor_data(
            data=data, key="echo_batch_num_tokens", default=None
        ),
        global_batch_size=tu.get_non_tensor_data(
            data=data, key="echo_global_batch_size", default=None
        ),
        loss_scale_factor=getattr(config, "loss_scale_factor", None),
    )
    with echo_inputs(weights, batch_info=info):
        return ppo_loss(config, model_output, data, dp_group)  # type: ignore[no-any-return]
