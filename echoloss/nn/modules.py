"""``torch.nn.Module`` losses in the shape of Liger's ``LigerFusedLinearGRPOLoss``, with echo.

A Liger user changes one line: ``LigerFusedLinearGRPOLoss(...)`` becomes
``EchoFusedLinearGRPOLoss(...)`` with the same constructor options and the same call
``loss_fn(_input [B, T, H], lin_weight [V, H], selected_token_ids [B, T], attention_mask [B, T],
advantages [B], bias=..., ref_per_token_logps=..., old_per_token_logps=...)``, returning
``(loss, metrics)``. The echo inputs are extra keywords: ``echo_weights [B, T]`` (λ per token,
0 = not echoed) and ``observation_mask [B, T]``. `EchoGRPOLoss` is the same loss on
logits ``[B, T, V]``.

The options map onto an [`echoloss.LossConfig`][echoloss.LossConfig] through
[`grpo_loss_mapping`][echoloss.nn.grpo.grpo_loss_mapping] (an option without an exact
equivalent is an error); or pass ``config=LossConfig(...)`` instead of the options to use any
echoloss loss (then the RL and echo terms are normalised by the config over this call).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from echoloss import (
    LossConfig,
    LossOutput,
    Normalizers,
    selective_logprobs,
)
from echoloss._deferred import raise_deferred_errors
from echoloss._logging import warn_once
from echoloss._validate import (
    check_chunk_size,
    check_count,
    check_mask,
    check_per_token,
    check_tensor,
    describe,
    finite_float,
    problem,
)
from echoloss.loss.checks import chunk_additive, reads_sequences
from echoloss.loss.chunks import row_coefficients
from echoloss.loss.core import label_check_on_device, loss_from_logprobs
from echoloss.loss.inputs import check_echo_weight_values, check_float_values, unchecked_inputs
from echoloss.loss.normalization import Divisors
from echoloss.loss.policy import get_policy
from echoloss.nn.grpo import (
    ECHO_NORMALIZATIONS,
    ECHO_TEMPERATURES,
    GRPOLossMapping,
    grpo_loss_mapping,
    items_on_device,
    row_temperature,
    with_fields,
)
from echoloss.ops.fused_linear.op import (
    RowCoefficients,
    attach_gradients,
    check_linear_inputs,
    linear_logprobs_for_loss,
    start_logits,
)
from echoloss.ops.selective_logprobs.op import selective_logprobs_checked_by_caller
from echoloss.ops.value_checks import DeferredChecks

__all__ = ["EchoFusedLinearGRPOLoss", "EchoGRPOLoss"]


class _CallInputs(NamedTuple):
    """The per-call inputs of a forward besides the rows and the logprobs, as the caller passed
    them (checked in `EchoGRPOLoss._setup`)."""

    advantages: torch.Tensor
    ref_per_token_logps: torch.Tensor | None
    old_per_token_logps: torch.Tensor | None
    inference_logprobs: torch.Tensor | None
    observation_mask: torch.Tensor | None
    num_items_in_batch: float | torch.Tensor | None
    num_echo_items_in_batch: float | torch.Tensor | None
    normalizers: Normalizers | None
    env_names: Sequence[str] | None


class _CallSetup(NamedTuple):
    """What one call's loss needs before its logprobs (`EchoGRPOLoss._setup`)."""

    config: LossConfig
    normalizers: Normalizers | None
    divisors: Divisors  # the call's RL and echo divisors (Liger's and TRL's, one call a step)
    advantages: torch.Tensor  # [B, T] float
    observation_mask: torch.Tensor  # [B, T] bool
    echo_weights: torch.Tensor  # [B, T] float, as passed (0 outside the mask)


# Liger's constructor defaults (liger-kernel 0.8.5), used where an option is left as None.
_LIGER_DEFAULTS: dict[str, Any] = {
    "beta": 0.04,
    "epsilon_low": 0.2,
    "epsilon_high": 0.2,
    "loss_type": "dapo",
    "max_completion_length": None,
    "importance_sampling_level": "token",
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "temperature": 1.0,
    "delta": None,
    "use_bias_correction_kl": False,
}


def _batch_rows(batch_index: torch.Tensor, t: int) -> torch.Tensor:
    """``[B, T]`` int64 sequence ids, the batch row of each position: ``arange(B)`` expanded
    over ``T`` (a view, strides ``(1, 0)``: the row program reads it in place; the PyTorch
    algebra's flat read copies it)."""
    return batch_index.unsqueeze(1).expand(batch_index.numel(), t)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_reduced(count: torch.Tensor) -> torch.Tensor:
    """0-dim float64: the sum of a per-rank count over the data-parallel group (the count
    itself alone), left on the device (an all-reduce does not make the host wait)."""
    import torch.distributed as dist

    count = count.double()  # no launch when it is float64 already
    if dist.is_available() and dist.is_initialized():
        count = count.clone()
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return count


class EchoGRPOLoss(nn.Module):
    """GRPO-family loss plus echo, on logits ``[B, T, V]`` (Liger's options, TRL's formulas).

    Args:
        beta, epsilon_low, epsilon_high, loss_type, max_completion_length,
            importance_sampling_level, sapo_temperature_pos, sapo_temperature_neg, temperature,
            delta, use_bias_correction_kl: ``LigerFusedLinearGRPOLoss``'s options (None = its
            default; ``beta`` defaults to 0.04 as in Liger). Mapped by
            [`grpo_loss_mapping`][echoloss.nn.grpo.grpo_loss_mapping].
        compiled, use_ref_model, chunk_size: accepted for Liger compatibility. ``compiled`` has
            no effect; ``use_ref_model=True`` with ``beta > 0`` requires
            ``ref_per_token_logps``; a Liger ``chunk_size`` other than 1 warns (echoloss chunks
            by tokens, see ``row_chunk_size``).
        config: an [`echoloss.LossConfig`][echoloss.LossConfig] instead of the options above
            (not both); the terms are then normalised by the config over this call.
        echo_normalization: ``"token_mean"``, ``"sequence_mean"`` or ``"batch_token_mean"``
            ([`scale_echo_weights`][echoloss.nn.grpo.scale_echo_weights]'s normalisers with
            one call per step, so ``token_mean`` and ``batch_token_mean`` agree; the loss
            divides the echo sum once, where TRL's adapter pre-divides the weights: the same
            value up to rounding).
        echo_temperature: ``"one"`` (echo rows at ``T = 1``) or ``"sampling"``.
        row_chunk_size: rows per chunk of the logprob computation (None = automatic).

    Examples:
        >>> import torch
        >>> loss_fn = EchoGRPOLoss(beta=0.0, loss_type="grpo")
        >>> logits = torch.zeros(1, 2, 4, requires_grad=True)
        >>> out = loss_fn(logits, torch.tensor([[0, 1]]), torch.ones(1, 2), torch.tensor([1.0]),
        ...               echo_weights=torch.tensor([[0.0, 0.5]]))
        >>> round(out.loss.item(), 4)  # RL: -A·r = -1 on token 0; echo: 0.5·log 4 on token 1
        -0.3069
    """

    def __init__(
        self,
        beta: float | None = None,
        compiled: bool = True,
        use_ref_model: bool = True,
        chunk_size: int = 1,
        epsilon_low: float | None = None,
        epsilon_high: float | None = None,
        loss_type: str | None = None,
        max_completion_length: int | None = None,
        importance_sampling_level: str | None = None,
        sapo_temperature_pos: float | None = None,
        sapo_temperature_neg: float | None = None,
        temperature: float | None = None,
        delta: float | None = None,
        use_bias_correction_kl: bool | None = None,
        *,
        config: LossConfig | None = None,
        echo_normalization: str = "token_mean",
        echo_temperature: str = "one",
        row_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        given = {
            k: v
            for k, v in {
                "beta": beta,
                "epsilon_low": epsilon_low,
                "epsilon_high": epsilon_high,
                "loss_type": loss_type,
                "max_completion_length": max_completion_length,
                "importance_sampling_level": importance_sampling_level,
                "sapo_temperature_pos": sapo_temperature_pos,
                "sapo_temperature_neg": sapo_temperature_neg,
                "temperature": temperature,
                "delta": delta,
                "use_bias_correction_kl": use_bias_correction_kl,
            }.items()
            if v is not None
        }
        if echo_normalization not in ECHO_NORMALIZATIONS:
            raise ValueError(
                f"echo_normalization={echo_normalization!r}: expected one of "
                f"{', '.join(ECHO_NORMALIZATIONS)}"
            )
        if echo_temperature not in ECHO_TEMPERATURES:
            raise ValueError(
                f"echo_temperature={echo_temperature!r}: expected one of "
                f"{', '.join(ECHO_TEMPERATURES)}"
            )
        if chunk_size != 1:
            warn_once(
                "module-liger-chunk-size",
                f"echoloss: chunk_size={chunk_size} (Liger's sequences per chunk) is not used: "
                "echoloss chunks the participating tokens itself (row_chunk_size)",
            )
        self.echo_normalization = echo_normalization
        self.row_chunk_size = row_chunk_size
        self.use_ref_model = use_ref_model
        # The batch index of the last call's B (`_sequence_ids`): ((B, device), arange(B)).
        self._last_sequence_ids: tuple[tuple[int, torch.device], torch.Tensor] | None = None
        self.mapping: GRPOLossMapping | None
        self._own_rl_tokens_config: LossConfig | None = None
        if config is not None:
            if given:
                raise ValueError(
                    f"config= and the GRPO options {sorted(given)} were both given: use one"
                )
            if not isinstance(config, LossConfig):
                raise TypeError(f"config: expected an echoloss.LossConfig, got {type(config)}")
            self.mapping = None
            self.config = config
            self.temperature = 1.0
            self.max_completion_length = None
            return
        opts = {**_LIGER_DEFAULTS, **given, "echo_temperature": echo_temperature}
        if opts["loss_type"] == "dr_grpo" and opts["max_completion_length"] is None:
            raise ValueError(
                "max_completion_length: required by loss_type='dr_grpo' (its normaliser is "
                "B · max_completion_length)"
            )
        if opts["max_completion_length"] is not None:
            opts["max_completion_length"] = int(
                check_count(
                    "max_completion_length", opts["max_completion_length"], minimum=1, integer=True
                )
            )
        opts["top_entropy_quantile"] = 1.0
        from types import SimpleNamespace

        self.mapping = grpo_loss_mapping(
            SimpleNamespace(**opts),
            epsilon_low=finite_float("epsilon_low", opts["epsilon_low"]),
            epsilon_high=finite_float("epsilon_high", opts["epsilon_high"]),
        )
        # The echo normaliser is the loss's own (with the call's divisor where it is a given
        # or all-reduced count, or the batch size), not weights pre-divided by it: three to
        # five launches fewer. ε = 0: Liger's and TRL's sequence mean divide by |O_i| alone.
        self.config = with_fields(
            self.mapping.config, echo_normalization=echo_normalization, echo_z_epsilon=0.0
        )
        # dapo / cispo on one process without a given count divide by this call's RL rows:
        # the loss's own token_mean (counted by the loss; no launch here)
        self._own_rl_tokens_config = (
            with_fields(self.config, rl_normalization="token_mean", rl_normalization_constant=None)
            if self.mapping.loss_type in ("dapo", "cispo")
            else None
        )
        self.temperature = finite_float("temperature", opts["temperature"])
        self.max_completion_length = opts["max_completion_length"]

    def _rows(
        self,
        attention_mask: torch.Tensor,
        echo_weights: torch.Tensor | None,
        checks: DeferredChecks,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rl, echo, echo weights, scored)`` ``[B, T]``: the RL rows, the echoed rows (a
        weight > 0 within the mask), the weights zeroed outside the mask, and the rows whose
        logprob is computed (the mask: every row in it is RL or echoed, so no ``rl | echo``
        launch)."""
        valid = check_mask("attention_mask", attention_mask, checks=checks)
        if echo_weights is None:
            w = torch.zeros(valid.shape, device=valid.device)
        else:
            w = check_tensor("echo_weights", echo_weights)
            if w.shape != valid.shape or not w.dtype.is_floating_point:
                raise ValueError(
                    problem(
                        "echo_weights",
                        f"a float tensor of the shape of attention_mask {list(valid.shape)}",
                        describe(w),
                    )
                )
            # The values as passed, on the rows that take part (others are never read).
            with checks.collecting():
                check_echo_weight_values("echo_weights", w.reshape(-1), valid.reshape(-1))
            # Zero outside the mask with where (not a product: NaN · 0 is NaN).
            w = torch.where(valid, w.float(), 0.0)
        echo = w > 0  # within the mask
        return valid > echo, echo, w, valid  # RL: valid and not echoed (False < True)

    def _temperatures(self, rl: torch.Tensor, echo: torch.Tensor) -> float | torch.Tensor:
        """Each row's sampling temperature: one float when every row has the same (no
        launch: echo rows at 1 and a policy temperature of 1), else ``[B, T]``
        (`row_temperature`)."""
        if self.temperature == 1.0:
            return 1.0
        return row_temperature(rl, echo, self.temperature, self.config.echo_temperature)

    def _setup(
        self,
        rl: torch.Tensor,
        echo: torch.Tensor,
        echo_w: torch.Tensor,
        call: _CallInputs,
        checks: DeferredChecks,
    ) -> _CallSetup:
        """Everything of one call's loss that does not read the logprobs: the config, the
        normalisers, the RL and echo divisors and the ``[B, T]`` advantages, observation mask
        and echo weights (checked here, with the logprob inputs of ``call``)."""
        b, t = rl.shape
        adv = check_tensor("advantages", call.advantages)
        if adv.shape not in ((b,), (b, t)) or not adv.dtype.is_floating_point:
            raise ValueError(
                problem(
                    "advantages",
                    f"a float tensor [B] = [{b}] or [B, T] = [{b}, {t}]",
                    describe(adv),
                )
            )
        adv = adv.float()
        adv = (adv.unsqueeze(1) if adv.dim() == 1 else adv).expand(b, t)
        with checks.collecting():  # read on the RL rows
            check_float_values("advantages", adv, rl, logprob=False)  # read in place
        given = (
            None
            if call.observation_mask is None
            else check_mask("observation_mask", call.observation_mask, checks=checks)
        )
        if given is not None and (given.shape != rl.shape or given.device != rl.device):
            # checked whatever the normaliser: under token_mean it is unread, and was ignored
            raise ValueError(
                problem(
                    "observation_mask",
                    f"a [B, T] = {list(rl.shape)} mask on {rl.device} (attention_mask's shape)",
                    describe(given),
                )
            )
        # |O_i| (observation or echo rows) is read by the echo normaliser sequence_mean only:
        # elsewhere the echo rows stand in, unread. The loss counts `observation | echo`
        # itself, so the mask goes as given (no launch).
        reads_observation = self.mapping is None or self.echo_normalization == "sequence_mean"
        obs = echo if given is None or not reads_observation else given
        cfg, norms, divisors = self.config, call.normalizers, Divisors()
        if self.mapping is None:
            for name, value in (
                ("num_items_in_batch", call.num_items_in_batch),
                ("num_echo_items_in_batch", call.num_echo_items_in_batch),
            ):
                if value is not None:  # ignored before: the terms normalised per call
                    raise ValueError(
                        f"{name}: unused with config=LossConfig(...), whose normalisers divide "
                        f"(got {describe(value)}); pass the batch's counts as "
                        "normalizers=Normalizers(...), or use the GRPO options (loss_type=...)"
                    )
        else:
            if call.normalizers is not None:
                raise ValueError(
                    "normalizers: the GRPO options fix the normaliser per call (loss_type); "
                    "pass num_items_in_batch instead, or use config=LossConfig(...)"
                )
            cfg, rl_divisor = self._rl_normalizer(
                self.mapping, rl, b, call.num_items_in_batch, checks
            )
            echo_divisor = self._echo_divisor(echo, b, call.num_echo_items_in_batch, checks)
            # clamped (≥ 1) counts that were checked as they came in: no second value check
            divisors = Divisors(rl=rl_divisor, echo=echo_divisor, checked=True)
        if cfg.kl_coef > 0 and call.ref_per_token_logps is None:
            raise ValueError(
                f"ref_per_token_logps: required by beta={cfg.kl_coef} ([B, T] reference-model "
                "logprobs); or set beta=0.0"
            )
        # The [B, T] logprob inputs, named as passed, before the forward reads them per chunk:
        # kind, shape and device, then their values on the RL rows (where they are read),
        # once (the call's record is built from what is checked here).
        for name, value in (
            ("ref_per_token_logps", call.ref_per_token_logps if cfg.kl_coef > 0 else None),
            ("old_per_token_logps", call.old_per_token_logps),
            ("inference_logprobs", call.inference_logprobs),
        ):
            if value is not None:
                check_per_token(name, value, rl.shape, rl.device, "float", what="[B, T]")
                with checks.collecting():
                    check_float_values(name, value.reshape(-1), rl.reshape(-1), logprob=True)
        return _CallSetup(cfg, norms, divisors, adv, obs, echo_w)

    def _loss(
        self,
        lp: torch.Tensor,
        entropy: torch.Tensor,
        rl: torch.Tensor,
        echo: torch.Tensor,
        setup: _CallSetup,
        call: _CallInputs,
        checks: DeferredChecks,
        *,
        source: str = "logits",
        label_check: tuple[torch.Tensor, int] | None = None,
    ) -> LossOutput:
        """The loss of one call from its ``[B, T]`` logprobs and entropy and its `_setup`;
        ``label_check``: the labels' range check the logprob op left to the loss (device
        path)."""
        cfg, norms, divisors, adv, obs, echo_w = setup
        old_given, env_names = call.old_per_token_logps, call.env_names
        # On-policy the ratio's denominator is this pass's logprobs; a non-finite one is the
        # model's output, named by its source in the loss's check of the scored rows.
        old = lp.detach() if old_given is None else old_given.float()
        # Every field was checked as the caller passed it (`_rows`, `_setup`) or derived
        # from those: the record is not validated a second time under other names.
        record = unchecked_inputs(
            rl_mask=rl,
            echo_weights=echo_w,
            advantages=adv,
            inference_logprobs=call.inference_logprobs,
            old_logprobs=old,
            ref_logprobs=call.ref_per_token_logps if cfg.kl_coef > 0 else None,
            # The batch row of each token, where something reads it (a per-sequence
            # normaliser or policy, the per-env metrics): two launches otherwise spent.
            sequence_ids=self._sequence_ids(rl) if self._reads_sequences(cfg, env_names) else None,
            observation_mask=obs,
            env_names=None if env_names is None else tuple(env_names),
            split=(rl.reshape(-1), echo.reshape(-1)),  # `split_rows` of these: done in `_rows`
            sequences_in_order=True,  # `_batch_rows`: the batch row of each token, in order
        )
        ent = entropy.reshape(-1)
        return loss_from_logprobs(
            lp.reshape(-1),
            ent if cfg.entropy_coef != 0 else ent.detach(),  # trained only with a bonus
            record,
            cfg,
            norms,
            None,
            source=source,
            checks=checks,
            divisors=divisors,
            label_check=label_check,
        )

    def _sequence_ids(self, rl: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` int64: the batch row of each position (`_batch_rows`, a view of
        ``arange(B)``). The ``arange`` of the last ``B`` is kept for the next call with that
        many completions, whatever their length (a trainer pads each step to its longest
        completion: the one launch a call is saved at every ``T``). Not kept when made under
        inference mode (autograd cannot save its tensors for a later training call) or during
        a CUDA graph capture (its memory belongs to the graph)."""
        b, t = rl.shape
        key = (b, rl.device)
        last = self._last_sequence_ids
        if last is not None and last[0] == key:
            return _batch_rows(last[1], t)
        batch_index = torch.arange(b, device=rl.device)
        capturing = rl.is_cuda and torch.cuda.is_current_stream_capturing()
        if not torch.is_inference_mode_enabled() and not capturing:
            self._last_sequence_ids = (key, batch_index)
        return _batch_rows(batch_index, t)

    def _reads_sequences(self, cfg: LossConfig, env_names: Sequence[str] | None) -> bool:
        """Whether this call's loss reads sequence ids (`reads_sequences`, or per-env metrics)."""
        return env_names is not None or reads_sequences(cfg, None)

    def _rl_normalizer(
        self,
        mapping: GRPOLossMapping,
        rl: torch.Tensor,
        batch_size: int,
        num_items_in_batch: float | torch.Tensor | None,
        checks: DeferredChecks,
    ) -> tuple[LossConfig, float | torch.Tensor | None]:
        """``(config, RL divisor)`` of one call (one call = one step, as Liger).

        ``dapo``/``cispo`` divide by the RL tokens of the batch over every rank: the count
        given, or this call's all-reduced, as a device tensor (no host read); on one process
        without a given count, the loss's own count of the RL rows (``token_mean``); ``bnpo``
        by this call's RL tokens (the config's ``token_mean``); the other types by constants of
        the batch shape (`GRPOLossMapping.micro_batch`), passed as floats.
        """
        world = _world_size()
        items = num_items_in_batch
        lt = mapping.loss_type
        if lt in ("dapo", "cispo"):
            if items is None and world == 1 and self._own_rl_tokens_config is not None:
                # Liger's divisor, the batch's RL tokens (at least 1), is this call's: the
                # loss counts them (three launches fewer than a count, a clamp and a cast)
                return self._own_rl_tokens_config, None
            if items is None:  # Liger: the batch's RL tokens, all ranks
                count = _all_reduced(rl.sum(dtype=torch.float64))
            else:
                count = items_on_device("num_items_in_batch", items, rl.sum(), "RL tokens", checks)
            # GRPOLossMapping.micro_batch's divisor with one call per step, on the device
            divisor = count.clamp(min=1)
            return self.config, (divisor if world == 1 else divisor / world).float()
        if items is not None:  # given but unused by this loss type: still a valid count
            items_on_device("num_items_in_batch", items, None, "RL tokens", checks)
        if lt == "bnpo":
            return self.config, None
        cfg, norms = mapping.micro_batch(
            batch_size=max(batch_size, 1),  # an empty batch (B = 0): a 0 term, any divisor
            max_completion_length=self.max_completion_length or 0,
            num_items_in_batch=None,
            num_processes=world,
            accumulation_steps=1,
            steps_per_generation=1,
        )
        if norms is not None:  # grpo, sapo: every completion counts (B), as a constant
            return self.config, float(max(norms.rl_sequences, 1))
        assert cfg.rl_normalization_constant is not None  # dr_grpo, luspo: token_sum_constant
        return self.config, cfg.rl_normalization_constant

    def _echo_divisor(
        self,
        echo: torch.Tensor,
        batch_size: int,
        num_echo_items_in_batch: float | torch.Tensor | None,
        checks: DeferredChecks,
    ) -> float | torch.Tensor | None:
        """The echo term's divisor of one call (`scale_echo_weights`' normalisers with one
        call a step), None where it is the loss's own count: ``token_mean`` the echo tokens of
        the batch over every rank (given, or this call's all-reduced, on the device; this
        call's own on one process); ``batch_token_mean`` this call's echo tokens (the loss's);
        ``sequence_mean`` every completion (``B``; ``|O_i|`` is the loss's)."""
        items = num_echo_items_in_batch
        world = _world_size()
        if self.echo_normalization != "token_mean":
            if items is not None:  # given but unused by this normaliser: still a valid count
                items_on_device("num_echo_items_in_batch", items, None, "echo tokens", checks)
            # every completion (B; at least 1: an empty batch's echo term is 0)
            return float(max(batch_size, 1)) if self.echo_normalization == "sequence_mean" else None
        if items is None and world == 1:
            return None  # this call's echo tokens: the loss counts them (no launch here)
        if items is None:  # the batch's echo tokens over the ranks
            count = _all_reduced(echo.sum(dtype=torch.float64))
        else:
            count = items_on_device(
                "num_echo_items_in_batch", items, echo.sum(), "echo tokens", checks
            )
        # max(·, 1): only a batch without echo tokens has a count of 0, and its term is 0.
        divisor = count.clamp(min=1)
        return (divisor if world == 1 else divisor / world).float()

    def forward(
        self,
        logits: torch.Tensor,
        selected_token_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        advantages: torch.Tensor,
        ref_per_token_logps: torch.Tensor | None = None,
        old_per_token_logps: torch.Tensor | None = None,
        *,
        echo_weights: torch.Tensor | None = None,
        observation_mask: torch.Tensor | None = None,
        inference_logprobs: torch.Tensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
        num_echo_items_in_batch: float | torch.Tensor | None = None,
        normalizers: Normalizers | None = None,
        env_names: Sequence[str] | None = None,
    ) -> LossOutput:
        """The loss of one batch from its logits.

        Args:
            logits: ``[B, T, V]``, row ``t`` predicting ``selected_token_ids[:, t]``.
            selected_token_ids: ``[B, T]`` int64 sampled (or observed) tokens.
            attention_mask: ``[B, T]`` 1 = the token takes part (RL, or echo where echoed).
            advantages: ``[B]`` or ``[B, T]``.
            ref_per_token_logps, old_per_token_logps: ``[B, T]`` (None = on-policy: the ratio's
                denominator is this pass's logprobs, detached).
            echo_weights: ``[B, T]`` λ per token (0 = not echoed; echoed tokens leave RL).
            observation_mask: ``[B, T]`` tokens counted in ``|O_i|`` (``sequence_mean``).
            inference_logprobs: ``[B, T]`` sampling logprobs, for ``LossConfig.mismatch``.
            num_items_in_batch: RL tokens of the whole batch (``dapo``/``cispo``; None = this
                call's, summed over ranks); refused with ``config=`` (pass ``normalizers``).
            num_echo_items_in_batch: echo tokens of the whole batch (``token_mean``); refused
                with ``config=``.
            normalizers: with ``config=`` only, as in [`echoloss.echo_loss`][echoloss.echo_loss].
            env_names: per-sequence env names for ``<name>/<env>`` metrics.

        Returns:
            [`echoloss.LossOutput`][echoloss.LossOutput] ``(loss, metrics)``.

        Raises:
            TypeError, ValueError: a wrong shape, dtype or option at once; a bad value (an
                attention mask not 0/1, a negative or non-finite echo weight, a non-finite
                advantage, a logprob input above 0 or non-finite, a label outside ``[0, V)``,
                on the rows where it is read) names the argument as passed and shows its
                value, at once off CUDA and at the next host read on CUDA
                (``echoloss/_deferred.py``), the same message either way.
        """
        raise_deferred_errors(block=False)  # errors of earlier calls whose work is done
        checks = DeferredChecks(logits.device)
        rl, echo, w, scored = self._rows(attention_mask, echo_weights, checks)
        temp = self._temperatures(rl, echo)
        # On the device path the loss checks the labels' range, not the op; the temperatures
        # are the module's, validated.
        label_check = label_check_on_device(selected_token_ids, logits.shape[-1], logits.device)
        op = selective_logprobs if label_check is None else selective_logprobs_checked_by_caller
        with checks.collecting():  # what the op checks joins the call (none on the device path)
            lp, ent = op(
                logits,
                selected_token_ids,
                temperature=temp,
                return_entropy=True,
                mask=scored,
                chunk_size=self.row_chunk_size,
                backend="auto",
            )
        call = _CallInputs(
            advantages, ref_per_token_logps, old_per_token_logps, inference_logprobs,
            observation_mask, num_items_in_batch, num_echo_items_in_batch, normalizers, env_names,
        )  # fmt: skip
        setup = self._setup(rl, echo, w, call, checks)
        return self._loss(lp, ent, rl, echo, setup, call, checks, label_check=label_check)


class EchoFusedLinearGRPOLoss(EchoGRPOLoss):
    """`EchoGRPOLoss` from hidden states and the LM head, never the ``[B, T, V]`` logits.

    Same constructor as `EchoGRPOLoss` (Liger's options); the call is Liger's:
    ``loss_fn(_input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
    ref_per_token_logps=None, old_per_token_logps=None, ...)`` plus the echo keywords.

    Weight dtype: ``lin_weight`` (and ``bias``) are cast to ``_input``'s dtype, as Liger does,
    so an fp32 master weight with bf16 hidden states computes bf16 logits (accumulated in
    fp32); the cast is differentiable, so ``lin_weight.grad`` arrives in the weight's own dtype.
    The cast copies the weight once per call when the dtypes differ.

    Bias: ``logits = _input @ lin_weight.T + bias`` is computed as ``[_input, 1] @ [lin_weight,
    bias].T`` (one extra column), so the bias gets its exact gradient ``Σ_rows ∂L/∂logits``
    through the same fused op. It costs one copy of ``_input`` and one of the weight, each with
    one more column.

    Gradients, as in
    [`echoloss.echo_loss_from_hidden`][echoloss.loss.echo_loss_from_hidden]: when every
    participating token fits one chunk (``row_chunk_size``; on CUDA by default up to ``4·H``
    tokens in bf16) the chunk's logits are kept for backward, which writes their gradient
    over them (logits-then-loss's GEMMs and phases, for any ``loss_type``). Over several
    chunks, for a chunk-additive loss (`echoloss.loss.checks.chunk_additive`: ``loss_type``
    ``grpo``, ``dapo``, ``bnpo``, ``dr_grpo``, ``luspo`` and token-level ``cispo``, or a
    ``config=`` with a per-token policy and no sequence-level mismatch correction) with
    ``_input`` or ``lin_weight`` requiring a gradient, ``d _input`` and ``d lin_weight`` (and
    ``d bias``) are formed in the forward pass while each chunk's logits are in memory: one
    LM-head GEMM per chunk instead of two, the ``[V, H]`` weight gradient held from forward to
    backward, one backward per loss; ``sapo`` and sequence-level ratios recompute each chunk's
    logits in backward. Same loss, metrics and gradients on every path
    (``tests/nn/test_fused_module_gradients.py``, ``tests/ops/test_fused_linear.py``).

    Examples:
        >>> import torch
        >>> loss_fn = EchoFusedLinearGRPOLoss(beta=0.0, loss_type="grpo")
        >>> hidden = torch.zeros(1, 2, 3, requires_grad=True)
        >>> head = torch.nn.Linear(3, 4)
        >>> out = loss_fn(hidden, head.weight, torch.tensor([[0, 1]]), torch.ones(1, 2),
        ...               torch.tensor([1.0]), bias=head.bias,
        ...               echo_weights=torch.tensor([[0.0, 0.5]]))
        >>> out.loss.backward()
        >>> head.bias.grad.shape
        torch.Size([4])
    """

    def forward(  # type: ignore[override]
        self,
        _input: torch.Tensor,
        lin_weight: torch.Tensor,
        selected_token_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        advantages: torch.Tensor,
        bias: torch.Tensor | None = None,
        ref_per_token_logps: torch.Tensor | None = None,
        old_per_token_logps: torch.Tensor | None = None,
        ref_input: torch.Tensor | None = None,
        ref_weight: torch.Tensor | None = None,
        ref_bias: torch.Tensor | None = None,
        vllm_is_ratio: torch.Tensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
        *,
        echo_weights: torch.Tensor | None = None,
        observation_mask: torch.Tensor | None = None,
        inference_logprobs: torch.Tensor | None = None,
        num_echo_items_in_batch: float | torch.Tensor | None = None,
        normalizers: Normalizers | None = None,
        env_names: Sequence[str] | None = None,
    ) -> LossOutput:
        """The loss of one batch from hidden states ``_input [B, T, H]`` and ``lin_weight
        [V, H]`` (and ``bias [V]``); other arguments as `EchoGRPOLoss.forward`.

        ``ref_input``/``ref_weight``/``ref_bias`` (the reference model's head) and
        ``vllm_is_ratio`` are Liger arguments without an equivalent here: pass
        ``ref_per_token_logps``, and ``inference_logprobs`` with ``LossConfig.mismatch``
        (TRL's ``vllm_importance_sampling_*``), instead; giving them is an error.
        """
        for name, value in (
            ("ref_input", ref_input),
            ("ref_weight", ref_weight),
            ("ref_bias", ref_bias),
            ("vllm_is_ratio", vllm_is_ratio),
        ):
            if value is not None:
                raise ValueError(
                    f"{name}: not supported by EchoFusedLinearGRPOLoss; pass "
                    "ref_per_token_logps (reference logprobs) instead of the reference head, and "
                    "inference_logprobs with LossConfig(mismatch=...) instead of vllm_is_ratio"
                )
        if _input.dim() != 3 or lin_weight.dim() != 2:
            raise ValueError(
                f"_input: expected [B, T, H] and lin_weight [V, H], got {list(_input.shape)} and "
                f"{list(lin_weight.shape)}"
            )
        b, t, h = _input.shape
        raise_deferred_errors(block=False)  # errors of earlier calls whose work is done
        checks = DeferredChecks(_input.device)
        hidden = _input.reshape(b * t, h)
        weight = lin_weight.to(_input.dtype)
        if bias is not None:
            if bias.shape != (lin_weight.shape[0],):
                raise ValueError(
                    f"bias: expected [V] = [{lin_weight.shape[0]}], got {list(bias.shape)}"
                )
            hidden = torch.cat([hidden, hidden.new_ones(b * t, 1)], dim=1)
            weight = torch.cat([weight, bias.to(_input.dtype).unsqueeze(1)], dim=1)
        hidden, weight = check_linear_inputs(hidden, weight)
        row_chunk_size = check_chunk_size(self.row_chunk_size)
        early = start_logits(
            hidden, weight, chunk_size=row_chunk_size
        )  # the GPU starts while we set up
        rl, echo, w, scored = self._rows(attention_mask, echo_weights, checks)
        temp = self._temperatures(rl, echo)
        flat_temp = temp if isinstance(temp, float) else temp.reshape(-1)
        call = _CallInputs(
            advantages, ref_per_token_logps, old_per_token_logps, inference_logprobs,
            observation_mask, num_items_in_batch, num_echo_items_in_batch, normalizers, env_names,
        )  # fmt: skip
        setup = self._setup(rl, echo, w, call, checks)
        labels = selected_token_ids.reshape(-1)
        coefficients = None
        if chunk_additive(setup.config, None):
            coefficients = functools.partial(self._row_coefficients, rl, setup, call)
        label_check = label_check_on_device(labels, weight.shape[0], hidden.device)
        with checks.collecting():  # what the op checks joins the call (none on the device path)
            lp, ent, grads = linear_logprobs_for_loss(
                hidden, weight, labels, flat_temp, scored.reshape(-1), True,
                row_chunk_size, "auto", coefficients, early=early,
                labels_checked_by_caller=label_check is not None,
            )  # fmt: skip
        out = self._loss(
            lp.view(b, t), ent.view(b, t), rl, echo, setup, call, checks,
            source="_input", label_check=label_check,
        )  # fmt: skip
        if grads is None:
            return out
        return LossOutput(attach_gradients(out.loss, hidden, weight, *grads), out.metrics)

    def _row_coefficients(
        self, rl: torch.Tensor, setup: _CallSetup, call: _CallInputs
    ) -> RowCoefficients:
        """Each row's ``d loss / d logprob`` from that row alone (`row_coefficients`) for a
        chunk-additive loss, from the fields the record of `_loss` will hold (checked in `_setup`);
        on-policy (no ``old_per_token_logps``) the ratio's denominator is the row's own
        logprob, as in `_loss`."""
        cfg = setup.config
        old_per_token_logps = call.old_per_token_logps
        x = unchecked_inputs(
            rl_mask=rl,
            echo_weights=setup.echo_weights,
            advantages=setup.advantages,
            inference_logprobs=call.inference_logprobs,
            old_logprobs=None if old_per_token_logps is None else old_per_token_logps.float(),
            ref_logprobs=call.ref_per_token_logps if cfg.kl_coef > 0 else None,
            observation_mask=setup.observation_mask,
            sequence_ids=self._sequence_ids(rl),  # as `_loss`'s: one sequence per batch row
        )
        return row_coefficients(
            x,
            cfg,
            get_policy(cfg.policy),
            setup.normalizers,
            divisors=setup.divisors,
            own_old_logprobs=old_per_token_logps is None,
        )
