"""EchoGRPOTrainer end to end: overflow stops training, image inputs are refused by name, TRL's
own metric names are logged, and λ = 0 is the echo ablation (one optimiser step each, CPU)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from datasets import Dataset  # noqa: E402
from test_trl_adapter import ANSWER, TOOL_CALL, _tokenizer, get_weather  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402


def _train(tmp_path, *, inject=None, **fields):
    """One scripted step (tool call, tool result, answer); returns (trainer, seen inputs)."""
    from echoloss.adapters.trl import EchoGRPOConfig, EchoGRPOTrainer

    tok = _tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                    eos_token_id=tok.eos_token_id)
    )  # fmt: skip
    response_open = tok.convert_tokens_to_ids("<tool_response>")
    seen: list[dict] = []

    class Scripted(EchoGRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):  # fmt: skip
            out = [
                tok.encode(ANSWER if response_open in p else TOOL_CALL, add_special_tokens=False)
                for p in prompt_ids
            ]
            return out, None

        def _compute_loss(self, model, inputs):
            seen.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return super()._compute_loss(model, {**inputs, **(inject or {})})

    args = EchoGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
        max_completion_length=256, max_steps=1, learning_rate=1e-2, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="no", **{"beta": 0.0, **fields},
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "Weather in Paris?"}]}] * 2)
    trainer = Scripted(model=model, reward_funcs=lambda completions, **kw: [0.0, 1.0], args=args,
                       train_dataset=data, processing_class=tok, tools=[get_weather])  # fmt: skip
    trainer.train()
    return trainer, seen, model


def test_overflowing_echo_weights_stop_training(tmp_path):
    """λ = 3e38 is finite, its loss is not: train() raises naming the echo term, it does not
    return with NaN parameters."""
    with pytest.raises(ValueError, match=r"loss must be finite.*loss_echo.*echo_weights"):
        _train(tmp_path, echo_tool_alpha=3e38)


def test_image_fields_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"inputs \['image_grid_thw', 'pixel_values'\]"):
        _train(tmp_path, echo_tool_alpha=0.05,
               inject={"pixel_values": torch.zeros(1, 3), "image_grid_thw": torch.ones(1, 3)})  # fmt: skip


def test_trls_metric_names_are_logged_with_trls_definitions(tmp_path):
    trainer, _, _ = _train(tmp_path, echo_tool_alpha=0.05)
    logged = trainer.state.log_history[0]
    for name in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                 "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max"):  # fmt: skip
        assert name in logged, name
    # TRL's entropy: the mean over completion_mask · tool_mask, the RL tokens here.
    assert logged["entropy"] == pytest.approx(logged["echoloss/entropy"], rel=1e-6)
    # On-policy first step: every ratio is 1, nothing is clipped.
    assert logged["clip_ratio/region_mean"] == 0.0 and logged["clip_ratio/high_max"] == 0.0


def test_zero_tool_alpha_is_the_echo_ablation(tmp_path):
    """echo_tool_alpha=0.0 is accepted: the tool bodies are attributed (observation mask) with
    weight 0, so the loss is TRL's alone and the run trains."""
    trainer, seen, _ = _train(tmp_path, echo_tool_alpha=0.0)
    [inputs] = seen
    assert float(inputs["echo_weights"].abs().sum()) == 0.0
    assert int(inputs["observation_mask"].sum()) == 2 * len(b"Sunny in Paris")
    assert trainer.state.log_history[0]["echoloss/echo_tokens"] == 0.0


@pytest.mark.parametrize("alpha", [-0.1, float("nan"), float("inf")])
def test_bad_tool_alpha_is_refused(tmp_path, alpha):
    from echoloss.adapters.trl import EchoGRPOConfig

    with pytest.raises(ValueError, match="echo_tool_alpha"):
        EchoGRPOConfig(
            output_dir=str(tmp_path), echo_tool_alpha=alpha, report_to="none", use_cpu=True
        )


def test_unset_bf16_without_a_bf16_gpu_is_fp32_and_said(tmp_path, caplog, monkeypatch):
    """TRL defaults bf16 to True, which transformers refuses without a bf16 GPU (the guide's
    example failed so on a CPU); unset, it is fp32 there, warned once. Set, it is kept."""
    import transformers.utils.import_utils as iu

    from echoloss._logging import reset_warnings
    from echoloss.adapters.trl import EchoGRPOConfig

    monkeypatch.setattr(iu, "is_torch_bf16_gpu_available", lambda: False)
    monkeypatch.setattr(iu, "is_torch_xla_available", lambda: False)
    reset_warnings()
    with caplog.at_level("WARNING", logger="echoloss"):
        args = EchoGRPOConfig(output_dir=str(tmp_path))
    assert args.bf16 is False and not args.use_cpu
    assert "trains in fp32" in caplog.text
    kept = EchoGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True)
    assert kept.bf16 is True


def test_bf16_master_weights_are_warned_about(tmp_path, caplog):
    """Trainable bf16 parameters make the optimiser round most small updates away: said once,
    naming the fix (fp32 weights with bf16 autocast); fp32 parameters say nothing."""
    from echoloss._logging import reset_warnings
    from echoloss.adapters.trl import EchoGRPOConfig, EchoGRPOTrainer

    tok = _tokenizer()
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}] * 2)
    args = EchoGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
        max_steps=1, report_to="none", use_cpu=True, save_strategy="no", echo_tool_alpha=0.05,
    )  # fmt: skip
    seen = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = Qwen3ForCausalLM(
            Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        ).to(dtype)  # fmt: skip
        reset_warnings()
        caplog.clear()
        with caplog.at_level("WARNING", logger="echoloss"):
            EchoGRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * 2,
                            args=args, train_dataset=data, processing_class=tok)  # fmt: skip
        seen[dtype] = caplog.text
    assert "master weights" not in seen[torch.float32]
    assert "torch.bfloat16" in seen[torch.bfloat16] and "fp32" in seen[torch.bfloat16]


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    alpha=st.sampled_from([0.0, 1e-300, 0.05, 3e38, 1e308, -1.0, float("nan"), float("inf")]),
    loss_type=st.sampled_from(["grpo", "dapo", "cispo", "sapo"]),
)
def test_fuzz_one_trl_step(tmp_path_factory, alpha, loss_type):
    """A named error, or one step whose logged losses and parameters are finite."""
    tmp = tmp_path_factory.mktemp("trl")
    try:
        trainer, _, model = _train(tmp, echo_tool_alpha=alpha, loss_type=loss_type)
    except (ValueError, TypeError) as e:
        assert any(n in str(e) for n in ("echo_tool_alpha", "alpha", "loss must be finite")), e
        return
    logged = trainer.state.log_history[0]
    assert all(math.isfinite(v) for k, v in logged.items() if isinstance(v, float)), logged
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


class _Accelerator:
    """One process: reduce and gather are the identity (as TRL's accelerator with 1 process)."""

    def reduce(self, t, reduction="sum"):
        return t

    def gather(self, t):
        return t


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_trl_metric_values_follow_trls_formulas(level, loss_type):
    """TRL's metric names with TRL's definitions (grpo_trainer.py, _compute_loss), computed here
    from the same tensors by hand: clip fractions over the mask, per-sequence min/max, the
    sequence-level ratio as one value per sequence, cispo's own clip fraction."""
    from collections import defaultdict
    from types import SimpleNamespace

    from echoloss.adapters.trl import EchoGRPOTrainer

    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(3, 4, generator=g) * 2
    old = lp + 0.5 * torch.randn(3, 4, generator=g)
    adv = torch.tensor([1.0, -1.0, 2.0])[:, None].expand(3, 4)
    ref = lp + 0.1 * torch.randn(3, 4, generator=g)
    ent = torch.rand(3, 4, generator=g)
    rl = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    fake = SimpleNamespace(
        importance_sampling_level=level, loss_type=loss_type, epsilon_low=0.2,
        epsilon_high=0.28 if loss_type == "grpo" else 1.5, args=SimpleNamespace(delta=None),
        accelerator=_Accelerator(), _metrics={"train": defaultdict(list)},
    )  # fmt: skip
    EchoGRPOTrainer._log_trl_metrics(fake, "train", lp, old, adv, ref, ent, rl)
    got = {k: v[0] for k, v in fake._metrics["train"].items()}

    mask = rl.float()
    log_ratio = (lp - old) * mask
    if level == "sequence":
        coef = torch.exp(log_ratio.sum(-1) / mask.sum(-1)).unsqueeze(-1)  # [B, 1]
        mean = lambda x: float(x.sum() / x.shape[0])  # noqa: E731
        per_seq = lambda x: x.squeeze(1)  # noqa: E731
    else:
        coef = torch.exp(log_ratio)
        mean = lambda x: float((x * mask).sum() / mask.sum())  # noqa: E731
        per_seq = lambda x: (x * mask).sum(-1) / mask.sum(-1)  # noqa: E731
    a = adv[:, :1]
    d = ref - lp
    assert got["kl"] == pytest.approx(float(((torch.exp(d) - d - 1) * mask).sum() / mask.sum()))
    assert got["entropy"] == pytest.approx(float((ent * mask).sum() / mask.sum()))
    if loss_type == "grpo":
        low = ((coef < 0.8) & (a < 0)).float()
        high = ((coef > 1.28) & (a > 0)).float()
        assert got["clip_ratio/low_mean"] == pytest.approx(mean(low))
        assert got["clip_ratio/high_mean"] == pytest.approx(mean(high))
        assert got["clip_ratio/region_mean"] == pytest.approx(mean(((low + high) > 0).float()))
        assert got["clip_ratio/low_min"] == pytest.approx(float(per_seq(low).min()))
        assert got["clip_ratio/high_max"] == pytest.approx(float(per_seq(high).max()))
        assert got["clip_ratio/region_mean"] > 0 or level == "sequence"
    else:
        assert got["cispo_clip_ratio"] == pytest.approx(mean(((coef > 1.5) & (a > 0)).float()))
        assert "clip_ratio/low_mean" not in got
