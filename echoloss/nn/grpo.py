"""GRPO-family options (TRL's ``GRPOConfig`` / Liger's ``LigerFusedLinearGRPOLoss``) → echoloss.

TRL and Liger name one family of losses by ``loss_type`` and ``importance_sampling_level``; each
is a policy loss on the RL tokens plus a normaliser of the micro-batch. `grpo_loss_mapping`
maps those options onto a [`echoloss.LossConfig`][echoloss.loss.config.LossConfig] exactly, or raises naming the option and
the fix; `GRPOLossMapping.micro_batch` gives the per-call normaliser; the echo term's
normaliser is folded into the echo weights by `scale_echo_weights`. Pure PyTorch: used by
[`echoloss.adapters.trl`][echoloss.adapters.trl] and the modules of `echoloss.nn`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from echoloss import LossConfig, Normalizers
from echoloss._logging import warn_once
from echoloss._ratios import sapo_temperature_problem
from echoloss._validate import check_count, describe, finite_float, problem
from echoloss.ops.row_algebra.policies import ROW_POLICIES
from echoloss.ops.value_checks import DeferredChecks

# The normal float32 range (the loss divides by the temperature in float32).
FLOAT32_TINY = torch.finfo(torch.float32).tiny
FLOAT32_MAX = torch.finfo(torch.float32).max

__all__ = [
    "ECHO_NORMALIZATIONS",
    "ECHO_TEMPERATURES",
    "GRPO_LOSS_TYPES",
    "GRPOLossMapping",
    "divide_echo_weights",
    "grpo_loss_mapping",
    "row_temperature",
    "scale_echo_weights",
]

# ---------------------------------------------------------------------------------------------
# TRL's loss_type / importance_sampling_level → echoloss, exactly or not at all.
# ---------------------------------------------------------------------------------------------

#: Every ``GRPOConfig.loss_type`` of TRL 1.16 and what happens to it (``docs/guides/trl.md``).
GRPO_LOSS_TYPES: dict[str, str] = {
    "grpo": "mapped",
    "bnpo": "mapped",
    "dr_grpo": "mapped",
    "dapo": "mapped",
    "cispo": "mapped",
    "sapo": "mapped",
    "luspo": "mapped",
    "vespo": "rejected",
}

#: Echo normalisers an `EchoGRPOConfig` offers, per micro-batch of ``B`` completions.
ECHO_NORMALIZATIONS = ("token_mean", "sequence_mean", "batch_token_mean")
ECHO_TEMPERATURES = ("one", "sampling")


@dataclass(frozen=True)
class GRPOLossMapping:
    """How one ``GRPOConfig`` maps onto echoloss; built by [`grpo_loss_mapping`][echoloss.nn.grpo.grpo_loss_mapping].

    Attributes:
        loss_type: TRL's ``loss_type``.
        config: the [`echoloss.LossConfig`][echoloss.loss.config.LossConfig] of every micro-batch except its RL normaliser
            constant, which [`micro_batch`][echoloss.nn.grpo.GRPOLossMapping.micro_batch] fills in (the echo term always uses
            ``echo_normalization="sum"`` on pre-scaled weights, see [`scale_echo_weights`][echoloss.nn.grpo.scale_echo_weights]).
    """

    loss_type: str
    config: LossConfig

    def micro_batch(
        self,
        *,
        batch_size: int,
        max_completion_length: int,
        num_items_in_batch: float | None,
        num_processes: int,
        accumulation_steps: int,
        steps_per_generation: int,
        local_items: int | None = None,
    ) -> tuple[LossConfig, Normalizers | None]:
        """The config and normalisers whose RL term equals TRL's loss of one micro-batch.

        TRL divides each micro-batch's loss so that the accumulated gradients give its objective:

        ============  ===============================================================
        loss_type     RL divisor of ``Σ_t loss_t`` (train; eval sets ``accumulation_steps=1``)
        ============  ===============================================================
        grpo, sapo    per-sequence token mean, summed, over ``B · accumulation_steps``
                      (every completion counts, masked ones too)
        bnpo          this micro-batch's RL tokens ``· accumulation_steps``
        dr_grpo       ``B · max_completion_length · accumulation_steps``
        dapo, cispo   ``num_items_in_batch / num_processes · accumulation_steps /
                      steps_per_generation`` (RL tokens of the generation batch)
        luspo         ``B · accumulation_steps``
        ============  ===============================================================

        ``bnpo`` takes its divisor from the RL rows in the loss itself (``token_mean`` with
        ``rl_tokens`` scaled), every other type from the arguments. Every count is checked
        (finite whole numbers, ≥ 1 where they divide; ``num_items_in_batch`` ≥ ``local_items``,
        this call's own RL tokens when given) and the config is rebuilt with validation.
        """
        cfg, lt = self.config, self.loss_type
        batch_size = int(check_count("batch_size", batch_size, minimum=1, integer=True))
        num_processes = int(check_count("num_processes", num_processes, minimum=1, integer=True))
        ga = int(check_count("accumulation_steps", accumulation_steps, minimum=1, integer=True))
        steps_per_generation = int(
            check_count("steps_per_generation", steps_per_generation, minimum=1, integer=True)
        )
        if lt in ("grpo", "sapo"):
            return cfg, _sequence_normalizers(batch_size * ga)
        if lt == "dr_grpo":
            length = check_count(
                "max_completion_length",
                max_completion_length,
                minimum=1,
                integer=True,
                fix="loss_type='dr_grpo' divides by batch_size · max_completion_length",
            )
            constant = float(batch_size * length * ga)
        elif lt in ("dapo", "cispo"):
            if num_items_in_batch is None:
                raise ValueError(
                    f"num_items_in_batch: loss_type={lt!r} divides by the RL tokens of the whole "
                    "generation batch (TRL's inputs['num_items_in_batch']); it is missing"
                )
            items = check_items("num_items_in_batch", num_items_in_batch, local_items, "RL tokens")
            # max(·, 1): a batch without RL tokens has a zero sum; the divisor is then unused.
            constant = max(items, 1.0) / num_processes
            constant = constant * ga / steps_per_generation
        elif lt == "luspo":
            constant = float(batch_size * ga)
        else:  # bnpo: filled in by the caller from its RL-token count
            return cfg, None
        return with_fields(cfg, rl_normalization_constant=constant), None


def with_fields(config: LossConfig, **changes: Any) -> LossConfig:
    """A copy of ``config`` with ``changes``, validated like ``LossConfig(**fields)``.

    ``model_copy(update=...)`` would skip every check of ``LossConfig`` (a zero or negative
    normaliser, a NaN coefficient): every per-call config goes through this instead.

    Examples:
        >>> cfg = LossConfig(rl_normalization="token_sum_constant", rl_normalization_constant=1.0)
        >>> with_fields(cfg, rl_normalization_constant=8.0).rl_normalization_constant
        8.0
    """
    return LossConfig.model_validate({**config.model_dump(exclude_unset=True), **changes})


def check_items(name: str, value: Any, local: int | None, what: str) -> float:
    """A batch-wide token count: a finite whole number ≥ 0 and ≥ this call's own ``local``.

    Examples:
        >>> check_items("num_items_in_batch", 12, 5, "RL tokens")
        12.0
        >>> check_items("num_items_in_batch", 3, 5, "RL tokens")
        Traceback (most recent call last):
        ...
        ValueError: num_items_in_batch must be ≥ 5 (the RL tokens of this call alone; it counts the whole batch over every process), got 3.0; pass the sum over every micro-batch of the step on every rank
    """
    items = check_count(name, value, minimum=0, integer=True)
    if local is not None and items < local:
        raise ValueError(
            problem(
                name,
                f"≥ {local} (the {what} of this call alone; it counts the whole batch over "
                "every process)",
                repr(items),
                "pass the sum over every micro-batch of the step on every rank",
            )
        )
    return items


def items_on_device(
    name: str,
    value: float | torch.Tensor,
    local: torch.Tensor | None,
    what: str,
    checks: DeferredChecks,
) -> torch.Tensor:
    """`check_items` for a count that may live on the device: returns it as a 0-dim float64
    tensor on ``checks.device``.

    The type is checked at once; the value (finite whole number ≥ 0, and ≥ ``local``, this
    call's own count as a 0-dim tensor) through ``checks``: on the device path nothing is read
    on the host, and the error, with `check_items`' message, is raised later.

    Examples:
        >>> c = DeferredChecks(torch.device("cpu"))
        >>> items_on_device("num_items_in_batch", torch.tensor(12), torch.tensor(5), "RL tokens", c)
        tensor(12., dtype=torch.float64)
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            check_count(name, value)  # raises the TypeError naming the argument
        integer = not value.dtype.is_floating_point
        count = value.detach().reshape(()).to(device=checks.device, dtype=torch.float64)
    else:
        check_count(name, value, minimum=0, integer=True)  # a host number: checked now
        integer = isinstance(value, int)
        count = torch.full((), float(value), dtype=torch.float64, device=checks.device)

    def message(v: Sequence[float]) -> Exception | None:
        host = int(v[0]) if integer and math.isfinite(v[0]) else v[0]
        try:
            check_items(name, host, None if local is None else int(v[1]), what)
        except (TypeError, ValueError) as err:
            return err
        return None

    checks.add([count] if local is None else [count, local], message)
    return count


def _sequence_normalizers(count: int) -> Normalizers:
    """Normalizers whose RL ``sequence_mean*`` denominator is ``count``.

    Every count the RL term divides by in the ``sequence_mean*`` modes is set (``rl_sequences``;
    ``sequences`` where that is the denominator), the others stay 0 (unused by these modes).
    """
    names = {f.name for f in dataclasses.fields(Normalizers)}
    return Normalizers(**{k: count for k in ("sequences", "rl_sequences") if k in names})


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _at_level(policy: str, sequence: bool) -> str:
    """``policy``, or for TRL's ``importance_sampling_level="sequence"`` the built-in policy
    that is it on the sequence's ratio (`RowPolicy.sequence_level`)."""
    level = ROW_POLICIES[policy].sequence_level
    assert level is not None  # the token-level policies TRL's loss types map to
    return level if sequence else policy


def grpo_loss_mapping(args: Any, *, epsilon_low: float, epsilon_high: float) -> GRPOLossMapping:
    """Map a ``GRPOConfig`` onto echoloss exactly, or raise naming the setting and the fix.

    Mapped: every ``loss_type`` but ``vespo`` (see [`GRPO_LOSS_TYPES`][echoloss.nn.grpo.GRPO_LOSS_TYPES]), both
    ``importance_sampling_level`` values, ``epsilon``/``epsilon_high``, ``delta`` (as
    ``dual_clip``, which equals it whenever ``delta > 1 + epsilon_high``), ``beta`` (k3 reference
    KL, with ``use_bias_correction_kl=False``) and the vLLM importance-sampling correction (as
    ``LossConfig.mismatch``). Rejected with an error: ``vespo``, ``top_entropy_quantile < 1``,
    ``off_policy_mask_threshold``, an entropy bonus, ``use_bias_correction_kl=True`` with
    ``beta > 0``, ``delta`` with sequence-level ratios, and any unknown value.

    Args:
        args: a ``trl.GRPOConfig`` (or any object with its fields).
        epsilon_low, epsilon_high: the clip range the trainer resolved (TRL's
            ``trainer.epsilon_low`` / ``epsilon_high``).

    Returns:
        [`GRPOLossMapping`][echoloss.nn.grpo.GRPOLossMapping].

    Examples:
        >>> from types import SimpleNamespace as NS
        >>> args = NS(loss_type="grpo", importance_sampling_level="sequence", beta=0.0,
        ...           delta=None, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        ...           entropy_coef=0.0, use_adaptive_entropy=False, use_vllm=False,
        ...           use_bias_correction_kl=True, echo_temperature="one")
        >>> m = grpo_loss_mapping(args, epsilon_low=3e-4, epsilon_high=4e-4)
        >>> m.config.policy, m.config.resolved_eps, m.config.rl_normalization
        ('gspo', (0.0003, 0.0004), 'sequence_mean_token_mean')
        >>> grpo_loss_mapping(NS(**{**vars(args), "loss_type": "xyz"}), epsilon_low=0.2,
        ...                  epsilon_high=0.2)
        Traceback (most recent call last):
        ...
        ValueError: loss_type='xyz' is not a TRL 1.16 loss type; expected one of bnpo, cispo, dapo, dr_grpo, grpo, luspo, sapo, vespo
    """
    lt = getattr(args, "loss_type", None)
    if lt not in GRPO_LOSS_TYPES:
        raise ValueError(
            f"loss_type={lt!r} is not a TRL 1.16 loss type; expected one of "
            f"{', '.join(sorted(GRPO_LOSS_TYPES))}"
        )
    _require(
        lt != "vespo",
        "loss_type='vespo' is not supported by EchoGRPOTrainer: its Gamma weight folds TRL's "
        "vLLM importance ratio into a sequence-level coefficient that echoloss has no exact "
        "equivalent for; use GRPOTrainer for vespo, or another loss_type",
    )
    level = getattr(args, "importance_sampling_level", "token")
    _require(
        level in ("token", "sequence"),
        f"importance_sampling_level={level!r}: expected 'token' or 'sequence'",
    )
    sequence = level == "sequence"
    _check_options(args, epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    _require(
        float(getattr(args, "top_entropy_quantile", 1.0)) >= 1.0,
        f"top_entropy_quantile={args.top_entropy_quantile} is not supported by EchoGRPOTrainer "
        "(echoloss has no high-entropy token mask); set top_entropy_quantile=1.0",
    )
    _require(
        getattr(args, "off_policy_mask_threshold", None) is None,
        "off_policy_mask_threshold is not supported by EchoGRPOTrainer (echoloss has no "
        "off-policy sequence mask); set it to None",
    )
    _require(
        float(getattr(args, "entropy_coef", 0.0)) == 0.0
        and not getattr(args, "use_adaptive_entropy", False),
        "entropy_coef / use_adaptive_entropy: TRL's entropy bonus is a per-micro-batch token "
        "mean independent of loss_type, which echoloss's entropy_coef (normalised with the RL "
        "term) does not reproduce; set entropy_coef=0 and use_adaptive_entropy=False",
    )
    beta = float(getattr(args, "beta", 0.0))
    _require(
        beta == 0.0 or not getattr(args, "use_bias_correction_kl", False),
        f"beta={beta} with use_bias_correction_kl=True: TRL multiplies the KL by the "
        "differentiable importance ratio, which echoloss's k3 KL does not; set "
        "use_bias_correction_kl=False (then kl_coef=beta, kl_estimator='k3' exactly)",
    )
    delta = getattr(args, "delta", None)
    if delta is not None:
        _require(
            lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo") and not sequence,
            f"delta={delta} is mapped for token-level PPO-clip loss types only "
            f"(loss_type={lt!r}, importance_sampling_level={level!r}); set delta=None",
        )
        _require(
            float(delta) > 1.0 + epsilon_high,
            f"delta={delta} must be > 1 + epsilon_high = {1.0 + epsilon_high} for an exact "
            "mapping (it is then LossConfig.dual_clip); raise delta or set it to None",
        )
    mismatch: dict[str, Any] = {}
    if getattr(args, "use_vllm", False) and getattr(
        args, "vllm_importance_sampling_correction", False
    ):
        mode = args.vllm_importance_sampling_mode
        hi = args.vllm_importance_sampling_clip_max
        _require(
            hi is not None,
            "vllm_importance_sampling_clip_max=None: echoloss's mismatch correction needs an "
            "upper bound (LossConfig.mismatch_max); set vllm_importance_sampling_clip_max",
        )
        mismatch = {
            "mismatch": mode,
            "mismatch_max": float(hi),
            "mismatch_min": args.vllm_importance_sampling_clip_min,
        }
    fields: dict[str, Any] = {
        "kl_tau": 0.0,
        "kl_coef": beta,
        "kl_estimator": "k3",
        "log_ratio_clamp": None,  # TRL exponentiates the raw log ratio
        "echo_normalization": "sum",  # the echo weights arrive pre-scaled
        "echo_temperature": getattr(args, "echo_temperature", "one"),
        "compute_entropy": True,
        **mismatch,
    }
    if lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        fields.update(
            policy=_at_level("ppo_clip", sequence),
            eps_low=epsilon_low,
            eps_high=epsilon_high,
            dual_clip=None if delta is None else float(delta),
        )
    elif lt == "cispo":  # TRL caps the ratio at epsilon_high itself, with no lower bound
        fields.update(policy=_at_level("cispo", sequence), cispo_max=epsilon_high, cispo_min=None)
    else:  # sapo
        fields.update(
            policy=_at_level("sapo", sequence),
            sapo_temperature_pos=float(args.sapo_temperature_pos),
            sapo_temperature_neg=float(args.sapo_temperature_neg),
        )
    fields["rl_normalization"] = {
        "grpo": "sequence_mean_token_mean",
        "sapo": "sequence_mean_token_mean",
        "bnpo": "token_mean",
    }.get(lt, "token_sum_constant")
    if fields["rl_normalization"] == "token_sum_constant":
        fields["rl_normalization_constant"] = 1.0  # replaced per micro-batch
    return GRPOLossMapping(lt, LossConfig(**fields))


def _check_options(args: Any, *, epsilon_low: float, epsilon_high: float) -> None:
    """The numeric GRPO options, checked under their own names (before ``LossConfig`` sees
    them under echoloss's names)."""
    lo = finite_float("epsilon_low", epsilon_low)
    if not 0 <= lo < 1:
        raise ValueError(
            problem("epsilon_low", "in [0, 1) (the clip is 1 - epsilon_low)", repr(lo))
        )
    if finite_float("epsilon_high", epsilon_high) < 0:
        raise ValueError(problem("epsilon_high", "≥ 0", repr(epsilon_high)))
    if getattr(args, "loss_type", None) == "cispo" and epsilon_high <= 0:
        raise ValueError(
            problem("epsilon_high", "> 0 (cispo's importance-weight cap)", repr(epsilon_high))
        )
    if finite_float("beta", getattr(args, "beta", 0.0)) < 0:
        raise ValueError(problem("beta", "≥ 0 (the KL coefficient)", repr(args.beta)))
    for name, default in (("sapo_temperature_pos", 1.0), ("sapo_temperature_neg", 1.05)):
        if getattr(args, name, None) is None:
            continue
        value = finite_float(name, getattr(args, name))  # checked whatever the loss type
        bad = sapo_temperature_problem(name, value)
        if bad is not None:
            raise ValueError(bad)
        if getattr(args, "loss_type", None) != "sapo" and value != default:
            warn_once(
                f"grpo-unused-{name}",
                f"echoloss: {name}={value:g} is ignored by loss_type="
                f"{getattr(args, 'loss_type', None)!r} (only 'sapo' reads it); remove it, or "
                "set loss_type='sapo'",
            )
    delta = getattr(args, "delta", None)
    if delta is not None:
        finite_float("delta", delta)
    temperature = getattr(args, "temperature", 1.0)
    if not FLOAT32_TINY <= finite_float("temperature", temperature) <= FLOAT32_MAX:
        raise ValueError(
            problem(
                "temperature",
                f"in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}] (> 0, a normal float32: the "
                "logits are divided by it)",
                describe(temperature),
            )
        )


def scale_echo_weights(
    echo_weights: torch.Tensor,
    observation_mask: torch.Tensor,
    *,
    normalization: str,
    num_echo_items_in_batch: float | torch.Tensor | None,
    num_processes: int,
    accumulation_steps: int,
    steps_per_generation: int,
    checks: DeferredChecks | None = None,
) -> torch.Tensor:
    """``[B, T]`` echo weights pre-divided by the echo normaliser of one TRL micro-batch.

    The loss then sums ``w'_t · (-log p_t)`` (``echo_normalization="sum"``), so the echo term
    gets TRL's accumulation scaling exactly as the RL term does:

    - ``"token_mean"``: ``w / (num_echo_items_in_batch / num_processes · accumulation_steps /
      steps_per_generation)``: the mean over the echo tokens of the generation batch, like
      ``dapo`` for RL tokens.
    - ``"sequence_mean"`` (the ECHO paper): ``w / (|O_i| · B · accumulation_steps)`` with
      ``|O_i|`` the observation tokens of completion ``i`` (echoed or not); every completion
      counts in ``B``, like ``grpo``.
    - ``"batch_token_mean"``: ``w / (echo tokens of this micro-batch · accumulation_steps)``.

    Args:
        echo_weights: ``[B, T]`` float ≥ 0 (0 = not echoed).
        observation_mask: ``[B, T]`` bool, the rows counted in ``|O_i|``.
        normalization: one of [`ECHO_NORMALIZATIONS`][echoloss.nn.grpo.ECHO_NORMALIZATIONS].
        num_echo_items_in_batch: echo tokens in the generation batch over every process
            (``"token_mean"`` only): a number or a 0-dim tensor.
        num_processes, accumulation_steps, steps_per_generation: as in TRL (eval: 1, 1, 1 for the
            last two factors' ratio).
        checks: where the counts read from device values are checked (no host read on the
            device path); None = checked here, deferred on CUDA like the loss's checks.

    Examples:
        >>> w = torch.tensor([[0.0, 0.5, 0.5], [0.5, 0.0, 0.0]])
        >>> obs = torch.tensor([[False, True, True], [True, True, False]])
        >>> scale_echo_weights(w, obs, normalization="sequence_mean", num_echo_items_in_batch=None,
        ...                    num_processes=1, accumulation_steps=1, steps_per_generation=1)
        tensor([[0.0000, 0.1250, 0.1250],
                [0.1250, 0.0000, 0.0000]])
    """
    num_processes = int(check_count("num_processes", num_processes, minimum=1, integer=True))
    accumulation_steps = int(
        check_count("accumulation_steps", accumulation_steps, minimum=1, integer=True)
    )
    steps_per_generation = int(
        check_count("steps_per_generation", steps_per_generation, minimum=1, integer=True)
    )
    echoed = echo_weights > 0
    covered = observation_mask | echoed if normalization == "sequence_mean" else echoed
    return divide_echo_weights(
        echo_weights,
        echoed,
        covered,
        normalization=normalization,
        num_echo_items_in_batch=num_echo_items_in_batch,
        num_processes=num_processes,
        accumulation_steps=accumulation_steps,
        steps_per_generation=steps_per_generation,
        checks=checks,
    )


def divide_echo_weights(
    echo_weights: torch.Tensor,
    echoed: torch.Tensor,
    covered: torch.Tensor,
    *,
    normalization: str,
    num_echo_items_in_batch: float | torch.Tensor | None,
    num_processes: int,
    accumulation_steps: int,
    steps_per_generation: int,
    checks: DeferredChecks | None,
) -> torch.Tensor:
    """`scale_echo_weights` for a caller that holds the masks already:
    ``echoed`` ``[B, T]`` is ``echo_weights > 0``, ``covered`` the rows counted in ``|O_i|``
    (``observation_mask | echoed``; read by ``"sequence_mean"`` only); the three counts are
    validated integers ≥ 1. Three or four launches: the count, at least 1, a product of the
    constants where it is not 1, the division.

    Examples:
        >>> w = torch.tensor([[0.0, 0.5], [0.5, 0.5]])
        >>> divide_echo_weights(w, w > 0, w > 0, normalization="batch_token_mean",
        ...                     num_echo_items_in_batch=None, num_processes=1,
        ...                     accumulation_steps=1, steps_per_generation=1, checks=None)
        tensor([[0.0000, 0.1667],
                [0.1667, 0.1667]])
    """
    if normalization == "token_mean":
        if num_echo_items_in_batch is None:
            raise ValueError(
                "num_echo_items_in_batch: required by echo normalization 'token_mean' (echo "
                "tokens of the generation batch over every process)"
            )
        own = checks is None
        checks = DeferredChecks(echo_weights.device) if checks is None else checks
        items = items_on_device(
            "num_echo_items_in_batch",
            num_echo_items_in_batch,
            echoed.sum(),
            "echo tokens",
            checks,
        )  # 0-dim float64
        if own:
            checks.submit()
        # max(·, 1): only a batch without echo tokens has items == 0, and its weights are all 0.
        divisor = items.clamp(min=1) / num_processes * accumulation_steps / steps_per_generation
        return echo_weights / divisor.to(echo_weights.dtype)
    if normalization == "batch_token_mean":
        n = echoed.sum().clamp(min=1)
        return echo_weights / (n if accumulation_steps == 1 else n * accumulation_steps)
    if normalization == "sequence_mean":
        z = covered.sum(dim=1, keepdim=True).clamp(min=1)
        return echo_weights / (z * (echo_weights.shape[0] * accumulation_steps))
    raise ValueError(
        f"echo normalization={normalization!r}: expected one of {', '.join(ECHO_NORMALIZATIONS)}"
    )


def row_temperature(
    rl: torch.Tensor, echo: torch.Tensor, temperature: float, echo_temperature: str
) -> torch.Tensor:
    if echo_temperature == "one":  # one launch: scalars on both sides
        return torch.where(echo, 1.0, float(temperature))
    return torch.full(rl.shape, float(temperature), device=rl.device)
