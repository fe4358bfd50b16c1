"""EchoGRPOTrainer's loss equals TRL's own ``GRPOTrainer._compute_loss`` on the same model.

Both losses run on one random-init tiny Qwen3: TRL's method unchanged (its fused LM head patched
in by TRL's ``add_fused_lm_head``), ours through the model's logits. Each test accumulates two
micro-batches (``gradient_accumulation_steps=2``), one completion fully masked, one with tool
tokens, and compares the summed losses and every parameter gradient.

Tolerance: 2e-6 relative to the gradient's largest entry (and 2e-6 absolute on the loss). Both
sides compute fp32 logprobs of the same fp32 logits but in different orders (TRL tiles the LM
head and reduces in its kernel; echoloss chunks the log-softmax), so single-precision rounding
(ε = 1.2e-7) accumulates over a few dozen operations; measured differences are ≤ 3e-7.
"""

from __future__ import annotations

import types
from collections import defaultdict
from contextlib import nullcontext

import pytest

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from echoloss.adapters import trl as adapter  # noqa: E402
from echoloss.nn import grpo as mapping  # noqa: E402

V, B, P, C, GA = 32, 4, 3, 6, 2
TEMPERATURE = 0.7
TOL = 2e-6


class _Accelerator:
    num_processes = 1
    sync_gradients = True
    is_main_process = True

    def autocast(self):
        return nullcontext()

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      tie_word_embeddings=False, pad_token_id=0)  # fmt: skip
    model = Qwen3ForCausalLM(cfg).float()
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return model


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                per_device_train_batch_size=B, num_generations=2, gradient_accumulation_steps=GA,
                max_completion_length=C, temperature=TEMPERATURE, beta=0.0)  # fmt: skip
    base.update(kw)
    return adapter.EchoGRPOConfig(**base)


def _trainer(args, model):
    """A GRPOTrainer subclass instance with exactly the attributes ``_compute_loss`` reads."""
    tr = object.__new__(adapter.EchoGRPOTrainer)
    tr.args = args
    for name in ("loss_type", "importance_sampling_level", "beta", "top_entropy_quantile",
                 "off_policy_mask_threshold", "use_vllm", "vllm_importance_sampling_correction",
                 "max_completion_length", "temperature"):  # fmt: skip
        setattr(tr, name, getattr(args, name))
    tr.epsilon_low = args.epsilon
    tr.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    tr._entropy_bonus_enabled = False
    tr.aux_loss_enabled = False
    tr.model = model
    tr.accelerator = _Accelerator()
    tr.current_gradient_accumulation_steps = GA
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    tr._init_echo(None)
    return tr


def _micro_batches(model, *, off_policy: bool, beta: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for k in range(GA):
        prompt = torch.randint(1, V, (B, P), generator=g)
        completion = torch.randint(1, V, (B, C), generator=g)
        cmask = torch.ones(B, C, dtype=torch.long)
        cmask[0, 4:] = 0  # a short completion
        if k == 0:
            cmask[2] = 0  # a fully masked completion (TRL still counts it in B for grpo)
        tool = torch.ones(B, C, dtype=torch.long)
        tool[1, 1:3] = 0  # tool-result tokens: no RL
        batches.append({
            "prompt_ids": prompt, "prompt_mask": torch.ones(B, P, dtype=torch.long),
            "completion_ids": completion, "completion_mask": cmask, "tool_mask": tool,
            "advantages": torch.randn(B, generator=g),
        })  # fmt: skip
    loss_tokens = sum(int((b["completion_mask"] * b["tool_mask"]).sum()) for b in batches)
    for b in batches:
        b["num_items_in_batch"] = torch.tensor(loss_tokens)
        b["echo_weights"] = torch.zeros(B, C)
        b["observation_mask"] = torch.zeros(B, C, dtype=torch.bool)
        b["num_echo_items_in_batch"] = torch.tensor(0)
        if off_policy or beta:
            with torch.no_grad():
                ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
                logits = model(input_ids=ids, logits_to_keep=C + 1).logits[:, :-1] / TEMPERATURE
                lp = logits.log_softmax(-1).gather(-1, b["completion_ids"][..., None])[..., 0]
            if off_policy:  # ratios far enough from 1 that every clip branch is taken
                b["old_per_token_logps"] = lp + 0.6 * torch.randn(B, C, generator=g)
            if beta:
                b["ref_per_token_logps"] = lp + 0.3 * torch.randn(B, C, generator=g)
    return batches


def _loss_and_grads(model, method, trainer, batches):
    model.zero_grad()
    total = 0.0
    for b in batches:
        loss = method(trainer, model, dict(b))
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(tmp_path, *, off_policy=False, **kw):
    model = _model()
    args = _args(tmp_path, **kw)
    batches = _micro_batches(model, off_policy=off_policy, beta=kw.get("beta", 0.0) > 0)
    tr = _trainer(args, model)
    ours, g_ours = _loss_and_grads(model, adapter.EchoGRPOTrainer._compute_loss, tr, batches)
    theirs, g_trl = _loss_and_grads(model, trl.GRPOTrainer._compute_loss, tr, batches)
    assert abs(ours - theirs) <= TOL, (ours, theirs)
    assert g_ours.keys() == g_trl.keys()
    scale = max(float(g.abs().max()) for g in g_trl.values())
    assert scale > 1e-4  # a vacuous (zero) gradient would pass any tolerance
    worst = max(float((g_ours[n] - g_trl[n]).abs().max()) for n in g_trl)
    assert worst <= TOL * scale, (worst, scale)
    return ours, theirs, worst / scale


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("off_policy", [False, True], ids=["on_policy", "off_policy"])
def test_every_loss_type_equals_trl(tmp_path, loss_type, level, off_policy):
    kw = {"epsilon_high": 5.0} if loss_type == "cispo" else {"epsilon_high": 0.28}
    _compare(tmp_path, loss_type=loss_type, importance_sampling_level=level,
             off_policy=off_policy, **kw)  # fmt: skip


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_k3_reference_kl_equals_trl(tmp_path, level):
    _compare(tmp_path, loss_type="dapo", importance_sampling_level=level, off_policy=True,
             beta=0.04, use_bias_correction_kl=False)  # fmt: skip


def _trl_vllm_is_ratio(args, old, sampling, mask):
    """TRL 1.16's importance-sampling ratio, as ``_generate_and_score_completions`` computes it
    inline (no function of TRL's to call); NaN sampling logprobs give a ratio of 1."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if args.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    lo, hi = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if args.vllm_importance_sampling_mode.endswith("truncate"):
        return ratio.clamp(min=lo, max=hi)
    bad = (ratio < (lo if lo is not None else -float("inf"))) | (ratio > hi)
    return ratio.masked_fill(bad, 0.0)


@pytest.mark.parametrize(
    "mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
)
def test_vllm_importance_sampling_correction_equals_trl(tmp_path, mode):
    model = _model()
    args = _args(tmp_path, loss_type="dapo", vllm_importance_sampling_mode=mode,
                 vllm_importance_sampling_clip_max=1.5, vllm_importance_sampling_clip_min=0.5)  # fmt: skip
    args.use_vllm = True  # set after construction: no vLLM server is needed for the loss
    batches = _micro_batches(model, off_policy=True, beta=False)
    g = torch.Generator().manual_seed(3)
    for b in batches:
        sampling = b["old_per_token_logps"] + 0.2 * torch.randn(B, C, generator=g)
        sampling[3, 0] = float("nan")  # a token vLLM could not score
        b["sampling_per_token_logps"] = sampling
        mask = b["completion_mask"] * b["tool_mask"]
        b["importance_sampling_ratio"] = _trl_vllm_is_ratio(
            args, b["old_per_token_logps"], sampling, mask
        )
    tr = _trainer(args, model)
    tr.use_vllm = True
    assert tr.echo_mapping.config.mismatch == mode
    ours, g_ours = _loss_and_grads(model, adapter.EchoGRPOTrainer._compute_loss, tr, batches)
    theirs, g_trl = _loss_and_grads(model, trl.GRPOTrainer._compute_loss, tr, batches)
    assert abs(ours - theirs) <= TOL, (ours, theirs)
    scale = max(float(g.abs().max()) for g in g_trl.values())
    worst = max(float((g_ours[n] - g_trl[n]).abs().max()) for n in g_trl)
    assert worst <= TOL * scale, (worst, scale)


def test_two_sided_clip_delta_equals_trl(tmp_path):
    _compare(tmp_path, loss_type="grpo", off_policy=True, delta=1.5)


def test_grpo_counts_masked_completions_like_trl(tmp_path):
    """TRL divides by all B completions, a fully masked one too (sequences with RL rows: 3)."""
    model = _model()
    args = _args(tmp_path, loss_type="grpo")
    [b0, _] = _micro_batches(model, off_policy=False, beta=False)
    tr = _trainer(args, model)
    _, norms = tr.echo_mapping.micro_batch(
        batch_size=B, max_completion_length=C, num_items_in_batch=None, num_processes=1,
        accumulation_steps=GA, steps_per_generation=GA)  # fmt: skip
    assert norms.rl_sequences == B * GA
    assert int((b0["completion_mask"].sum(1) > 0).sum()) == B - 1


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"loss_type": "vespo"}, "vespo"),
        ({"top_entropy_quantile": 0.2}, "top_entropy_quantile"),
        ({"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold"),
        ({"entropy_coef": 0.01}, "entropy_coef"),
        ({"beta": 0.04}, "use_bias_correction_kl"),
        ({"delta": 1.1, "epsilon_high": 0.2}, "delta"),
        ({"delta": 2.0, "importance_sampling_level": "sequence"}, "delta"),
    ],
)
def test_settings_without_an_exact_mapping_are_rejected(tmp_path, kw, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        _trainer(_args(tmp_path, **kw), model)


def test_unknown_loss_type_is_an_error():
    args = types.SimpleNamespace(loss_type="xyz")
    with pytest.raises(ValueError, match="loss_type='xyz'"):
        mapping.grpo_loss_mapping(args, epsilon_low=0.2, epsilon_high=0.2)


def test_echo_term_is_added_with_its_normaliser(tmp_path):
    """With echo weights on tool tokens, the loss is TRL's plus the hand-computed echo term."""
    model = _model()
    args = _args(tmp_path, loss_type="dapo", echo_tool_alpha=0.5,
                 echo_normalization="sequence_mean")  # fmt: skip
    batches = _micro_batches(model, off_policy=False, beta=False)
    tr = _trainer(args, model)
    plain = [dict(b) for b in batches]
    for b in batches:
        b["echo_weights"] = torch.where(b["tool_mask"] == 0, 0.5, 0.0) * b["completion_mask"]
        b["observation_mask"] = (b["tool_mask"] == 0) & b["completion_mask"].bool()
    expected = 0.0
    with torch.no_grad():
        for b in batches:
            ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
            logits = model(input_ids=ids, logits_to_keep=C + 1).logits[:, :-1]  # echo at T = 1
            nll = -logits.log_softmax(-1).gather(-1, b["completion_ids"][..., None])[..., 0]
            z = b["observation_mask"].sum(1, keepdim=True).clamp(min=1)
            expected += float((b["echo_weights"] * nll / z).sum() / (B * GA))
    with_echo = sum(
        float(adapter.EchoGRPOTrainer._compute_loss(tr, model, dict(b)).detach()) for b in batches
    )
    without = sum(float(trl.GRPOTrainer._compute_loss(tr, model, dict(b)).detach()) for b in plain)
    assert expected > 0
    assert abs(with_echo - without - expected) <= TOL


def test_config_echo_fields_from_yaml_and_command_line(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(
        f"output_dir: {tmp_path}\nuse_cpu: true\nloss_type: dr_grpo\n"
        "echo_tool_alpha: 0.05\necho_tool_names: [search, shell]\n"
        "echo_normalization: sequence_mean\necho_temperature: sampling\n"
    )
    parser = trl.TrlParser((adapter.EchoGRPOConfig,))
    [cfg] = parser.parse_args_and_config(args=["--config", str(path)])
    assert (cfg.loss_type, cfg.echo_tool_alpha, cfg.echo_tool_names) == (
        "dr_grpo", 0.05, ["search", "shell"])  # fmt: skip
    assert (cfg.echo_normalization, cfg.echo_temperature) == ("sequence_mean", "sampling")
    echo = cfg.echo_config()
    assert echo.tool.alpha == 0.05 and echo.tool.tool_names == frozenset({"search", "shell"})
    # The command line overrides the file.
    [cfg] = parser.parse_args_and_config(
        args=["--config", str(path), "--echo_tool_alpha", "0.1", "--echo_assistant_alpha", "0.01"]
    )
    assert cfg.echo_tool_alpha == 0.1 and cfg.echo_config().assistant.alpha == 0.01
    parser = trl.TrlParser((adapter.EchoGRPOConfig,))  # a --config sets the parser's defaults
    [cfg] = parser.parse_args_and_config(
        args=["--output_dir", str(tmp_path), "--use_cpu", "true", "--echo_tool_alpha", "0.2",
              "--echo_normalization", "batch_token_mean"])  # fmt: skip
    assert cfg.echo_tool_alpha == 0.2 and cfg.echo_normalization == "batch_token_mean"
    assert cfg.echo_config().tool.tool_names is None
    with pytest.raises(SystemExit):  # argparse rejects a value outside the choices
        parser.parse_args_and_config(
            args=["--output_dir", str(tmp_path), "--echo_normalization", "mean"]
        )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"echo_tool_alpha": -1.0}, "echo_tool_alpha"),
        ({"echo_tool_names": ["a"]}, "echo_tool_names"),
        ({"echo_normalization": "mean"}, "echo_normalization"),
    ],
)
def test_config_rejects_bad_echo_fields(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _args(tmp_path, **kw)


def test_echo_given_twice_is_an_error(tmp_path):
    from echoloss import EchoConfig, RoleEcho

    tr = object.__new__(adapter.EchoGRPOTrainer)
    tr.args = _args(tmp_path, echo_tool_alpha=0.05)
    with pytest.raises(ValueError, match="given twice"):
        tr._init_echo(EchoConfig(tool=RoleEcho(alpha=0.05)))
