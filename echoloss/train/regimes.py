"""The training regimes of a run, in the order they run, and what each one trains.

1. **Copy-task pre-training** (`copy_task_warmup`, ``warmup.copy_steps``): before anything
   else, a fresh built-in tiny model learns generic in-context copying (random token ids,
   repeated). Its own optimiser; nothing about the environment.
2. **SFT warm-up** (``warmup.steps`` steps): cross-entropy on the assistant tokens of the env's
   scripted demonstrations (``LossConfig(mode="sft")``: no RL, no echo), with its own learning
   rate (`warmup_lr`).
3. **Observation-CE warm-up** (during the warm-up, ``warmup.obs_weight > 0``): a second loss in
   the same forward pass, the cross-entropy of the observation tokens at that weight, so that
   RL starts with calibrated observation predictions.
4. **RL + echo** (``train.max_steps`` steps): the configured policy loss on the sampled replies,
   plus λ (``echo.alpha``, on its schedule) times the cross-entropy of the tool observations.

A step's regime is a `Phase` (`phase_at`); `step_losses` gives the losses it trains, in the
order their gradients accumulate, and `phase_row` the metrics only that regime logs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

import echoloss
from echoloss.loss import (
    LossConfig,
    LossInputs,
    LossOutput,
    Normalizers,
    echo_loss,
    echo_loss_from_hidden,
)
from echoloss.schedules import echo_alpha
from echoloss.train.config import EchoSection, WarmupConfig

__all__ = [
    "SFT",
    "Phase",
    "Scores",
    "copy_task_warmup",
    "observation_ce",
    "phase_at",
    "phase_row",
    "runs_copy_task",
    "step_losses",
    "warmup_lr",
]

SFT = LossConfig(mode="sft", compute_entropy=False)  # the warm-up's loss (no RL, no echo)

#: A named loss of one micro-batch, computed when called (one graph alive at a time).
NamedLoss = tuple[str, Callable[[], LossOutput]]


@dataclass(frozen=True)
class Phase:
    """What one optimiser step trains.

    Attributes:
        kind: ``"warmup"`` (SFT, plus the observation CE) or ``"rl"`` (RL, plus echo).
        rl_step: the 0-based RL step (negative during the warm-up).
        alpha: this step's echo weight λ (0 during the warm-up).
        echo: the echo config ``interleave`` builds the samples with: the warm-up's observation
            CE, RL's echo at λ, or None (no observation tokens trained).
        lr: this step's learning rate.
    """

    kind: Literal["warmup", "rl"]
    rl_step: int
    alpha: float
    echo: echoloss.EchoConfig | None
    lr: float

    @property
    def warm(self) -> bool:
        return self.kind == "warmup"


def phase_at(
    step: int, warm_steps: int, *, warmup: WarmupConfig, echo: EchoSection, rl_lr: float
) -> Phase:
    """The regime of optimiser step ``step`` (0-based; the warm-up's ``warm_steps`` come first):
    the warm-up's from the ``[warmup]`` section, RL's from the ``[echo]`` section (λ on its
    schedule) at the RL learning rate ``rl_lr`` (``optim.lr``).

    Example:
        >>> from echoloss.train.config import EchoSection, WarmupConfig
        >>> warmup, echo = WarmupConfig(steps=2, lr=0.01, lr_ramp_steps=2), EchoSection(alpha=0.1)
        >>> p = phase_at(0, 2, warmup=warmup, echo=echo, rl_lr=1e-3)
        >>> p.kind, p.rl_step, p.lr
        ('warmup', -2, 0.005)
        >>> p = phase_at(2, 2, warmup=warmup, echo=echo, rl_lr=1e-3)
        >>> p.kind, p.rl_step, p.alpha, p.lr
        ('rl', 0, 0.1, 0.001)
    """
    rl_step = step - warm_steps
    if step < warm_steps:
        obs = _observation_config(warmup.obs_weight)
        lr = warmup_lr(step, lr=warmup.lr, ramp_steps=warmup.lr_ramp_steps)
        return Phase("warmup", rl_step, 0.0, obs, lr)
    alpha = echo_alpha(
        rl_step,
        alpha=echo.alpha,
        schedule=echo.schedule,
        steps=echo.schedule_steps,
        final_alpha=echo.final_alpha,
    )
    return Phase("rl", rl_step, alpha, _echo_config(echo, alpha), rl_lr)


def warmup_lr(step: int, *, lr: float, ramp_steps: int) -> float:
    """The warm-up lr: a linear ramp over ``ramp_steps`` (``warmup.lr_ramp_steps``), then ``lr``
    (``warmup.lr``). A cold start at the full SFT lr spikes the gradient norm (43 at lr 3e-3 on
    a random-init model).

    Example:
        >>> [warmup_lr(k, lr=0.01, ramp_steps=4) for k in range(5)]
        [0.0025, 0.005, 0.0075, 0.01, 0.01]
    """
    return lr * (min(step + 1, ramp_steps) / ramp_steps if ramp_steps else 1.0)


def _echo_config(e: EchoSection, alpha: float) -> echoloss.EchoConfig | None:
    """The echo config of one RL step, with that step's λ (``alpha``); None when λ = 0."""
    if alpha == 0:
        return None  # plain RL: no echo weights at all
    return echoloss.EchoConfig(
        tool=echoloss.RoleEcho(alpha=alpha),
        target=e.target,
        echo_warnings=e.echo_warnings,
        max_tokens_per_message=e.max_tokens_per_message,
    )


def _observation_config(weight: float) -> echoloss.EchoConfig | None:
    """The warm-up's observation-token CE (weight ``warmup.obs_weight``), or None when 0."""
    return None if weight == 0 else echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=weight))


@dataclass(frozen=True)
class Scores:
    """What a micro-batch's losses score: the logits of every row, or the final hidden states
    and the LM head of the rows that carry loss (`echoloss.train.forward.loss_rows`), with the
    loss inputs of those rows.

    Attributes:
        inputs: the rows' `LossInputs` (``[L]`` with ``logits``, ``[n]`` with ``hidden``).
        logits: ``[L, V]``, or None.
        hidden: ``[n, H]`` and ``weight`` ``[V, H]`` (in the compute dtype), or None.
    """

    inputs: LossInputs
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None

    def loss(
        self, inputs: LossInputs, config: LossConfig, norms: Normalizers, *, backend: str = "auto"
    ) -> LossOutput:
        """The loss of these rows with ``inputs`` (``self.inputs`` or a copy with fields
        changed): [`echoloss.echo_loss`][echoloss.loss.echo_loss] on the logits, or
        [`echoloss.echo_loss_from_hidden`][echoloss.loss.echo_loss_from_hidden] (the same loss
        without the ``[L, V]`` logits)."""
        if self.logits is not None:
            return echo_loss(self.logits, inputs, config=config, normalizers=norms, backend=backend)
        if self.hidden is None or self.weight is None:
            raise ValueError("Scores: give logits, or hidden and weight")
        return echo_loss_from_hidden(
            self.hidden, self.weight, inputs, config=config, normalizers=norms, backend=backend
        )


def step_losses(
    phase: Phase,
    config: LossConfig,
    scores: Scores,
    norms: Normalizers,
) -> list[NamedLoss]:
    """The losses of one micro-batch (`Scores`: its logits or loss rows and their inputs) under
    ``phase``, in the order their gradients accumulate: ``("obs", ...)`` (the warm-up's
    observation CE, when on) then ``("main", ...)`` (SFT in the warm-up, RL + echo after it,
    with the run's loss ``config``). Each is computed when called, so that one loss graph is
    alive at a time."""
    x = scores.inputs

    def main() -> LossOutput:
        inputs = x.replace(echo_weights=None) if phase.warm else x
        return scores.loss(inputs, SFT if phase.warm else config, norms)

    def observations() -> LossOutput:  # SFT mode has no echo: a second loss, same forward
        return observation_ce(config, scores, norms)

    losses: list[NamedLoss] = [("obs", observations)] if phase.warm and phase.echo else []
    return [*losses, ("main", main)]


def observation_ce(config: LossConfig, scores: Scores, norms: Normalizers) -> LossOutput:
    """The echo term alone (the observation rows' weighted CE, no RL rows, with the run's loss
    ``config``) of one micro-batch: the warm-up's observation loss, and the echo part of the
    gradient probe."""
    x = scores.inputs
    inputs = x.replace(rl_mask=torch.zeros_like(x.rl_mask), temperature=1.0, env_names=None)
    echo_only = config.model_copy(update={"compute_entropy": False})
    return scores.loss(inputs, echo_only, norms)


def phase_row(phase: Phase, metrics: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The metrics only ``phase``'s regime logs, from each named loss's step metrics: the
    warm-up's ``loss_sft`` (and ``loss_obs``, ``obs_nll``), or RL's ``loss_rl``, ``entropy``,
    ``mismatch_kl``, ``echo_alpha`` (and ``loss_echo``, ``echo_nll`` on steps with echo); both
    with ``loss``, their sum (NaN where the step computed no loss: no gradient)."""
    m = metrics.get("main", {})
    if phase.warm:  # SFT on actions (+ observation CE): no policy-gradient metrics
        row: dict[str, Any] = {"loss_sft": m.get("loss_rl/all", math.nan)}
        if "obs" in metrics:
            o = metrics["obs"]
            row.update(
                loss_obs=o.get("loss_echo/all", math.nan),
                obs_nll=o.get("echo_nll_mean/all", math.nan),
            )
        row["loss"] = row["loss_sft"] + row.get("loss_obs", 0.0)
        return row
    row = {
        "loss_rl": m.get("loss_rl/all", math.nan),
        "entropy": m.get("entropy/all", math.nan),
        "mismatch_kl": m.get("mismatch_kl/all", math.nan),
        "echo_alpha": phase.alpha,
    }
    if phase.echo is not None:  # echo on at this step
        row.update(
            loss_echo=m.get("loss_echo/all", math.nan),
            echo_nll=m.get("echo_nll_mean/all", math.nan),
        )
    row["loss"] = row["loss_rl"] + row.get("loss_echo", 0.0)
    return row


# ------------------------------------------------------------------------------------------------
# Copy-task pre-training


def runs_copy_task(copy_steps: int, *, model_path: str | None, start: int) -> bool:
    """Whether this run trains the copy task: asked for (``warmup.copy_steps``), on a fresh
    start (``start`` 0) of the built-in tiny model (a resumed run's weights already hold it; a
    loaded ``model.path`` is trained).

    Example:
        >>> [runs_copy_task(100, model_path=None, start=s) for s in (0, 5)]
        [True, False]
    """
    return bool(copy_steps) and model_path is None and start == 0


def copy_task_warmup(
    model: Any,
    *,
    vocab_size: int,
    steps: int,
    lr: float,
    seed: int,
    device: Any,
    batch: int = 32,
    half: int = 32,
    report: Callable[[int, float], None] | None = None,
    report_every: int = 100,
) -> float:
    """Train ``model`` on generic in-context copying: each row is ``half`` random token ids
    ``[batch, half]`` repeated once, and the loss is the CE of the repeat (predictable only by
    finding the earlier occurrence of the current token and copying what followed it). Returns
    the last step's loss (nats/token; ``log vocab_size`` for a model that cannot copy).
    ``report(step, loss)`` is called every ``report_every`` steps and after the last.

    Example:
        >>> from echoloss.train.model import build_tiny_model
        >>> m = build_tiny_model(arch="qwen3", vocab_size=50, hidden_size=16, num_layers=1,
        ...                      num_heads=2, num_kv_heads=1, intermediate_size=32,
        ...                      max_position_embeddings=128, seed=0)
        >>> 0 < copy_task_warmup(m, vocab_size=50, steps=2, lr=1e-3, seed=0, device="cpu") < 5
        True
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)  # its own: discarded afterwards
    loss = torch.tensor(math.log(vocab_size))
    for step in range(1, steps + 1):
        first = torch.randint(0, vocab_size, (batch, half), generator=g)
        x = torch.cat([first, first], dim=1).to(device)
        logits = model(input_ids=x).logits[:, half - 1 : -1].float()
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, half:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if report is not None and (step % report_every == 0 or step == steps):
            report(step, loss.item())
    opt.zero_grad(set_to_none=True)
    return float(loss.item())
