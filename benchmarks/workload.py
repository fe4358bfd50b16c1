"""The benchmarked workload: one RL + echo loss step over ``[N, V]`` logits (or ``hidden @ W.T``).

Rows: 60% RL (sampled action tokens), 30% echo (observation tokens, weight ``ECHO_WEIGHT``), 10%
in neither term (prompt/padding), drawn independently per row. Sequences of ``seq_len`` rows
(``min(N, 2048)``) carry one GRPO advantage each. The inference logprobs are the true logprobs
plus ``N(0, 0.1)`` noise, so the PPO ratios are near 1 and a few tokens are clipped.

The loss is the one every provider must compute (the correctness gate checks it):

* ``LossConfig(policy="ppo_clip", compute_entropy=True)``: per RL token
  ``-min(r·A, clip(r, 0.8, 1.2)·A)`` with ``r = exp(lp - inference_lp)``, averaged over the RL
  tokens (``token_mean``), no KL; the entropy of the RL rows is computed as a metric, no gradient;
* plus ``ECHO_WEIGHT ·`` the mean cross-entropy of the echo rows (``token_mean``).

The no-grad mode is the old/reference-logprob pass: the label logprob of every row, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: The echo weight of every echo row (uniform, so "weight · mean CE" is the echo term exactly).
ECHO_WEIGHT = 0.5
#: Fractions of RL and echo rows; the rest take part in neither term.
RL_FRACTION, ECHO_FRACTION = 0.6, 0.3
#: PPO clip range of the workload (``LossConfig(policy="ppo_clip")`` defaults).
EPS_LOW, EPS_HIGH = 0.2, 0.2
MAX_SEQ_LEN = 2048

#: The three modes, in the order they are run and plotted.
MODES = ("no-grad", "forward", "forward+backward")


@dataclass
class Workload:
    """Inputs of one benchmark shape. ``logits`` is ``[N, V]``; ``hidden``/``weight`` exist only
    for the fused-linear op (``logits`` is then None)."""

    n: int
    v: int
    dtype: torch.dtype
    device: torch.device
    labels: torch.Tensor
    rl_mask: torch.Tensor
    echo_weights: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    seq_len: int
    seq_advantages: torch.Tensor
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def h(self) -> int | None:
        return None if self.hidden is None else int(self.hidden.shape[1])

    @property
    def participating(self) -> torch.Tensor:
        return self.rl_mask | (self.echo_weights > 0)

    @property
    def logits_bytes(self) -> int:
        return self.n * self.v * torch.empty(0, dtype=self.dtype).element_size()

    def loss_inputs(self) -> Any:
        """The `echoloss.LossInputs` of this workload (built once, outside any timed call)."""
        from echoloss.loss import LossInputs

        return LossInputs(
            labels=self.labels,
            rl_mask=self.rl_mask,
            echo_weights=self.echo_weights,
            advantages=self.advantages,
            inference_logprobs=self.inference_logprobs,
        )


def loss_config() -> Any:
    from echoloss.loss import LossConfig

    return LossConfig(policy="ppo_clip", compute_entropy=True)


def _randn_into(out: torch.Tensor, g: torch.Generator, scale: float) -> None:
    """Fill ``out [n, k]`` with ``scale · N(0, 1)`` in row slices (no full-size fp32 temporary)."""
    step = max(1, (1 << 24) // max(1, out.shape[1]))
    for i in range(0, out.shape[0], step):
        rows = min(step, out.shape[0] - i)
        out[i : i + rows] = (
            torch.randn(rows, out.shape[1], generator=g, device=out.device) * scale
        ).to(out.dtype)


def make_workload(
    n: int,
    v: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    hidden_size: int | None = None,
    seed: int = 0,
) -> Workload:
    """The inputs of one shape, deterministic in ``seed``.

    With ``hidden_size``, ``hidden [N, H]`` and ``weight [V, H]`` (scaled so that the logits have
    unit-order spread) replace the logits, for the fused-linear op.
    """
    seq_len = min(n, MAX_SEQ_LEN)
    if n % seq_len:
        raise ValueError(f"N={n} must be a multiple of the sequence length {seq_len}")
    g = torch.Generator(device=device).manual_seed(seed)
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    u = torch.rand(n, generator=g, device=device)
    rl = u < RL_FRACTION
    echo = (u >= RL_FRACTION) & (u < RL_FRACTION + ECHO_FRACTION)
    seq_adv = torch.randn(n // seq_len, generator=g, device=device)
    seq = torch.arange(n, device=device) // seq_len
    wl = Workload(
        n=n,
        v=v,
        dtype=dtype,
        device=device,
        labels=labels,
        rl_mask=rl,
        echo_weights=torch.where(echo, ECHO_WEIGHT, 0.0),
        advantages=torch.where(rl, seq_adv[seq], 0.0),
        inference_logprobs=torch.zeros(n, device=device),
        seq_len=seq_len,
        seq_advantages=seq_adv,
    )
    if hidden_size is None:
        wl.logits = torch.empty(n, v, dtype=dtype, device=device)
        _randn_into(wl.logits, g, 2.0)
    else:
        wl.hidden = torch.empty(n, hidden_size, dtype=dtype, device=device)
        _randn_into(wl.hidden, g, 1.0)
        wl.weight = torch.empty(v, hidden_size, dtype=dtype, device=device)
        _randn_into(wl.weight, g, 2.0 * hidden_size**-0.5)
    # Inference logprobs: the true logprob (reference op, chunked) plus noise, on RL rows only.
    from echoloss.ops import selective_logprobs
    from echoloss.ops.fused_linear import linear_selective_logprobs

    with torch.no_grad():
        if wl.logits is not None:
            lp_out = selective_logprobs(wl.logits, labels, mask=rl, backend="reference")
        else:
            assert wl.hidden is not None and wl.weight is not None
            lp_out = linear_selective_logprobs(
                wl.hidden, wl.weight, labels, mask=rl, backend="reference"
            )
    assert isinstance(lp_out, torch.Tensor)  # no entropy asked
    lp = lp_out
    noise = 0.1 * torch.randn(n, generator=g, device=device)
    wl.inference_logprobs = torch.where(rl, lp + noise, 0.0)
    return wl


def naive_logprobs_entropy(
    logits: torch.Tensor, labels: torch.Tensor, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(logits.float())`` + gather; the entropy (no gradient) from the same tensor."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    lp = lsm.gather(-1, labels[:, None]).squeeze(-1)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(lsm.exp() * lsm).sum(-1)
    return lp, ent


def naive_loss(logits: torch.Tensor, wl: Workload) -> torch.Tensor:
    """The workload's loss written out in plain PyTorch, independently of echoloss.

    ``log_softmax(logits.float())`` over all rows, gather, PPO clip over the RL rows (token mean),
    the entropy metric of the RL rows, and the echo term as a **separate**
    ``F.cross_entropy`` over the echo rows (a second pass over them), as a hand-written trainer
    does it.
    """
    lp, ent = naive_logprobs_entropy(logits, wl.labels, entropy=True)
    rl = wl.rl_mask
    ratio = torch.exp((lp[rl] - wl.inference_logprobs[rl]).clamp(-20.0, 20.0))
    adv = wl.advantages[rl]
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    loss_rl = -obj.sum() / max(int(rl.sum()), 1)
    assert ent is not None
    _ = ent[rl].mean()  # the entropy metric (computed, as every provider that can does)
    echo_idx = (wl.echo_weights > 0).nonzero().squeeze(1)
    ce = torch.nn.functional.cross_entropy(
        logits.index_select(0, echo_idx).float(), wl.labels.index_select(0, echo_idx)
    )
    return loss_rl + ECHO_WEIGHT * ce
