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
import re
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


# -- the newest surfaces: one table of bad inputs per surface -------------------------------------
#
# Each row: (surface, case, call, expected). ``expected`` is ``(exception type, regex)`` (the
# message names the argument and the value) or ``("warns", regex)`` (a warning once). A row that
# returns without either is a silent case and fails. The totals per surface are the ones
# docs/reliability.md reports (`test_the_table_counts_what_the_docs_report`).


def _rows_call(**kw: Any) -> Any:
    """`loss_from_logprobs` with ``divisors`` on a 2 RL + 2 echo row record."""
    from echoloss.loss.core import loss_from_logprobs

    lp = torch.tensor([-0.5, -1.0, -0.2, -0.3], requires_grad=True)
    x = LossInputs(
        rl_mask=torch.tensor([True, True, False, False]),
        echo_weights=torch.tensor([0, 0, 1.0, 1.0]),
        advantages=torch.tensor([1.0, -1.0, 0, 0]),
        old_logprobs=torch.tensor([-0.5, -1.0, -0.2, -0.3]),
    )
    return loss_from_logprobs(lp, None, x, LossConfig(policy="ppo_clip"), None, None,
                              source="logprobs", **kw)  # fmt: skip


def _divisors(**kw: Any) -> Any:
    from echoloss.loss.normalization import Divisors

    return lambda: _rows_call(divisors=Divisors(**kw))


def _module(**call: Any) -> Any:
    """An `EchoGRPOLoss` built and called on a [2, 3] batch (at the row's run: a constructor's
    error is the row's); ``init`` keywords go to the constructor."""
    init = call.pop("init", {})

    def run() -> Any:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 3, 5, generator=g, requires_grad=True)
        ids = torch.randint(0, 5, (2, 3), generator=g)
        echo = torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
        mod = EchoGRPOLoss(**({} if "config" in init else {"beta": 0.0}), **init)
        return mod(logits, ids, torch.ones(2, 3), torch.tensor([1.0, -0.5]),
                   echo_weights=echo, **call)  # fmt: skip

    return run


def _sapo_loss(**kw: Any) -> Any:
    from echoloss.loss import PolicyInputs
    from echoloss.loss.policy import sapo_loss

    x = PolicyInputs(torch.zeros(2), torch.zeros(2), torch.ones(2), None, 0)
    return lambda: sapo_loss(x, **{"temperature_pos": 1.0, "temperature_neg": 1.05, **kw})


def _compile(*args: Any, **kw: Any) -> Any:
    from echoloss.loss.compiled import compile_loss_algebra

    def call() -> None:
        try:
            compile_loss_algebra(*args, **kw)
        finally:
            compile_loss_algebra(False)

    return call


def _register(**kw: Any) -> Any:
    from echoloss.loss.policy import _REGISTRY

    def fn(inputs: Any, config: Any) -> PolicyOutput:
        return PolicyOutput(-inputs.logprobs, {})

    def call() -> None:
        with _REGISTRY.isolated():
            register_policy("table_policy", fn, uses_ratio=False)
            register_policy("table_policy", lambda i, c: fn(i, c), uses_ratio=False, **kw)

    return call


_cfg = lambda **kw: lambda: LossConfig(**kw)  # noqa: E731
_E = (ValueError, TypeError)
_OBS = torch.ones(2, 4, dtype=torch.bool)  # [B, T + 1]

NEWEST_TABLE: list[tuple[str, str, Any, Any]] = [
    # the divisors a caller (the nn modules, Liger, TRL) passes for one call
    ("divisors", "rl=-4", _divisors(rl=-4.0), (ValueError, r"divisors.rl must be finite and > 0 .* got -4.0")),
    ("divisors", "echo=-2", _divisors(echo=-2.0), (ValueError, r"divisors.echo .* got -2.0")),
    ("divisors", "rl=inf", _divisors(rl=math.inf), (ValueError, r"divisors.rl .* got inf")),
    ("divisors", "rl=nan", _divisors(rl=math.nan), (ValueError, r"divisors.rl .* got nan")),
    ("divisors", "rl=0", _divisors(rl=0.0), (ValueError, r"divisors.rl .* divides by 0.* got 0.0")),
    ("divisors", "rl=True", _divisors(rl=True), (TypeError, r"divisors.rl must be a float.* got bool True")),
    ("divisors", "rl=tensor 0", _divisors(rl=torch.tensor(0.0)), (ValueError, r"divisors.rl .* got 0.0")),
    ("divisors", "rl=tensor -1", _divisors(rl=torch.tensor(-1.0)), (ValueError, r"divisors.rl .* got -1.0")),
    ("divisors", "rl=tensor nan", _divisors(rl=torch.tensor(math.nan)), (ValueError, r"divisors.rl .* got nan")),
    ("divisors", "rl=fp16 70000", _divisors(rl=torch.tensor(7e4).half()), (TypeError, r"divisors.rl .* float16 .*fp16 overflows")),
    ("divisors", "rl=int64 tensor", _divisors(rl=torch.tensor(4)), (TypeError, r"divisors.rl .* int64")),
    ("divisors", "rl='4'", _divisors(rl="4"), (TypeError, r"divisors.rl .* got str '4'")),
    ("divisors", "rl=[4.0]", _divisors(rl=[4.0]), (TypeError, r"divisors.rl .* got list")),
    ("divisors", "rl=[2] tensor", _divisors(rl=torch.tensor([2.0, 3.0])), (ValueError, r"divisors.rl must be a 0-dim .* float32 \[2\]")),
    ("divisors", "rl=meta tensor", _divisors(rl=torch.tensor(2.0, device="meta")), (ValueError, r"divisors.rl .* on meta")),
    ("divisors", "plain tuple", lambda: _rows_call(divisors=(4.0, None)), (TypeError, r"divisors must be a Divisors.* got tuple")),
    # SAPO's temperatures: the config, the policy function, the modules
    ("sapo temperatures", "config 1e-38", _cfg(policy="sapo", sapo_temperature_pos=1e-38), (ValueError, r"sapo_temperature_pos\n  Input should be greater than or equal to")),
    ("sapo temperatures", "config 1e39", _cfg(policy="sapo", sapo_temperature_neg=1e39), (ValueError, r"sapo_temperature_neg\n  Input should be less than or equal to")),
    ("sapo temperatures", "config nan", _cfg(policy="sapo", sapo_temperature_neg=math.nan), (ValueError, r"sapo_temperature_neg")),
    ("sapo temperatures", "config -1", _cfg(policy="sapo_sequence", sapo_temperature_pos=-1.0), (ValueError, r"sapo_temperature_pos")),
    ("sapo temperatures", "sapo_loss 1e-38", _sapo_loss(temperature_neg=1e-38), (ValueError, r"temperature_neg must be a float in \[1e-06, 1e\+06\] .* got 1e-38")),
    ("sapo temperatures", "sapo_loss 1e39", _sapo_loss(temperature_pos=1e39), (ValueError, r"temperature_pos must be a float in .* got 1e\+39")),
    ("sapo temperatures", "sapo_loss True", _sapo_loss(temperature_pos=True), (ValueError, r"temperature_pos .* got True")),
    ("sapo temperatures", "module sapo 1e-38", _module(init={"loss_type": "sapo", "sapo_temperature_pos": 1e-38}), (ValueError, r"sapo_temperature_pos must be a float in")),
    ("sapo temperatures", "module sapo 1e39", _module(init={"loss_type": "sapo", "sapo_temperature_neg": 1e39}), (ValueError, r"sapo_temperature_neg must be a float in")),
    ("sapo temperatures", "module grpo nan", _module(init={"loss_type": "grpo", "sapo_temperature_neg": math.nan}), (ValueError, r"sapo_temperature_neg")),
    ("sapo temperatures", "module dapo -1", _module(init={"loss_type": "dapo", "sapo_temperature_pos": -1.0}), (ValueError, r"sapo_temperature_pos must be a float in .* got -1.0")),
    ("sapo temperatures", "module cispo 2.0 (unread)", _module(init={"loss_type": "cispo", "sapo_temperature_pos": 2.0}), ("warns", r"sapo_temperature_pos=2 is ignored by loss_type='cispo'")),
    # compile_loss_algebra: a strict switch, options checked when given
    ("compile_loss_algebra", "'false'", _compile("false"), (TypeError, r"enabled must be a bool .* got str 'false'")),
    ("compile_loss_algebra", "'true'", _compile("true"), (TypeError, r"enabled must be a bool")),
    ("compile_loss_algebra", "0", _compile(0), (TypeError, r"enabled must be a bool .* got int 0")),
    ("compile_loss_algebra", "None", _compile(None), (TypeError, r"enabled must be a bool .* got None")),
    ("compile_loss_algebra", "mode='bogus'", _compile(mode="bogus"), (ValueError, r"torch.compile refuses \{'mode': 'bogus'\}")),
    ("compile_loss_algebra", "backend='nope'", _compile(backend="nope"), (ValueError, r"torch.compile refuses \{'backend': 'nope'\}")),
    ("compile_loss_algebra", "mod='x'", _compile(mod="x"), (ValueError, r"torch.compile refuses \{'mod': 'x'\}")),
    ("compile_loss_algebra", "dynamic='yes'", _compile(dynamic="yes"), (ValueError, r"torch.compile refuses")),
    ("compile_loss_algebra", "False with options", _compile(False, mode="max-autotune"), (ValueError, r"options are unused")),
    # the nn modules' counts and masks
    ("module counts", "config= with num_items_in_batch=-3", _module(init={"config": LossConfig(policy="ppo_clip")}, num_items_in_batch=-3), (ValueError, r"num_items_in_batch: unused with config=")),
    ("module counts", "config= with num_items_in_batch=6", _module(init={"config": LossConfig(policy="ppo_clip")}, num_items_in_batch=6), (ValueError, r"num_items_in_batch: unused with config=")),
    ("module counts", "config= with num_echo_items_in_batch=6", _module(init={"config": LossConfig(policy="ppo_clip")}, num_echo_items_in_batch=6), (ValueError, r"num_echo_items_in_batch: unused with config=")),
    ("module counts", "observation_mask [B, T+1], token_mean", _module(init={"loss_type": "grpo"}, observation_mask=_OBS), (ValueError, r"observation_mask must be a \[B, T\] = \[2, 3\] mask")),
    ("module counts", "observation_mask [B, T+1], sequence_mean", _module(init={"loss_type": "grpo", "echo_normalization": "sequence_mean"}, observation_mask=_OBS), (ValueError, r"observation_mask must be a \[B, T\]")),
    # the policy registry
    ("register_policy", "overwrite='no'", _register(overwrite="no"), (TypeError, r"overwrite must be a bool")),
    ("register_policy", "overwrite='false'", _register(overwrite="false"), (TypeError, r"overwrite must be a bool")),
    ("register_policy", "all_rows='yes'", _register(all_rows="yes"), (TypeError, r"all_rows must be a bool")),
    ("register_policy", "same name, new function", _register(), (ValueError, r"'table_policy' is already registered")),
]  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    ("surface", "case", "call", "expected"),
    NEWEST_TABLE,
    ids=[f"{s}: {c}" for s, c, _, _ in NEWEST_TABLE],
)
def test_newest_surfaces_refuse_or_warn(surface, case, call, expected, caplog):
    from echoloss._logging import reset_warnings

    reset_warnings()  # warn-once memory: this row must see its own warning
    kind, pattern = expected
    if kind == "warns":  # echoloss's warn-once goes to its logger
        with caplog.at_level("WARNING", logger="echoloss"):
            call()
        assert re.search(pattern, caplog.text), (surface, case, caplog.text)
        return
    with pytest.raises(kind) as err:
        call()
    assert re.search(pattern, str(err.value)), (surface, case, str(err.value))


def test_an_empty_batch_gives_a_zero_loss_under_every_echo_normaliser():
    """B = 0 under sequence_mean was refused as non-finite (a divisor of 0 completions)."""
    for en in ("sequence_mean", "token_mean", "batch_token_mean"):
        for lt in ("grpo", "dapo", "sapo"):
            mod = EchoGRPOLoss(beta=0.0, loss_type=lt, echo_normalization=en)
            logits = torch.zeros(0, 3, 5, requires_grad=True)
            out = mod(logits, torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3),
                      torch.zeros(0), echo_weights=torch.zeros(0, 3))  # fmt: skip
            assert float(out.loss) == 0.0, (en, lt)


def test_the_table_counts_what_the_docs_report():
    from collections import Counter

    counts = Counter(s for s, _, _, _ in NEWEST_TABLE)
    assert counts == {
        "divisors": 16,
        "sapo temperatures": 12,
        "compile_loss_algebra": 9,
        "module counts": 5,
        "register_policy": 4,
    }
