"""Shared inputs, error measures and tolerances of the fused-kernel tests.

Tolerances: the fused kernels and the reference compute in fp32 from the *same* input values, so
they differ only by summation order (the kernel reduces ``BLOCK_V`` lanes as a tree, then rescales
across blocks; the reference's ``log_softmax`` has its own order) and, for bf16/fp16 outputs, by
the final rounding of two fp32 values that differ in their last bits:

- ``STAT_TOL`` for the fp32 statistics (logprob, lse, entropy), any input dtype: a tree/blocked
  sum of ``V`` positive terms in fp32 has a relative error ≤ ``log2(V)·2^-24`` (7e-7 at V = 3001),
  and ``lse`` itself is a few ulps of |lse| ≤ 32 (ulp 2e-6 at 16): differences ≤ ~4e-6 (observed
  ≤ 2e-6). ``(atol, rtol) = (1e-5, 1e-5)``.
- ``GRAD_TOL`` for ``dlogits`` in the logits dtype, ``g = (a·(onehot - p) - b·p·(log p + H))/T``.
  Both backends' ``log p = s - lse`` differ by the lse difference Δ ≤ 1e-5, so off the label
  ``|Δg| ≤ |g|·Δ`` (``rtol = 1e-5`` in fp32); on the label (``1 - p`` cancels as p → 1) and where
  ``log p + H`` cancels, ``|Δg| ≤ (|a| + 2|b|)/T · p · Δ``: ``atol = 1e-5`` per unit of the
  largest coefficient ``(|a| + |b|)/T``. bf16/fp16 outputs can differ by one ulp where the two
  fp32 values round to neighbours: ``rtol = 2^-7`` (bf16 keeps 8 significant bits) and ``2^-10``
  (fp16, 11 bits).
- ``assert_no_worse_than_reference`` (spec §14.1): against the fp64 gold on the same rounded inputs,
  ``max|fused - gold| ≤ 2 · max(max|ref - gold|, floor)``, the floor being the unavoidable error
  of the output format (two ulps of the largest gold value) so that two near-zero errors do not
  turn into a ratio of noise.
"""

from __future__ import annotations

import torch

HAS_CUDA = torch.cuda.is_available()

#: Triton vocabulary block on the interpreter (set by tests/ops/conftest.py): every test vocabulary
#: (V ≥ 1531) streams several blocks per row, so a block that reads or writes the wrong columns
#: changes the result (the default launch would stream V = 1531 in one block of 2048).
INTERPRETER_BLOCK_V = 512
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CI installs triton
    HAS_TRITON = False

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: fp32 statistics (logprob, lse, entropy) of fused vs reference, any input dtype.
STAT_TOL = (1e-5, 1e-5)
#: dlogits of fused vs reference per logits dtype: ``(atol per unit of (|a| + |b|)/T, rtol)``.
GRAD_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-5, 2.0**-7),
    torch.float16: (1e-5, 2.0**-10),
}
#: Against the fp64 gold, the fused error may be at most this multiple of the reference's error
#: (or of ``GOLD_FLOOR_ULPS`` ulps of the output's largest value, whichever is larger).
GOLD_FACTOR = 2.0
GOLD_FLOOR_ULPS = 2.0


def randn_logits(
    n: int, v: int, dtype: torch.dtype, *, scale: float = 3.0, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, *, coef_scale: float) -> None:
    """fused vs reference ``dlogits`` with the ``GRAD_TOL`` of their dtype."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    atol, rtol = GRAD_TOL[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * coef_scale, rtol=rtol)


def max_err(x: torch.Tensor, gold: torch.Tensor) -> float:
    if not x.numel():
        return 0.0
    return float((x.detach().double() - gold.detach().double()).abs().max())


def assert_no_worse_than_reference(
    fused: torch.Tensor, ref: torch.Tensor, gold: torch.Tensor, *, what: str
) -> None:
    """``max|fused - gold| ≤ GOLD_FACTOR · max(max|ref - gold|, floor)`` (spec §14.1)."""
    e_f, e_r = max_err(fused, gold), max_err(ref, gold)
    ulp = torch.finfo(fused.dtype).eps * float(gold.detach().abs().max()) if gold.numel() else 0.0
    bound = GOLD_FACTOR * max(e_r, GOLD_FLOOR_ULPS * ulp)
    assert e_f <= bound, f"{what}: fused error {e_f:.3g} > {bound:.3g} (reference error {e_r:.3g})"


def loss_batch(*, seq_lens: list[int], vocab: int, seed: int = 0, temperature: float = 0.8) -> dict:
    """A packed micro-batch in fp64 on ``DEVICE``: RL rows, echo rows (weights 0.05–1), observation
    rows that are not echoed, rows that take part in nothing (the last row of each sequence and one
    padding row), per-token advantages and inference logprobs near the current ones."""
    g = torch.Generator().manual_seed(seed)
    n = sum(seq_lens) + 1
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2.0
    labels = torch.randint(0, vocab, (n,), generator=g)
    u = torch.rand(n, generator=g)
    rl, echo = u < 0.45, (u >= 0.45) & (u < 0.75)
    warning = (u >= 0.75) & (u < 0.85)
    seq = torch.cat(
        [torch.full((k,), i, dtype=torch.long) for i, k in enumerate(seq_lens)]
        + [torch.tensor([-1])]
    )
    nothing = torch.zeros(n, dtype=torch.bool)
    nothing[torch.cumsum(torch.tensor(seq_lens), 0) - 1] = True
    nothing[-1] = True
    rl, echo, warning = rl & ~nothing, echo & ~nothing, warning & ~nothing
    choices = torch.tensor([0.05, 0.5, 1.0], dtype=torch.float64)
    weights = torch.where(echo, choices[torch.randint(0, 3, (n,), generator=g)], 0.0)
    adv = torch.where(rl, torch.randn(n, generator=g, dtype=torch.float64), 0.0)
    with torch.no_grad():
        lp = torch.log_softmax(logits / temperature, -1).gather(1, labels[:, None]).squeeze(1)
    noise = torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    batch = {
        "logits": logits,
        "labels": labels,
        "rl_mask": rl,
        "echo_weights": weights,
        "observation_mask": echo | warning,
        "advantages": adv,
        "inference_logprobs": torch.where(rl, lp + noise, 0.0),
        "sequence_ids": seq,
        "temperature": torch.full((n,), temperature, dtype=torch.float64),
    }
    return {k: v.to(DEVICE) for k, v in batch.items()}


# Non-default parameters that make the clips of each built-in policy bind on the random batches
# (a policy registered later runs with its defaults).
POLICY_PARAMETERS = {
    "ppo_clip": {"dual_clip": 3.0},
    "cispo": {"cispo_max": 1.2},
    "gspo": {"eps_low": 0.05, "eps_high": 0.05},
}


def registry_configs(**extra):
    """One ``LossConfig`` per policy of the registry (``policy="custom"``, which has no function
    of its own, excepted), plus the named ``extra`` configurations: the fused tests loop over
    it, so a newly registered policy is checked on every backend."""
    from echoloss.loss import POLICIES, LossConfig

    configs = {
        name: LossConfig(policy=name, **POLICY_PARAMETERS.get(name, {}))
        for name, spec in sorted(POLICIES.items())
        if spec.fn is not None
    }
    return {**configs, **extra}
