"""Random packed micro-batches for the loss tests (row-aligned next-token targets)."""

from __future__ import annotations

import torch


def random_batch(
    *,
    seq_lens: list[int],
    vocab: int = 11,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    envs: list[str] | None = None,
    p_rl: float = 0.45,
    p_echo: float = 0.3,
    p_warning: float = 0.1,
    temperature: float = 0.8,
) -> dict:
    """One micro-batch of ``len(seq_lens)`` sequences plus one padding row.

    Row kinds per sequence: RL, echo (weight in {0.05, 0.5, 1.0}), warning (observation, not
    echoed) or nothing; the last row of each sequence predicts nothing. Inference logprobs of RL
    rows are the current logprobs plus noise (so some tokens leave the trust region); outside RL
    rows they are the 0.0 placeholder.
    """
    g = torch.Generator().manual_seed(seed)
    n = sum(seq_lens) + 1
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2.0
    labels = torch.randint(0, vocab, (n,), generator=g)
    u = torch.rand(n, generator=g)
    rl = u < p_rl
    echo = (u >= p_rl) & (u < p_rl + p_echo)
    warning = (u >= p_rl + p_echo) & (u < p_rl + p_echo + p_warning)
    seq = torch.cat(
        [torch.full((k,), i, dtype=torch.long) for i, k in enumerate(seq_lens)]
        + [torch.tensor([-1])]
    )
    last = torch.cumsum(torch.tensor(seq_lens), 0) - 1
    nothing = torch.zeros(n, dtype=torch.bool)
    nothing[last] = True
    nothing[-1] = True  # padding
    rl &= ~nothing
    echo &= ~nothing
    warning &= ~nothing
    choices = torch.tensor([0.05, 0.5, 1.0], dtype=torch.float64)
    weights = torch.where(echo, choices[torch.randint(0, 3, (n,), generator=g)], 0.0)
    seq_adv = torch.randn(len(seq_lens), generator=g, dtype=torch.float64)
    adv = torch.where(rl & (seq >= 0), seq_adv[seq.clamp(min=0)], 0.0)
    with torch.no_grad():
        lp = torch.log_softmax(logits / temperature, -1).gather(1, labels[:, None]).squeeze(1)
    noise = torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    inf_lp = torch.where(rl, (lp + noise).clamp(max=0.0), 0.0)  # a logprob is ≤ 0
    return {
        "logits": logits.to(dtype),
        "labels": labels,
        "rl_mask": rl,
        "echo_weights": weights.to(dtype),
        "observation_mask": echo | warning,
        "advantages": adv.to(dtype),
        "inference_logprobs": inf_lp.to(dtype),
        "sequence_ids": seq,
        "temperature": torch.full((n,), temperature, dtype=dtype),
        "env_names": [(envs or ["env"])[i % len(envs or ["env"])] for i in range(len(seq_lens))],
    }


def split_by_sequence(batch: dict, groups: list[list[int]]) -> list[dict]:
    """Micro-batches holding the given sequences each, with sequence ids renumbered from 0."""
    out = []
    for group in groups:
        rows = torch.cat([(batch["sequence_ids"] == s).nonzero().squeeze(1) for s in group])
        mb = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        remap = {s: i for i, s in enumerate(group)}
        mb["sequence_ids"] = torch.tensor([remap[int(s)] for s in mb["sequence_ids"]])
        mb["env_names"] = [batch["env_names"][s] for s in group]
        out.append(mb)
    return out
