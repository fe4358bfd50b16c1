"""The benchmarked implementations ("providers") and how each one runs the workload.

A provider builds, for a workload and a mode, a function of no arguments that runs one step and
returns an :class:`Outputs`. Two ops exist:

* ``loss``: from ``[N, V]`` logits (``Workload.logits``);
* ``linear``: from ``hidden [N, H]`` and the LM-head ``weight [V, H]`` (the fused-linear op and
  its unfused baselines).

The modes (``workload.MODES``): ``no-grad`` returns the label logprob of every row (the
old/reference-logprob pass); ``forward`` builds the loss with autograd recording (the logits
require grad) and returns it; ``forward+backward`` also runs ``backward`` and returns the
gradient.

Optional peers (TRL, Liger) are imported only when their provider is built; a provider that
cannot run here says why (:attr:`Provider.unavailable`) and is recorded as skipped.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.workload import (
    ECHO_WEIGHT,
    EPS_HIGH,
    EPS_LOW,
    Workload,
    loss_config,
    naive_logprobs_entropy,
    naive_loss,
)


@dataclass
class Outputs:
    """What one call produced. ``grad_rows(idx)`` returns ``d loss / d logits`` at the flat rows
    ``idx`` (lazily: selecting rows is not part of the timed call). For the linear op ``grads``
    holds ``hidden`` and ``weight`` gradients instead."""

    logprobs: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    grad_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Context:
    """Where a sweep runs. ``kind`` decides timing and memory measurement (``"cpu"``: wall clock
    and resident memory; ``"cuda"``: CUDA events and the caching allocator's peak). ``device``
    is where the tensors live: CUDA for a real GPU run, cpu in the smoke tests that stub the CUDA
    calls (the Triton kernels then run in the interpreter)."""

    kind: str
    device: torch.device

    @property
    def interpreter(self) -> bool:
        return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


Builder = Callable[[Workload, str, Context], Callable[[], Outputs]]


@dataclass
class Provider:
    """One implementation. ``check(ctx)`` returns why it cannot run here (None if it can)."""

    name: str
    op: str
    description: str
    build: Builder
    check: Callable[[Context], str | None] = lambda ctx: None
    #: Free text stored with every row of this provider (what it computes differently).
    note: str | None = None
    #: False for other libraries (TRL, Liger, torch.compile): their red gate is a finding that
    #: is recorded, not a failure of the run; a red gate of echoloss or of the naive baseline is.
    ours: bool = True

    def unavailable(self, ctx: Context) -> str | None:
        return self.check(ctx)


REGISTRY: dict[str, Provider] = {}


def register(p: Provider) -> Provider:
    """Add (or replace) a provider; tests register deliberately wrong ones to check the gate."""
    REGISTRY[p.name] = p
    return p


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_()


def _flat_rows(grad: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda idx: grad.index_select(0, idx)


def _tensor(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The logprobs of an op called without ``return_entropy`` (its return type covers both)."""
    assert isinstance(out, torch.Tensor)
    return out


def _logits_step(
    wl: Workload,
    mode: str,
    logprobs_fn: Callable[[torch.Tensor], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[], Outputs]:
    """The three modes from a no-grad logprob function and a differentiable loss function."""
    logits = wl.logits
    assert logits is not None
    if mode == "no-grad":

        def run() -> Outputs:
            with torch.no_grad():
                return Outputs(logprobs=logprobs_fn(logits))

    elif mode == "forward":

        def run() -> Outputs:
            return Outputs(loss=loss_fn(_leaf(logits)))

    else:

        def run() -> Outputs:
            x = _leaf(logits)
            loss = loss_fn(x)
            loss.backward()
            assert x.grad is not None
            return Outputs(loss=loss.detach(), grad_rows=_flat_rows(x.grad))

    return run


# -- loss op -------------------------------------------------------------------------------


def _naive(wl: Workload, mode: str, ctx: Context) -> Callable[[], Outputs]:
    return _logits_step(
        wl,
        mode,
        lambda x: naive_logprobs_entropy(x, wl.labels, entropy=False)[0],
        lambda x: naive_loss(x, wl),
    )


def _echoloss(backend: str) -> Builder:
    def build(wl: Workload, mode: str, ctx: Context) -> Callable[[], Outputs]:
        from echoloss.loss import echo_loss
        from echoloss.ops import selective_logprobs

        inputs, cfg = wl.loss_inputs(), loss_config()
        return _logits_step(
            wl,
            mode,
            lambda x: _tensor(selective_logprobs(x, wl.labels, backend=backend)),
            lambda x: echo_loss(x, inputs, config=cfg, backend=backend).loss,
        )

    return build


def _triton_check(ctx: Context) -> str | None:
    if ctx.kind != "cuda":
        return (
            "on CPU the Triton kernels run only in the Triton interpreter, which is for "
            "correctness and never timed"
        )
    if ctx.device.type != "cuda" and not ctx.interpreter:
        return "CUDA-mode smoke run on cpu tensors without TRITON_INTERPRET=1"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'echoloss[triton]')"
    return None


def _compile(wl: Workload, mode: str, ctx: Context) -> Callable[[], Outputs]:
    from echoloss.loss import echo_loss_from_logprobs
    from echoloss.ops.selective_logprobs.naive import naive_selective_logprobs

    # One compiled graph per (shape, dtype): dynamic=False, as a trainer with fixed-size packed
    # micro-batches would use it. The chunked reference itself is opaque to dynamo
    # (@torch.compiler.disable); this compiles the unchunked op it is equivalent to. The reset
    # keeps dynamo's per-function recompile limit (8) from silently falling back to eager
    # after a few shapes.
    if "compiled" not in wl.cache:  # compiled once per workload, shared by the three modes
        torch._dynamo.reset()
        wl.cache["compiled"] = (
            torch.compile(naive_selective_logprobs, dynamic=False),
            torch.compile(naive_logprobs_entropy, dynamic=False),
        )
    lp_only, lp_ent = wl.cache["compiled"]
    inputs, cfg = wl.loss_inputs(), loss_config()

    def loss(x: torch.Tensor) -> torch.Tensor:
        lp, ent = lp_ent(x, wl.labels, True)
        return echo_loss_from_logprobs(lp, inputs, entropy=ent, config=cfg).loss

    return _logits_step(wl, mode, lambda x: lp_only(x, wl.labels), loss)


def _compile_check(ctx: Context) -> str | None:
    if ctx.device.type == "cpu" and ctx.kind == "cuda":
        return "not run in CUDA-mode smoke runs on cpu tensors (compile time)"
    return None


def _trl_check(ctx: Context) -> str | None:
    try:
        import trl.trainer.utils as u
    except ImportError:
        return "trl is not installed (pip install 'echoloss[trl]')"
    if not hasattr(u, "selective_log_softmax_and_entropy"):
        return "this trl has no trl.trainer.utils.selective_log_softmax_and_entropy"
    return None


def _trl_path(logits: torch.Tensor) -> str:
    """Which implementation TRL's helpers pick for these logits (its Triton kernel or torch)."""
    import trl.trainer.utils as u

    fused = getattr(u, "_supports_trl_loss_kernel", None)
    triton_ok = getattr(u, "is_triton_available", lambda: False)
    if fused is not None and triton_ok() and fused(logits):
        return "trl Triton kernel (_fused_logprob_entropy)"
    return "trl PyTorch fallback (per-row logsumexp / chunked entropy)"


def _trl(wl: Workload, mode: str, ctx: Context) -> Callable[[], Outputs]:
    from trl.trainer.utils import selective_log_softmax, selective_log_softmax_and_entropy

    from echoloss.loss import echo_loss_from_logprobs

    inputs, cfg = wl.loss_inputs(), loss_config()
    part = wl.participating

    def loss(x: torch.Tensor) -> torch.Tensor:
        lp, ent = selective_log_softmax_and_entropy(
            x, wl.labels, entropy_requires_grad=False, row_mask=part
        )
        return echo_loss_from_logprobs(lp.float(), inputs, entropy=ent.float(), config=cfg).loss

    return _logits_step(wl, mode, lambda x: selective_log_softmax(x, wl.labels).float(), loss)


def _liger_check(ctx: Context) -> str | None:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if ctx.kind != "cuda":
        return "Liger's kernels are Triton-only: GPU sweeps only"
    if ctx.device.type != "cuda":
        if not ctx.interpreter:
            return "CUDA-mode smoke run on cpu tensors without TRITON_INTERPRET=1"
        import triton.language as tl

        # Liger's kernels call triton.language's own @jit helpers (tl.max, tl.sum), which are
        # interpretable only if triton itself was imported under TRITON_INTERPRET=1.
        if type(tl.max).__name__ != "InterpretedFunction":
            return "triton was imported before TRITON_INTERPRET=1: Liger cannot run interpreted"
    return None


def _liger(wl: Workload, mode: str, ctx: Context) -> Callable[[], Outputs]:
    """Liger's Triton GRPO loss on the RL rows + Liger's cross-entropy on the echo rows.

    Liger's GRPO kernel reads ``[B, L+1, V]`` logits (the last position of each sequence is
    ignored) with per-sequence advantages; its own copy of the logits in that layout is made
    here, before anything is measured, and is overwritten by its in-place backward. Liger's
    cross-entropy writes its gradient into its input during the forward pass, so it gets a copy
    of the echo rows (``index_select``, inside the timed call; in fp32, because it keeps the
    per-token losses in its input's dtype): on the shared logits it would destroy the values the
    GRPO backward re-reads. ``loss_type="dapo"`` with one process is the
    RL-token mean; ``beta=0`` (no KL). Liger computes no entropy.
    """
    from liger_kernel.ops.grpo_loss import fused_selective_log_softmax
    from liger_kernel.transformers.functional import liger_cross_entropy
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    assert wl.logits is not None
    b, seq_len, v = wl.n // wl.seq_len, wl.seq_len, wl.v
    key = "liger_logits"
    if key not in wl.cache:
        buf = wl.logits.new_zeros(b, seq_len + 1, v)
        buf[:, :seq_len] = wl.logits.view(b, seq_len, v)
        wl.cache[key] = buf
    src: torch.Tensor = wl.cache[key]
    ids = wl.labels.view(b, seq_len).contiguous()
    old = wl.inference_logprobs.view(b, seq_len).contiguous()
    rl = wl.rl_mask.view(b, seq_len).int().contiguous()
    echo_flat = (wl.echo_weights > 0).nonzero().squeeze(1)
    # Flat row j = (s, l) of the [N, V] logits is row s·(L+1) + l of the [B·(L+1), V] buffer.
    echo_rows = echo_flat + echo_flat // seq_len
    echo_labels = wl.labels.index_select(0, echo_flat)

    def remap(idx: torch.Tensor) -> torch.Tensor:
        return idx + idx // seq_len

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        rl_loss, _ = triton_grpo_loss(
            x,
            old,
            None,
            ids,
            wl.seq_advantages,
            rl,
            temperature=1.0,
            beta=0.0,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            inplace=True,
            loss_type="dapo",
            reduce=True,
        )
        # fp32 copy: Liger's CE keeps per-token losses in the input dtype, so on bf16 rows the
        # loss itself would be rounded to bf16 (~1e-3 relative), which the gate rejects.
        echo_in = x.view(-1, v).index_select(0, echo_rows).float()
        out: torch.Tensor = rl_loss + ECHO_WEIGHT * liger_cross_entropy(echo_in, echo_labels)
        return out

    if mode == "no-grad":

        def run() -> Outputs:
            lp = fused_selective_log_softmax(src, ids, temperature=1.0)
            return Outputs(logprobs=lp.reshape(-1))

    elif mode == "forward":

        def run() -> Outputs:
            return Outputs(loss=loss_fn(_leaf(src)))

    else:

        def run() -> Outputs:
            x = _leaf(src)
            loss = loss_fn(x)
            loss.backward()
            assert x.grad is not None
            g = x.grad.view(-1, v)
            return Outputs(loss=loss.detach(), grad_rows=lambda idx: g.index_select(0, remap(idx)))

    return run


# -- linear op (hidden [N, H], weight [V, H]) ----------------------------------------------


def _linear_backend(ctx: Context) -> str:
    return "triton" if ctx.kind == "cuda" else "reference"


def _linear_step(
    wl: Workload,
    mode: str,
    logprobs_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[], Outputs]:
    hidden, weight = wl.hidden, wl.weight
    assert hidden is not None and weight is not None
    if mode == "no-grad":

        def run() -> Outputs:
            with torch.no_grad():
                return Outputs(logprobs=logprobs_fn(hidden, weight))

    elif mode == "forward":

        def run() -> Outputs:
            return Outputs(loss=loss_fn(_leaf(hidden), _leaf(weight)))

    else:

        def run() -> Outputs:
            h, w = _leaf(hidden), _leaf(weight)
            loss = loss_fn(h, w)
            loss.backward()
            assert h.grad is not None and w.grad is not None
            return Outputs(loss=loss.detach(), grads={"hidden": h.grad, "weight": w.grad})

    return run


def _linear_naive(wl: Workload, mode: str, ctx: Context) -> Callable[[], Outputs]:
    return _linear_step(
        wl,
        mode,
        lambda h, w: naive_logprobs_entropy(h @ w.t(), wl.labels, entropy=False)[0],
        lambda h, w: naive_loss(h @ w.t(), wl),
    )


def _linear_echoloss(wl: Workload, mode: str, ctx: Context) -> Callable[[], Outputs]:
    from echoloss.loss import echo_loss
    from echoloss.ops import selective_logprobs

    backend, inputs, cfg = _linear_backend(ctx), wl.loss_inputs(), loss_config()
    return _linear_step(
        wl,
        mode,
        lambda h, w: _tensor(selective_logprobs(h @ w.t(), wl.labels, backend=backend)),
        lambda h, w: echo_loss(h @ w.t(), inputs, config=cfg, backend=backend).loss,
    )


def _fused_linear(wl: Workload, mode: str, ctx: Context) -> Callable[[], Outputs]:
    from echoloss import echo_loss_from_hidden
    from echoloss.ops.fused_linear import linear_selective_logprobs

    backend, inputs, cfg = _linear_backend(ctx), wl.loss_inputs(), loss_config()
    return _linear_step(
        wl,
        mode,
        lambda h, w: _tensor(linear_selective_logprobs(h, w, wl.labels, backend=backend)),
        lambda h, w: echo_loss_from_hidden(h, w, inputs, config=cfg, backend=backend).loss,
    )


def _linear_triton_check(ctx: Context) -> str | None:
    if ctx.kind == "cuda":
        return _triton_check(ctx)
    return None


for _p in (
    Provider(
        "naive",
        "loss",
        "plain PyTorch: log_softmax(logits.float()) + gather, PPO clip by hand, a separate "
        "F.cross_entropy over the echo rows",
        _naive,
    ),
    Provider(
        "reference",
        "loss",
        "echoloss, backend='reference' (chunked PyTorch, fp32 math)",
        _echoloss("reference"),
    ),
    Provider(
        "triton",
        "loss",
        "echoloss, backend='triton' (the two fused Triton phases)",
        _echoloss("triton"),
        _triton_check,
    ),
    Provider(
        "torch-compile",
        "loss",
        "torch.compile (dynamic=False) of the unchunked op naive_selective_logprobs (+ entropy), "
        "loss algebra by echoloss.echo_loss_from_logprobs",
        _compile,
        _compile_check,
        ours=False,
    ),
    Provider(
        "trl",
        "loss",
        "trl.trainer.utils.selective_log_softmax (no-grad) / selective_log_softmax_and_entropy "
        "(row_mask = participating rows), loss algebra by echoloss.echo_loss_from_logprobs",
        _trl,
        _trl_check,
        ours=False,
    ),
    Provider(
        "liger",
        "loss",
        "Liger: triton_grpo_loss (dapo, beta=0, in-place backward) on the RL rows + "
        "liger_cross_entropy on an fp32 copy of the echo rows; fused_selective_log_softmax (no-grad)",
        _liger,
        _liger_check,
        note="computes no entropy metric; its [B, L+1, V] input copy is allocated before measuring",
        ours=False,
    ),
    Provider(
        "linear-naive",
        "linear",
        "logits = hidden @ weight.T, then the naive loss",
        _linear_naive,
    ),
    Provider(
        "linear-echoloss",
        "linear",
        "logits = hidden @ weight.T, then echoloss.echo_loss (triton on CUDA, reference on CPU)",
        _linear_echoloss,
        _linear_triton_check,
    ),
    Provider(
        "fused-linear",
        "linear",
        "echoloss.echo_loss_from_hidden (chunked LM head; triton phases on CUDA, reference on CPU)",
        _fused_linear,
        _linear_triton_check,
    ),
):
    register(_p)


def trl_note(wl: Workload) -> str | None:
    """Which TRL code path ran on these logits (stored with the TRL rows)."""
    return None if wl.logits is None else _trl_path(wl.logits)


def versions() -> dict[str, Any]:
    """Versions of the providers' libraries (None = not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {}
    for dist in ("torch", "triton", "trl", "liger-kernel", "transformers", "echoloss"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out
