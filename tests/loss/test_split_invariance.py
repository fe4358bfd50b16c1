"""Hypothesis: with global counts, the loss summed over any split of the sequences into
micro-batches equals the loss of the whole batch, for every normaliser that is split-invariant,
including batches where some sequences train only the RL term or only the echo term (each term
counts its own sequences, and ``count_normalizers`` counts them as the loss does)."""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echoloss import LossConfig, LossInputs, Normalizers, count_normalizers, echo_loss_from_logprobs

F64 = torch.float64
KIND = st.sampled_from(["rl", "echo", "warning", "none"])


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[list[str]], list[float], list[float], list[float]]:
    seqs = draw(st.lists(st.lists(KIND, min_size=1, max_size=5), min_size=1, max_size=5))
    n = sum(len(s) for s in seqs)
    floats = st.floats(-3.0, 3.0, allow_nan=False, width=32)
    lp = draw(st.lists(st.floats(-6.0, -0.015625, width=32), min_size=n, max_size=n))
    adv = draw(st.lists(floats, min_size=n, max_size=n))
    w = draw(st.lists(st.sampled_from([0.05, 0.5, 1.0]), min_size=n, max_size=n))
    return seqs, lp, adv, w


def _inputs(seqs: list[list[str]], adv: list[float], w: list[float]) -> LossInputs:
    kinds = [k for s in seqs for k in s]
    ids = [i for i, s in enumerate(seqs) for _ in s]
    return LossInputs(
        rl_mask=torch.tensor([k == "rl" for k in kinds]),
        echo_weights=torch.tensor(
            [wt if k == "echo" else 0.0 for k, wt in zip(kinds, w, strict=True)], dtype=F64
        ),
        advantages=torch.tensor(adv, dtype=F64),
        sequence_ids=torch.tensor(ids),
        observation_mask=torch.tensor([k in ("echo", "warning") for k in kinds]),
    )


CONFIGS = [
    LossConfig(policy="reinforce"),
    LossConfig(
        policy="reinforce",
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
    ),
    LossConfig(policy="reinforce", rl_normalization="sequence_mean_token_sum", kl_tau=0.0),
]


@settings(max_examples=60, deadline=None)
@given(batch=batches(), cut=st.integers(0, 5), config_index=st.integers(0, len(CONFIGS) - 1))
def test_loss_summed_over_micro_batches_equals_the_whole_batch(batch, cut, config_index):
    seqs, lp, adv, w = batch
    cfg = CONFIGS[config_index]
    cut = min(cut, len(seqs))
    parts = [(seqs[:cut], 0), (seqs[cut:], sum(len(s) for s in seqs[:cut]))]
    parts = [(p, off) for p, off in parts if p]
    whole_x = _inputs(seqs, adv, w)
    whole_lp = torch.tensor(lp, dtype=F64)
    whole = echo_loss_from_logprobs(whole_lp, whole_x, config=cfg).loss

    micro = []
    for part, off in parts:
        n = sum(len(s) for s in part)
        x = _inputs(part, adv[off : off + n], w[off : off + n])
        micro.append((torch.tensor(lp[off : off + n], dtype=F64), x))
    norms = sum(
        (
            count_normalizers(
                rl_mask=x.rl_mask, echo_weights=x.echo_weights, sequence_ids=x.sequence_ids
            )
            for _, x in micro
        ),
        Normalizers(),
    )
    whole_counts = count_normalizers(
        rl_mask=whole_x.rl_mask,
        echo_weights=whole_x.echo_weights,
        sequence_ids=whole_x.sequence_ids,
    )
    # every count but echo_batches (which counts micro-batches) is a property of the batch
    assert replace(norms, echo_batches=0) == replace(whole_counts, echo_batches=0)
    total = sum(
        echo_loss_from_logprobs(m_lp, x, config=cfg, normalizers=norms).loss for m_lp, x in micro
    )
    # fp64 sums of ≤ 25 terms in a different order: a few ulps of values ≤ ~20
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
