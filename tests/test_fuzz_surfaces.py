"""Fuzzing the surfaces added since the data path was fuzzed (``tests/test_fuzz_inputs.py``): the
loss entry points with finite-but-extreme values, the ``echoloss.nn`` modules, the GRPO option
mapping, the policy registry, the echo schedule, checkpoint files and verl's echo helpers.

Same rule: every input gives a ``ValueError``/``TypeError`` whose message names the argument at
fault, or a finite result that keeps the invariants (``loss = loss_rl + loss_echo``, a zero echo
term without echo rows, finite gradients). Extreme values include ±3e38 (the float32 edge),
1e308 (beyond float32), 1e-300 (a divisor that overflows) and non-finite numbers.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echoloss import LossConfig, LossInputs, echo_loss_from_logprobs
from echoloss.loss import PolicyOutput, register_policy
from echoloss.nn import EchoGRPOLoss
from echoloss.schedules import echo_alpha
from echoloss.train import checkpoint as ckpt

FUZZ = settings(
    max_examples=100,
    deadline=None,  # 2 shared CPU cores: wall time varies too much for a per-example deadline
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

EXTREME = [3e38, -3e38, 1e308, -1e308, 1e-300, -1e-300, 0.0, -0.0]
NON_FINITE = [math.nan, math.inf, -math.inf]
# Numbers a caller may pass: ordinary, extreme, non-finite; and wrong types.
numbers = st.one_of(
    st.floats(-5, 5),
    st.sampled_from(EXTREME + NON_FINITE),
)
junk = st.one_of(numbers, st.none(), st.booleans(), st.integers(-5, 10**12), st.text(max_size=3))


def named_error_or_result(call: Any, names: list[str]) -> Any:
    """Run ``call``; a ValueError/TypeError must name one of ``names``; others propagate."""
    try:
        return call()
    except (ValueError, TypeError) as e:
        assert any(n in str(e) for n in names), f"{type(e).__name__} names none of {names}: {e}"
        return None


def assert_loss_ok(out: Any, params: list[torch.Tensor]) -> None:
    loss = out.loss
    assert torch.isfinite(loss), loss
    m = out.metrics
    assert all(torch.isfinite(v) for v in m.values()), m
    total = m["loss_rl/all"] + m["loss_echo/all"]
    assert torch.allclose(loss.detach().float(), total.float(), rtol=1e-5, atol=1e-30)
    if float(m["echo_tokens/all"]) == 0:
        assert float(m["loss_echo/all"]) == 0.0
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        assert all(g is None or bool(torch.isfinite(g).all()) for g in grads)


# -- the loss entry points with extreme values ----------------------------------------------------

LOSS_NAMES = [
    "loss must be finite", "logprobs", "advantages", "echo_weights", "entropy", "kl_tau",
    "entropy_coef", "rl_normalization_constant", "adv_tau", "kl_coef", "inference_logprobs",
    "loss of policy", "LossConfig", "validation error",
]  # fmt: skip


@FUZZ
@given(
    n=st.integers(1, 6),
    adv=st.lists(numbers, min_size=6, max_size=6),
    echo=st.lists(numbers, min_size=6, max_size=6),
    lp=st.lists(
        st.one_of(st.floats(-30, 0), st.sampled_from([-3e38, -1e-300, 0.5, *NON_FINITE])),
        min_size=6,
        max_size=6,
    ),
    ent=st.lists(
        st.one_of(st.floats(0, 12), st.sampled_from([3e38, -1.0, *NON_FINITE])),
        min_size=6,
        max_size=6,
    ),
    rl=st.lists(st.booleans(), min_size=6, max_size=6),
    coefs=st.fixed_dictionaries(
        {},
        optional={
            "kl_tau": junk,
            "entropy_coef": junk,
            "adv_tau": junk,
            "kl_coef": junk,
            "rl_normalization_constant": junk,
        },
    ),
)
def test_loss_from_logprobs(n, adv, echo, lp, ent, rl, coefs):
    cfg_kw = dict(coefs)
    if "rl_normalization_constant" in cfg_kw:
        cfg_kw["rl_normalization"] = "token_sum_constant"
    cfg = named_error_or_result(lambda: LossConfig(**cfg_kw), LOSS_NAMES)
    if cfg is None:
        return
    logprobs = torch.tensor(lp[:n], requires_grad=True)

    def call() -> Any:
        x = LossInputs(
            rl_mask=torch.tensor(rl[:n]),
            advantages=torch.tensor(adv[:n]),
            echo_weights=torch.tensor(echo[:n]),
            inference_logprobs=torch.full((n,), -1.0),
            ref_logprobs=torch.full((n,), -1.0),
        )
        return echo_loss_from_logprobs(logprobs, x, entropy=torch.tensor(ent[:n]), config=cfg)

    out = named_error_or_result(call, LOSS_NAMES)
    if out is not None:
        assert_loss_ok(out, [logprobs])


# -- the nn modules ---------------------------------------------------------------------------------

MODULE_NAMES = [
    "num_items_in_batch", "num_echo_items_in_batch", "attention_mask", "echo_weights",
    "advantages", "loss must be finite", "logits row", "max_completion_length", "epsilon",
    "beta", "sapo_temperature", "temperature", "delta",
]  # fmt: skip


@FUZZ
@given(
    loss_type=st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"]),
    options=st.fixed_dictionaries(
        {},
        optional={
            "beta": junk,
            "epsilon_low": junk,
            "epsilon_high": junk,
            "temperature": junk,
            "sapo_temperature_neg": junk,
            "max_completion_length": junk,
        },
    ),
    items=st.one_of(st.none(), junk),
    echo_items=st.one_of(st.none(), junk),
    mask_value=st.sampled_from([1.0, 0.0, 0.5, math.nan, 2.0, True]),
    adv=st.lists(numbers, min_size=2, max_size=2),
    echo=numbers,
    logit_scale=st.sampled_from([1.0, 1e4, 3e38]),
)
def test_grpo_module(loss_type, options, items, echo_items, mask_value, adv, echo, logit_scale):
    opts = dict(options)
    if loss_type == "dr_grpo":
        opts.setdefault("max_completion_length", 4)
    module = named_error_or_result(lambda: EchoGRPOLoss(loss_type=loss_type, **opts), MODULE_NAMES)
    if module is None:
        return
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 5, generator=g) * logit_scale).requires_grad_()
    ids = torch.randint(0, 5, (2, 3), generator=g)
    mask = torch.ones(2, 3)
    mask[1, 2] = float(mask_value)
    w = torch.tensor([[0.0, 0.0, echo], [0.0, 0.0, 0.0]]) if isinstance(echo, float) else None
    out = named_error_or_result(
        lambda: module(
            logits,
            ids,
            mask,
            torch.tensor(adv),
            echo_weights=w,
            num_items_in_batch=items,
            num_echo_items_in_batch=echo_items,
        ),
        MODULE_NAMES,
    )
    if out is not None:
        assert_loss_ok(out, [logits])


# -- the policy registry ----------------------------------------------------------------------------

_names = (f"fuzz_policy_{i}" for i in itertools.count())


@FUZZ
@given(
    defaults=st.dictionaries(st.sampled_from(["kl_tau", "eps_low", "eps_high", "dual_clip", "x"]), junk, max_size=3),
    reads=st.one_of(st.just(()), st.lists(st.sampled_from(["eps_low", "cispo_max", "nope"]), max_size=2), junk),
    uses_ratio=st.one_of(st.booleans(), junk),
)  # fmt: skip
def test_register_policy(defaults, reads, uses_ratio):
    def fn(i, c):
        return PolicyOutput(-i.advantages * i.logprobs, {})

    spec = named_error_or_result(
        lambda: register_policy(next(_names), fn, reads=reads, uses_ratio=uses_ratio, defaults=defaults),
        ["defaults", "reads", "uses_ratio"],
    )  # fmt: skip
    if spec is None:
        return
    for key, value in spec.defaults.items():
        assert math.isfinite(value) and value >= 0, (key, value)
    cfg = LossConfig(policy=spec.name)  # the defaults are ones LossConfig accepts
    assert cfg.resolved_kl_tau >= 0 and all(e >= 0 for e in cfg.resolved_eps)


# -- the echo schedule ------------------------------------------------------------------------------


@FUZZ
@given(
    step=junk,
    alpha=junk,
    schedule=st.sampled_from(["constant", "warmup", "decay", "cosine"]),
    steps=junk,
    final=junk,
)
def test_echo_alpha(step, alpha, schedule, steps, final):
    out = named_error_or_result(
        lambda: echo_alpha(step, alpha=alpha, schedule=schedule, steps=steps, final_alpha=final),
        ["step", "alpha", "schedule", "steps", "final_alpha"],
    )
    if out is not None:
        assert math.isfinite(out) and 0 <= out <= max(alpha, final)


# -- checkpoint files -------------------------------------------------------------------------------


@FUZZ
@given(
    state=st.dictionaries(
        st.sampled_from(["step", "world_size", "data_position", "outputs", "config", "rae"]),
        st.one_of(junk, st.dictionaries(st.text(max_size=3), junk, max_size=2), st.lists(junk, max_size=2)),
    ),
    manifest_edit=st.sampled_from(["none", "format", "bytes", "sha", "name", "entry", "drop"]),
)  # fmt: skip
def test_checkpoint_files(tmp_path_factory, state, manifest_edit):
    root = tmp_path_factory.mktemp("ck") / "checkpoints"

    def write(d):
        torch.save({"w": torch.ones(2)}, d / "model.pt")
        (d / "state.json").write_text(json.dumps(state))

    d = ckpt.save_checkpoint(root, 3, write, keep=2)
    m = json.loads((d / ckpt.MANIFEST).read_text())
    files = m["files"]
    if manifest_edit == "format":
        m["format"] = 1
    elif manifest_edit == "bytes":
        files["model.pt"]["bytes"] = -1
    elif manifest_edit == "sha":
        files["model.pt"]["sha256"] = "0" * 64
    elif manifest_edit == "name":
        files["/etc/passwd"] = files["model.pt"]
    elif manifest_edit == "entry":
        files["model.pt"] = [1]
    elif manifest_edit == "drop":
        files.pop("model.pt")
    (d / ckpt.MANIFEST).write_text(json.dumps(m))
    try:
        loaded, tensors = ckpt.load_checkpoint(d, ("model.pt",))
    except ckpt.CheckpointError as e:
        assert str(d) in str(e)
        return
    assert manifest_edit == "none"
    assert loaded["step"] == 3 and torch.equal(tensors["model.pt"]["w"], torch.ones(2))


# -- verl's echo helpers ----------------------------------------------------------------------------


@FUZZ
@given(
    key=st.sampled_from(["dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"]),
    value=junk,
    lp=st.one_of(st.floats(-20, 0), st.sampled_from([0.5, -3e38, *NON_FINITE])),
    w=st.one_of(st.floats(0, 2), st.sampled_from([3e38, 1e-300])),
    mode=st.sampled_from(["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum"]),
)
def test_verl_echo_agg_loss(key, value, lp, w, mode):
    pytest.importorskip("omegaconf")
    pytest.importorskip("tensordict")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "adapters"))
    from _verl_core import load_verl

    load_verl()
    from echoloss.adapters import verl as adapter

    log_prob = torch.full((2, 3), -1.0)
    log_prob[0, 1] = lp
    log_prob.requires_grad_()
    weights = torch.tensor([[0.0, w, 0.5], [0.0, 0.0, 0.0]])
    info = {"dp_size": 1, "batch_num_tokens": 2, "global_batch_size": 1, key: value}
    out = named_error_or_result(
        lambda: adapter.echo_agg_loss(log_prob, weights, loss_agg_mode=mode, batch_info=info),
        [key, "log_prob", "echo_weights", "batch_info"],
    )
    if out is not None and bool(torch.isfinite(out)):
        (grad,) = torch.autograd.grad(out, log_prob)
        assert bool(torch.isfinite(grad).all())
