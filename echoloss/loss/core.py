"""The split RL + echo loss: ``L = L_RL(RL rows) + L_echo(echo rows)``, sharing one log-softmax.

[`echo_loss`][echoloss.loss.echo_loss] takes logits; [`echo_loss_from_logprobs`][echoloss.loss.echo_loss_from_logprobs] takes per-token logprobs (the same
loss algebra, for callers that computed logprobs elsewhere, and for the gradient tests). The
logits path computes logprobs with [`echoloss.ops.selective_logprobs`][echoloss.ops.selective_logprobs] for the rows that
participate only; everything after that is ``[N]``-sized PyTorch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from echoloss._compile import compiler_disable
from echoloss.loss.config import LossConfig
from echoloss.loss.metrics import RESERVED_ENV, loss_metrics
from echoloss.loss.normalization import Normalizers, split_rows
from echoloss.loss.policy import (
    PolicyFn,
    PolicyInputs,
    PolicyOutput,
    cispo_loss,
    dppo_loss,
    gspo_loss,
    k3,
    kl_penalty,
    mismatch_weights,
    ppo_clip_loss,
    reinforce_loss,
)
from echoloss.ops._checks import check_finite, check_per_token, check_tensor, describe
from echoloss.ops.selective_logprobs import selective_logprobs

__all__ = ["LossOutput", "echo_loss", "echo_loss_from_logprobs"]


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


_RATIO_POLICIES = ("dppo", "ppo_clip", "cispo", "gspo")


@dataclass
class _Rows:
    """Validated, flattened per-token inputs."""

    rl: torch.Tensor  # [N] bool, RL rows (echoed rows removed)
    echo: torch.Tensor  # [N] bool, echo rows (weight > 0)
    echo_weights: torch.Tensor | None
    advantages: torch.Tensor | None
    inference_logprobs: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    sequence_ids: torch.Tensor | None
    observation_mask: torch.Tensor | None
    env_names: list[str] | None
    config: LossConfig


def _flat(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.reshape(-1)


def _validate(
    shape: torch.Size,
    device: torch.device,
    *,
    rl_mask: Any,
    echo_weights: Any,
    advantages: Any,
    inference_logprobs: Any,
    old_logprobs: Any,
    ref_logprobs: Any,
    sequence_ids: Any,
    observation_mask: Any,
    env_names: Any,
    config: Any,
    policy_fn: Any,
    normalizers: Any,
) -> _Rows:
    if config is None:
        config = LossConfig()
    if not isinstance(config, LossConfig):
        raise TypeError(f"config: expected an echoloss.LossConfig or None, got {describe(config)}")
    if normalizers is not None and not isinstance(normalizers, Normalizers):
        raise TypeError(
            f"normalizers: expected echoloss.Normalizers or None (None = this call is the whole "
            f"batch), got {describe(normalizers)}"
        )

    def per_token(name: str, x: Any, kind: str) -> torch.Tensor | None:
        if x is None:
            return None
        return check_per_token(name, x, shape, device, kind).reshape(-1)

    rl_mask = per_token("rl_mask", check_tensor("rl_mask", rl_mask), "bool")
    assert rl_mask is not None
    ew = per_token("echo_weights", echo_weights, "float")
    if ew is not None:
        bad = ~torch.isfinite(ew) | (ew < 0)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"echo_weights: expected finite weights ≥ 0 (0 = not echoed), found "
                f"{float(ew[i])} at row {i}"
            )
    rl, echo = split_rows(rl_mask, ew)
    any_echo = bool(echo.any())
    adv = per_token("advantages", advantages, "float")
    lq = per_token("inference_logprobs", inference_logprobs, "float")
    old = per_token("old_logprobs", old_logprobs, "float")
    ref = per_token("ref_logprobs", ref_logprobs, "float")
    sid = per_token("sequence_ids", sequence_ids, "int")
    obs = per_token("observation_mask", observation_mask, "bool")

    # Modes that have no RL term, and RL losses that cannot see the echo weights.
    if config.mode == "sft" and any_echo:
        raise ValueError(
            "echo rows with mode='sft': echo is only defined next to an RL term (the SFT loss "
            "would train the echoed rows with the RL normaliser); put those rows in rl_mask as "
            "SFT targets instead, or use mode='rl'"
        )
    if config.policy == "custom" and policy_fn is None and config.mode == "rl":
        raise ValueError(
            "config.policy='custom' needs policy_fn=fn(inputs, config) -> PolicyOutput"
        )
    if policy_fn is not None and config.policy != "custom":
        raise ValueError(
            f"policy_fn was given but config.policy={config.policy!r}; set policy='custom' to use it"
        )
    custom = config.policy == "custom" and config.mode == "rl"
    if custom and any_echo and not config.allow_echo_with_custom_policy:
        raise ValueError(
            "echo rows with a custom policy: the custom function receives only the RL rows "
            "and cannot see the echo weights, which are trained by the separate echo term. "
            "If it does not need them (e.g. it does not normalise by the total count of loss "
            "tokens), set LossConfig(allow_echo_with_custom_policy=True)"
        )

    any_rl = bool(rl.any())
    if config.mode == "rl" and any_rl:
        if adv is None:
            raise ValueError("advantages: required in mode='rl' ([N] float, 0 outside rl_mask)")
        check_finite("advantages", adv, rl)
        needs_lq = (config.policy in _RATIO_POLICIES and old is None) or config.mismatch is not None
        if needs_lq and lq is None:
            raise ValueError(
                f"inference_logprobs: required by policy={config.policy!r}"
                + (f" with mismatch={config.mismatch!r}" if config.mismatch else "")
                + " ([N] float sampling logprobs; placeholders outside rl_mask are never read)"
            )
    for name, t in (("inference_logprobs", lq), ("old_logprobs", old)):
        if t is not None:
            check_finite(name, t, rl)
    if config.kl_coef > 0 and config.mode == "rl" and any_rl:
        if ref is None:
            raise ValueError(
                f"ref_logprobs: required by kl_coef={config.kl_coef} ([N] float reference-model "
                "logprobs of the labels); or set kl_coef=0"
            )
        check_finite("ref_logprobs", ref, rl)

    needs_seq = []
    if config.mode == "rl" and config.policy == "gspo":
        needs_seq.append("policy='gspo'")
    if config.mismatch is not None and config.mismatch.startswith("sequence"):
        needs_seq.append(f"mismatch={config.mismatch!r}")
    if config.rl_normalization.startswith("sequence"):
        needs_seq.append(f"rl_normalization={config.rl_normalization!r}")
    if config.echo_normalization == "sequence_mean":
        needs_seq.append("echo_normalization='sequence_mean'")
        if obs is None:
            raise ValueError(
                "observation_mask: required by echo_normalization='sequence_mean' ([N] bool, the "
                "rows counted in the paper's Z_i = |O_i|: observation body tokens, warnings "
                "included); or choose another echo_normalization"
            )
    if env_names is not None:
        needs_seq.append("env_names")
    if needs_seq and sid is None:
        raise ValueError(
            f"sequence_ids: required by {', '.join(needs_seq)} ([N] int64 row -> sequence within "
            "the micro-batch, -1 for padding)"
        )
    if sid is not None and bool((sid[rl | echo] < 0).any()):
        raise ValueError(
            "sequence_ids: a row that participates (RL or echo) has sequence id -1 (padding)"
        )
    names: list[str] | None = None
    if env_names is not None:
        if isinstance(env_names, str) or not isinstance(env_names, Sequence):
            raise TypeError(
                f"env_names: expected a list of str (one per sequence id), got {describe(env_names)}"
            )
        names = list(env_names)
        for i, e in enumerate(names):
            if not isinstance(e, str):
                raise TypeError(f"env_names[{i}]: expected a str, got {describe(e)}")
            if e == RESERVED_ENV:
                raise ValueError(
                    f"env_names[{i}] = {RESERVED_ENV!r} is reserved (metrics use '<name>/all' for "
                    "every env); rename the env"
                )
        assert sid is not None
        if sid.numel() and int(sid.max()) >= len(names):
            raise ValueError(
                f"env_names: has {len(names)} entries but sequence_ids reaches {int(sid.max())}; "
                "give one name per sequence id ('' for padding)"
            )
    return _Rows(rl, echo, ew, adv, lq, old, ref, sid, obs, names, config)


def _check_normalizers(norms: Normalizers, local: Normalizers, cfg: LossConfig) -> None:
    """The global counts a configured mode divides by must cover this call's own counts."""
    used = []
    if cfg.rl_normalization == "token_mean":
        used.append("rl_tokens")
    if cfg.echo_normalization == "token_mean":
        used.append("echo_tokens")
    if cfg.echo_normalization == "batch_token_mean":
        used.append("echo_batches")
    if cfg.rl_normalization.startswith("sequence") or cfg.echo_normalization == "sequence_mean":
        used.append("sequences")
    for name in used:
        g, loc = getattr(norms, name), getattr(local, name)
        if g < loc:
            hint = (
                " (count_normalizers needs sequence_ids for the sequence_mean* modes)"
                if name == "sequences" and g == 0
                else ""
            )
            raise ValueError(
                f"normalizers.{name}={g} is smaller than this call's {loc}{hint}: normalizers must "
                "be the sum over every micro-batch of the step on every rank (count_normalizers "
                "for each micro-batch, summed, then all_reduce_normalizers)"
            )


def _rl_term(
    per_tok: torch.Tensor,
    cfg: LossConfig,
    norms: Normalizers,
    seq: torch.Tensor | None,
    num_seq: int,
) -> torch.Tensor:
    mode = cfg.rl_normalization
    if mode == "token_mean":
        return per_tok.sum() / max(norms.rl_tokens, 1)
    if mode == "token_sum_constant":
        assert cfg.rl_normalization_constant is not None
        return per_tok.sum() / cfg.rl_normalization_constant
    assert seq is not None
    if mode == "sequence_mean_token_sum":
        return per_tok.sum() / max(norms.sequences, 1)
    # sequence_mean_token_mean: Σ_i (Σ_{t∈RL_i} ℓ_t / |RL_i|) / S
    counts = torch.bincount(seq, minlength=num_seq).to(per_tok.dtype).clamp(min=1)
    per_seq = per_tok.new_zeros(num_seq).index_add(0, seq, per_tok)
    return (per_seq / counts).sum() / max(norms.sequences, 1)


def _echo_term(
    per_tok: torch.Tensor,
    cfg: LossConfig,
    norms: Normalizers,
    seq: torch.Tensor | None,
    z: torch.Tensor | None,
    num_seq: int,
) -> torch.Tensor:
    mode = cfg.echo_normalization
    if mode == "token_mean":
        return per_tok.sum() / max(norms.echo_tokens, 1)
    if mode == "sum":
        return per_tok.sum()
    if mode == "batch_token_mean":
        return per_tok.sum() / max(per_tok.numel(), 1) / max(norms.echo_batches, 1)
    # sequence_mean: Σ_i (Σ_{t∈O'_i} w_t·nll_t / (Z_i + ε)) / S
    assert seq is not None and z is not None
    per_seq = per_tok.new_zeros(num_seq).index_add(0, seq, per_tok)
    denom = z.to(per_tok.dtype) + cfg.echo_z_epsilon
    denom = denom.masked_fill(z == 0, 1.0)  # a sequence without echo rows contributes 0
    return (per_seq / denom).sum() / max(norms.sequences, 1)


def _compute(
    lp: torch.Tensor,
    ent: torch.Tensor | None,
    rows: _Rows,
    normalizers: Normalizers | None,
    policy_fn: PolicyFn | None,
) -> LossOutput:
    cfg = rows.config
    rl_idx = rows.rl.nonzero().squeeze(1)
    echo_idx = rows.echo.nonzero().squeeze(1)
    n_rl, n_echo = int(rl_idx.numel()), int(echo_idx.numel())

    # Local sequences: those with at least one RL or echo row, numbered 0..S_local-1.
    seq_rl = seq_echo = table = None
    num_seq = 0
    if rows.sequence_ids is not None:
        sid = rows.sequence_ids.long()
        part_ids = sid[rows.rl | rows.echo]
        uniq = torch.unique(part_ids)
        num_seq = int(uniq.numel())
        size = int(sid.max()) + 1 if sid.numel() else 0
        table = torch.full((max(size, 1),), -1, dtype=torch.long, device=sid.device)
        table[uniq] = torch.arange(num_seq, device=sid.device)
        seq_rl = table[sid[rl_idx]]
        seq_echo = table[sid[echo_idx]]

    local = Normalizers(
        rl_tokens=n_rl, echo_tokens=n_echo, sequences=num_seq, echo_batches=int(n_echo > 0)
    )
    if normalizers is None:
        norms = local
    else:
        _check_normalizers(normalizers, local, cfg)
        norms = normalizers

    # ---- RL term (RL rows only) ----
    lp_rl = lp.index_select(0, rl_idx)
    rl_means: dict[str, torch.Tensor] = {}
    flags: dict[str, torch.Tensor] = {}
    if cfg.mode == "sft" or n_rl == 0:
        per_tok = -lp_rl  # the SFT NLL; an empty (zero) sum when there are no RL rows
    else:
        assert rows.advantages is not None
        adv = rows.advantages.index_select(0, rl_idx).to(lp.dtype) * cfg.adv_tau
        lq = (
            None
            if rows.inference_logprobs is None
            else rows.inference_logprobs.index_select(0, rl_idx).to(lp.dtype)
        )
        if rows.old_logprobs is not None:
            base = rows.old_logprobs.index_select(0, rl_idx).to(lp.dtype)
        elif cfg.mismatch is not None or lq is None:
            base = lp_rl.detach()  # on-policy: the behaviour policy is the current one
        else:
            base = lq  # prime-rl: the ratio is taken against the inference logprobs
        base = base.detach()
        inputs = PolicyInputs(lp_rl, base, adv, seq_rl, num_seq)
        clamp = cfg.log_ratio_clamp
        out: PolicyOutput
        if cfg.policy == "dppo":
            out = dppo_loss(inputs, low=cfg.dppo_low, high=cfg.dppo_high, log_ratio_clamp=clamp)
        elif cfg.policy == "ppo_clip":
            lo, hi = cfg.resolved_eps
            out = ppo_clip_loss(
                inputs, eps_low=lo, eps_high=hi, dual_clip=cfg.dual_clip, log_ratio_clamp=clamp
            )
        elif cfg.policy == "cispo":
            out = cispo_loss(
                inputs, weight_max=cfg.cispo_max, weight_min=cfg.cispo_min, log_ratio_clamp=clamp
            )
        elif cfg.policy == "gspo":
            lo, hi = cfg.resolved_eps
            out = gspo_loss(inputs, eps_low=lo, eps_high=hi, log_ratio_clamp=clamp)
        elif cfg.policy == "reinforce":
            out = reinforce_loss(inputs)
        else:
            assert policy_fn is not None
            out = policy_fn(inputs, cfg)
            if not isinstance(out, PolicyOutput) or out.loss.shape != lp_rl.shape:
                raise TypeError(
                    f"policy_fn: expected a PolicyOutput whose loss has shape {list(lp_rl.shape)} "
                    f"(one entry per RL row), got {describe(getattr(out, 'loss', out))}"
                )
        per_tok = out.loss
        flags.update(out.flags)
        if cfg.mismatch is not None:
            assert lq is not None
            w, wf = mismatch_weights(
                base,
                lq,
                mode=cfg.mismatch,
                weight_max=cfg.mismatch_max,
                weight_min=cfg.mismatch_min,
                sequence_index=seq_rl,
                num_sequences=num_seq,
                log_ratio_clamp=clamp,
            )
            per_tok = per_tok * w
            flags.update(wf)
            rl_means["is_weight"] = w
        kl_tau = cfg.resolved_kl_tau
        if kl_tau != 0:
            log_ratio = lp_rl - base
            per_tok = per_tok + kl_tau * log_ratio * log_ratio
        if cfg.kl_coef != 0:
            assert rows.ref_logprobs is not None
            ref = rows.ref_logprobs.index_select(0, rl_idx).to(lp.dtype)
            kl = kl_penalty(lp_rl, ref, estimator=cfg.kl_estimator, log_ratio_clamp=clamp)
            per_tok = per_tok + cfg.kl_coef * kl
            rl_means["ref_kl"] = kl.detach()
        if cfg.entropy_coef != 0:
            assert ent is not None
            per_tok = per_tok - cfg.entropy_coef * ent.index_select(0, rl_idx)
        if lq is not None:
            with torch.no_grad():
                rl_means["mismatch_kl"] = k3(lp_rl - lq, cfg.log_ratio_clamp)
    if ent is not None and cfg.compute_entropy:
        rl_means["entropy"] = ent.detach().index_select(0, rl_idx)
    rl_term = _rl_term(per_tok, cfg, norms, seq_rl, num_seq)

    # ---- echo term (echo rows only): -w · logprob, no ratio / trust region / KL / adv_tau ----
    lp_echo = lp.index_select(0, echo_idx)
    if rows.echo_weights is not None:
        w_echo = rows.echo_weights.index_select(0, echo_idx).to(lp.dtype)
    else:
        w_echo = lp_echo.new_zeros(0)
    z = None
    if cfg.echo_normalization == "sequence_mean" and table is not None:
        assert rows.observation_mask is not None and rows.sequence_ids is not None
        sid = rows.sequence_ids.long()
        counted = (rows.observation_mask | rows.echo) & (sid >= 0)  # Z_i ≥ |O'_i| always
        zs = table[sid[counted]]  # -1: a sequence with no RL or echo row (contributes 0)
        zs = zs[zs >= 0]
        z = torch.bincount(zs, minlength=num_seq)
    echo_term = _echo_term(w_echo * -lp_echo, cfg, norms, seq_echo, z, num_seq)

    loss = rl_term + echo_term
    if n_rl == 0 and n_echo == 0:
        # Keep the (zero) loss connected to the graph: distributed backward must not hang.
        loss = loss + lp.sum() * 0.0
    env_rl = env_echo = None
    env_list: list[str] = []
    if rows.env_names is not None and rows.sequence_ids is not None:
        env_list = sorted({e for e in rows.env_names if e})
        lookup = {e: i for i, e in enumerate(env_list)}
        seq_env = torch.tensor(
            [lookup.get(e, -1) for e in rows.env_names], dtype=torch.long, device=lp.device
        )
        sid = rows.sequence_ids.long()
        env_rl = seq_env[sid[rl_idx]]
        env_echo = seq_env[sid[echo_idx]]
    metrics = loss_metrics(
        rl_env=env_rl,
        echo_env=env_echo,
        env_names=env_list,
        num_rl=n_rl,
        num_echo=n_echo,
        rl_means=rl_means,
        rl_flags=flags,
        echo_nll=-lp_echo.detach(),
        totals={"loss_rl": rl_term, "loss_echo": echo_term},
        device=lp.device,
    )
    return LossOutput(loss, metrics)


def echo_loss_from_logprobs(
    logprobs: torch.Tensor,
    *,
    rl_mask: torch.Tensor,
    echo_weights: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    inference_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    config: LossConfig | None = None,
    normalizers: Normalizers | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    observation_mask: torch.Tensor | None = None,
    env_names: Sequence[str] | None = None,
    policy_fn: PolicyFn | None = None,
) -> LossOutput:
    """The loss of [`echo_loss`][echoloss.loss.echo_loss] from per-token logprobs (and entropy) computed elsewhere.

    ``logprobs`` must already be at the right temperature per row (sampling temperature on RL
    rows; see ``LossConfig.echo_temperature`` for echo rows). Values on rows that do not
    participate are never read.

    Args:
        logprobs: ``[N]`` float, differentiable.
        rl_mask, echo_weights, advantages, inference_logprobs, config, normalizers, old_logprobs,
            ref_logprobs, sequence_ids, observation_mask, env_names, policy_fn: as in
            [`echo_loss`][echoloss.loss.echo_loss], with shape ``[N]``.
        entropy: ``[N]`` per-token entropy: required when ``config.entropy_coef != 0``; used for
            the ``entropy`` metric when given.

    Returns:
        [`LossOutput`][echoloss.loss.LossOutput].

    Examples:
        >>> lp = torch.tensor([-0.2, -0.4], requires_grad=True)
        >>> out = echo_loss_from_logprobs(
        ...     lp, rl_mask=torch.tensor([True, False]), echo_weights=torch.tensor([0.0, 0.5]),
        ...     advantages=torch.tensor([1.0, 0.0]), inference_logprobs=torch.tensor([-0.2, 0.0]))
        >>> out.loss  # RL: -1·1·r(=1) / 1 token; echo: -0.5·(-0.4) / 1 token
        tensor(-0.8000, grad_fn=<AddBackward0>)
        >>> out.loss.backward(); lp.grad
        tensor([-1.0000, -0.5000])
    """
    logprobs = check_tensor("logprobs", logprobs)
    if not logprobs.dtype.is_floating_point:
        raise TypeError(f"logprobs: expected a float tensor, got {describe(logprobs)}")
    shape, dev = logprobs.shape, logprobs.device
    rows = _validate(
        shape,
        dev,
        rl_mask=rl_mask,
        echo_weights=echo_weights,
        advantages=advantages,
        inference_logprobs=inference_logprobs,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        sequence_ids=sequence_ids,
        observation_mask=observation_mask,
        env_names=env_names,
        config=config,
        policy_fn=policy_fn,
        normalizers=normalizers,
    )
    if entropy is not None:
        entropy = check_per_token("entropy", entropy, shape, dev, "float").reshape(-1)
    if rows.config.entropy_coef != 0 and entropy is None and bool(rows.rl.any()):
        raise ValueError(
            f"entropy: required by entropy_coef={rows.config.entropy_coef} ([N] per-token entropy, "
            "differentiable)"
        )
    lp = logprobs.reshape(-1)
    part = rows.rl | rows.echo
    check_finite("logprobs", lp, part)
    return _compute(lp, entropy, rows, normalizers, policy_fn)


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
        temperature: a float, a 0-dim tensor, or ``lead``-shaped per-row temperatures.
        config: the loss config.
        rl: ``[N]`` bool RL rows (flat).
        echo: ``[N]`` bool echo rows (flat).
        lead: the leading (row) shape of the logits.

    Returns:
        ``(temperature, need_entropy)``; the temperature is ``lead``-shaped when echo rows
        change it, else as given.

    Examples:
        >>> t, ent = row_temperature_and_entropy(
        ...     0.5, LossConfig(), rl=torch.tensor([True, False]),
        ...     echo=torch.tensor([False, True]), lead=torch.Size([2]))
        >>> t.tolist(), ent
        ([0.5, 1.0], True)
    """
    dev = rl.device
    temp: float | torch.Tensor = temperature
    if config.echo_temperature == "one" and bool(echo.any()):
        if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
            t = check_per_token("temperature", temperature, lead, dev, "float").reshape(-1)
            temp = t.masked_fill(echo, 1.0).view(lead)
        else:
            t0 = float(temperature)
            if t0 != 1.0:
                temp = torch.full(lead, t0, dtype=torch.float32, device=dev)
                temp.view(-1).masked_fill_(echo, 1.0)
    need_entropy = bool(rl.any()) and (config.compute_entropy or config.entropy_coef != 0)
    return temp, need_entropy


@compiler_disable
def echo_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    rl_mask: torch.Tensor,
    echo_weights: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    inference_logprobs: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    config: LossConfig | None = None,
    normalizers: Normalizers | None = None,
    backend: str = "auto",
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    observation_mask: torch.Tensor | None = None,
    env_names: Sequence[str] | None = None,
    policy_fn: PolicyFn | None = None,
    chunk_size: int | None = None,
) -> LossOutput:
    """RL loss on action rows plus echo cross-entropy on observation rows, from logits.

    ``loss = L_RL + L_echo``. ``L_RL`` is the configured policy loss (``config.policy``) over RL
    rows, plus ``kl_tau · ρ²``, the optional reference KL and entropy bonus, normalised by
    ``config.rl_normalization``. ``L_echo = Σ_{echo rows} w_t · (-log p_t)`` normalised by
    ``config.echo_normalization``: no importance ratio, trust region, KL, advantage or
    ``adv_tau``, so ``d loss / d log p_t = -w_t / N_echo`` under the default normaliser. Both terms
    share one chunked log-softmax ([`echoloss.selective_logprobs`][echoloss.ops.selective_logprobs]), computed only on rows that
    participate. ``docs/loss.md`` has every formula and decision.

    Args:
        logits: ``[N, V]`` (or ``[B, T, V]``, then every per-token input is ``[B, T]``), any float
            dtype; logprobs are computed in fp32.
        labels: ``[N]`` int64, the token each row predicts (already shifted).
        rl_mask: ``[N]`` bool, True = RL row. An echoed row leaves the RL set.
        echo_weights: ``[N]`` float ≥ 0: the echo weight (λ or α) of each row, ``0`` = not
            echoed (never counted anywhere). None = no echo.
        advantages: ``[N]`` float, read on RL rows only. Required in mode ``"rl"``.
        inference_logprobs: ``[N]`` float sampling logprobs, read on RL rows only (echo rows'
            placeholders are never read). Required by ratio policies and mismatch correction.
        temperature: sampling temperature, a float or ``[N]`` float (RL rows always use it; echo
            rows use it only with ``echo_temperature="sampling"``, else ``T = 1``).
        config: [`echoloss.LossConfig`][echoloss.loss.config.LossConfig]; None = defaults (dppo, token means).
        normalizers: global counts ([`echoloss.Normalizers`][echoloss.loss.normalization.Normalizers]) of the optimiser step; None
            means "this call is the whole batch".
        backend: ``"auto"``, ``"reference"`` or ``"triton"`` (see [`echoloss.selective_logprobs`][echoloss.ops.selective_logprobs]).
        old_logprobs: ``[N]`` optional trainer-side logprobs of the behaviour policy; the ratio's
            denominator when given (otherwise the inference logprobs, or the current logprobs
            detached when ``config.mismatch`` is set).
        ref_logprobs: ``[N]`` reference-model logprobs, required when ``config.kl_coef > 0``.
        sequence_ids: ``[N]`` int64 row → sequence within the micro-batch (``-1`` = padding).
            Required by ``gspo``, sequence-level mismatch, the ``sequence_mean*`` normalisers and
            ``env_names``. A sequence must not be split across micro-batches.
        observation_mask: ``[N]`` bool rows counted in the paper's ``Z_i = |O_i|`` (observation
            body, warnings included). Required by ``echo_normalization="sequence_mean"``; echo rows
            always count in ``Z_i``.
        env_names: env name per sequence id (``""`` = padding / no env); adds ``<name>/<env>``
            metrics. ``"all"`` is reserved.
        policy_fn: ``fn(PolicyInputs, LossConfig) -> PolicyOutput`` for ``policy="custom"``.
        chunk_size: rows per chunk of the logprob computation (None = automatic).

    Returns:
        [`LossOutput`][echoloss.loss.LossOutput] ``(loss, metrics)``.

    Raises:
        TypeError, ValueError: on a bad input (the message names the argument and the fix), on
            echo rows with ``mode="sft"``, or with a custom policy unless allowed.

    Examples:
        Golden case B of echo-semantics.md §13 (logits chosen so that log p = [-0.2, -0.4]):

        >>> import torch
        >>> from echoloss.loss import LossConfig, Normalizers
        >>> lp = torch.tensor([-0.2, -0.4])
        >>> logits = torch.stack([lp, torch.log(-torch.expm1(lp))], 1).requires_grad_()
        >>> cfg = LossConfig(dppo_low=10, dppo_high=10, kl_tau=0)
        >>> out = echo_loss(logits, torch.tensor([0, 0]), rl_mask=torch.tensor([True, True]),
        ...                 echo_weights=torch.tensor([0.0, 2.0]), advantages=torch.tensor([1.0, 2.0]),
        ...                 inference_logprobs=lp, config=cfg,
        ...                 normalizers=Normalizers(rl_tokens=1, echo_tokens=4))
        >>> # RL rows: row 0 only (row 1 is echoed); echo_loss_scale 4 as in the golden case
        >>> round(out.loss.item(), 5)  # RL -1.0 + echo -(2·-0.4)/4 = 0.2
        -0.8
        >>> float(out.metrics["echo_tokens/all"])
        1.0
    """
    logits = check_tensor("logits", logits)
    if not logits.dtype.is_floating_point or logits.dim() not in (2, 3):
        raise TypeError(
            f"logits: expected a float tensor [N, V] or [B, T, V], got {describe(logits)}"
        )
    lead, dev = logits.shape[:-1], logits.device
    rows = _validate(
        lead,
        dev,
        rl_mask=rl_mask,
        echo_weights=echo_weights,
        advantages=advantages,
        inference_logprobs=inference_logprobs,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        sequence_ids=sequence_ids,
        observation_mask=observation_mask,
        env_names=env_names,
        config=config,
        policy_fn=policy_fn,
        normalizers=normalizers,
    )
    cfg = rows.config
    part = rows.rl | rows.echo
    temp, need_ent = row_temperature_and_entropy(
        temperature, cfg, rl=rows.rl, echo=rows.echo, lead=lead
    )
    res = selective_logprobs(
        logits,
        labels,
        temperature=temp,
        return_entropy=need_ent,
        chunk_size=chunk_size,
        mask=part.view(lead),
        backend=backend,
    )
    lp, ent = res if need_ent else (res, None)
    lp = lp.reshape(-1)
    ent = None if ent is None else ent.reshape(-1)
    if ent is not None and cfg.entropy_coef == 0:
        ent = ent.detach()
    return _compute(lp, ent, rows, normalizers, policy_fn)
