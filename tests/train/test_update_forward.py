"""The update's forwards (``model.update_forward``): the LM head only on the rows that carry loss,
and a shared prompt prefix computed once, give the losses and gradients of every row's logits;
a step without a gradient runs no forward and leaves the weights exactly as the computed step.

In fp64 the comparison is exact up to summation order (1e-10): the model's RMSNorm is replaced
by the same formula without its fp32 round trip (transformers computes it in fp32 and casts back,
which rounds the gradient to fp32 precision differently per batch shape: 1e-5 absolute
differences in fp64 that are the norm's, not the sharing's)."""

from __future__ import annotations

import json

import pytest
import torch
from _train_helpers import fast_config, rollout_jsonl

import echoloss
from echoloss.loss import LossConfig, LossInputs, Normalizers, count_normalizers
from echoloss.train import recipe
from echoloss.train.config import parse_config
from echoloss.train.forward import (
    SharedPrefixForward,
    first_loss_rows,
    lm_head_weight,
    loss_rows,
    packed_hidden,
    prefix_clusters,
    resolve_update_forward,
)
from echoloss.train.model import build_tiny_model, packed_logits
from echoloss.train.regimes import Scores

CONFIG = LossConfig(
    policy="ppo_clip",
    kl_tau=0.0,
    rl_normalization="sequence_mean_token_mean",
    echo_normalization="sequence_mean",
)


def _fp64_norms(model: torch.nn.Module) -> None:
    """RMSNorm without the fp32 round trip (see the module docstring)."""

    def forward(self, x):  # the same formula as transformers' RMSNorm, in the input's dtype
        return self.weight * (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = forward.__get__(m)


def _model(arch: str) -> torch.nn.Module:
    model = build_tiny_model(
        arch=arch, vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=48, max_position_embeddings=128, seed=0,
    ).double()  # fmt: skip
    _fp64_norms(model)
    return model


def _samples() -> list[echoloss.Sample]:
    """Five samples: four share a 20-token prompt prefix (two of them share 24), one shares
    nothing; RL rows, echoed rows and prompt rows; different lengths."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(1, 40, (n,), generator=g).tolist()

    prefix = ids(20)
    samples = []
    for k, (own, comp) in enumerate([(4, 7), (4, 3), (6, 9), (2, 5), (0, 6)]):
        prompt = (prefix + ids(own)) if k < 4 else ids(23)
        if k == 1:
            prompt = samples[0].prompt_ids
        echo = [None] * (len(prompt) + comp)
        echo[len(prompt) + 2] = 0.3  # an echoed token inside the completion
        mask = [True] * comp
        mask[2] = False
        lp = torch.rand(comp, generator=g, dtype=torch.float64).clamp_min(0.05).log().tolist()
        samples.append(
            echoloss.Sample(
                prompt_ids=prompt,
                completion_ids=ids(comp),
                completion_mask=mask,
                completion_logprobs=lp,
                echo_weights=echo,
                advantage=[0.5, -1.0, 1.5, -0.25, 2.0][k],
            )
        )
    return samples


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def test_prefix_clusters_share_the_prompt_and_stop_before_the_first_loss_row():
    samples = _samples()
    ids = [s.token_ids for s in samples]
    clusters = prefix_clusters(ids, first_loss_rows(samples))
    # Four samples share the 20-token prefix; the odd one runs alone.
    assert [(c.members, c.prefix_len) for c in clusters] == [((0, 1, 2, 3), 20), ((4,), 0)]
    # Samples 0 and 1 share their whole 24-token prompt, but row 23 predicts their first RL
    # token: the prefix stops before it.
    [pair] = prefix_clusters(ids[:2], first_loss_rows(samples[:2]))
    assert pair.prefix_len == 23 == first_loss_rows(samples[:1])[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shared_prefix_and_packed_rows_equal_every_rows_logits_in_fp64(arch):
    """Loss, metrics and every parameter's gradient: every row's logits (one packed row) vs the
    LM head on the loss rows of the packed forward vs the shared-prefix forward over three
    micro-batches (two share one prefix, whose keys and values collect both gradients)."""
    torch.manual_seed(0)
    model = _model(arch)
    weight = lm_head_weight(model)
    samples = _samples()
    [whole] = echoloss.pack(samples, max_tokens=512)
    x = LossInputs.from_targets(echoloss.next_token_targets(whole))
    norms = count_normalizers(x)

    reference = Scores(x, logits=packed_logits(model, whole, attn_implementation="sdpa"))
    ref = reference.loss(x, CONFIG, norms)
    ref.loss.backward()
    ref_grads = _grads(model)

    rows = loss_rows(packed_hidden(model, whole, attn_implementation="sdpa"), weight, x)
    packed = Scores(rows.inputs, hidden=rows.hidden, weight=rows.weight)
    out = packed.loss(packed.inputs, CONFIG, norms)
    out.loss.backward()
    packed_grads = _grads(model)

    ids = [s.token_ids for s in samples]
    clusters = prefix_clusters(ids, first_loss_rows(samples))
    prefixes = [ids[c.members[0]][: c.prefix_len] for c in clusters]
    chunks = [([0, 2], 0), ([1, 3], 0), ([4], 1)]  # (samples, cluster)
    shared = SharedPrefixForward(model, prefixes, pad_id=0)
    total = torch.zeros((), dtype=torch.float64)
    for members, cluster in chunks:
        [b] = echoloss.pack([samples[i] for i in members], max_tokens=512)
        xb = LossInputs.from_targets(echoloss.next_token_targets(b))
        rows = loss_rows(shared.hidden(b, cluster), weight, xb)
        part = Scores(rows.inputs, hidden=rows.hidden, weight=rows.weight)
        loss = part.loss(part.inputs, CONFIG, norms).loss
        loss.backward()
        total += loss.detach()
    shared.backward()
    shared_grads = _grads(model)

    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, ref.loss.detach(), rtol=1e-12, atol=1e-12)
    for k in ("loss_rl/all", "loss_echo/all", "entropy/all", "echo_nll_mean/all"):
        torch.testing.assert_close(out.metrics[k], ref.metrics[k], rtol=1e-12, atol=1e-12)
    for name, g in ref_grads.items():
        assert g.abs().max() > 0, name  # every parameter is trained
        torch.testing.assert_close(packed_grads[name], g, rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(shared_grads[name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_without_the_prefix_backward_the_prefix_gets_no_gradient():
    """The check above can fail: skipping `SharedPrefixForward.backward` loses the prefix's
    share of the gradient."""
    model = _model("llama")
    samples = _samples()[:4]
    ids = [s.token_ids for s in samples]
    [c] = prefix_clusters(ids, first_loss_rows(samples))
    [b] = echoloss.pack(samples, max_tokens=512)
    x = LossInputs.from_targets(echoloss.next_token_targets(b))
    norms = count_normalizers(x)
    ref = echoloss.echo_loss(
        packed_logits(model, b, attn_implementation="sdpa"), x, config=CONFIG, normalizers=norms
    )
    ref.loss.backward()
    want = _grads(model)
    shared = SharedPrefixForward(model, [ids[0][: c.prefix_len]], pad_id=0)
    rows = loss_rows(shared.hidden(b, 0), lm_head_weight(model), x)
    echoloss.echo_loss_from_hidden(
        rows.hidden, rows.weight, rows.inputs, config=CONFIG, normalizers=norms
    ).loss.backward()
    got = _grads(model)  # no shared.backward()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (got[q] - want[q]).abs().max() > 1e-3 * want[q].abs().max()


def test_auto_forward_by_setting():
    def resolve(world: int = 1, export_tokens: bool = False, **model):
        m = parse_config({"model": model}).model  # the settings as the config validates them
        return resolve_update_forward(
            m.update_forward,
            attn_implementation=m.attn_implementation,
            world=world,
            export_tokens=export_tokens,
        )

    assert resolve() == "shared_prefix"
    assert resolve(attn_implementation="flash_attention_2") == "packed"
    assert resolve(world=2) == "logits"
    assert resolve(export_tokens=True) == "logits"
    with pytest.raises(ValueError, match=r"model.update_forward = 'packed'.*FSDP"):
        resolve(world=2, update_forward="packed")
    with pytest.raises(ValueError, match="'shared_prefix' needs a 4D attention mask"):
        resolve(update_forward="shared_prefix", attn_implementation="flash_attention_2")


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_gives_the_same_step_with_every_forward(tmp_path):
    """One warm-up step (SFT + observation CE) and one RL step with echo of the tiny model, in
    fp32, with each forward: the same losses and gradient norms (fp32 rounding of a different
    summation order: 1e-5 relative)."""
    from echoloss.train.recipe import train

    rows = {}
    for forward in ("logits", "packed", "shared_prefix"):
        cfg = fast_config(
            tmp_path / forward,
            **{
                "warmup.steps": 1,
                "train.max_steps": 1,
                "train.plots": False,
                "train.eval_at_start": False,
                "train.eval_episodes": 0,
                "data.heldout_size": 0,
                "model.update_forward": forward,
            },
        )
        rows[forward] = _rows(train(cfg, log=lambda _: None))
    for forward in ("packed", "shared_prefix"):
        for got, want in zip(rows[forward], rows["logits"], strict=True):
            assert got["update_forward"] == forward and want["update_forward"] == "logits"
            for key in ("loss", "loss_sft", "loss_obs", "loss_rl", "loss_echo", "grad_norm"):
                if key in want:
                    assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_a_step_without_a_gradient_runs_no_forward_and_steps_as_the_computed_one(
    tmp_path, monkeypatch
):
    """Every reward equal and λ = 0: the forward is skipped (and the row says why), and the
    weights after the step are bit for bit those of the computed step (whose gradient is an
    exact zero)."""
    from echoloss.train.recipe import train

    path = rollout_jsonl(tmp_path)
    records = [json.loads(x) for x in path.read_text().splitlines()]
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps({**r, "reward": 1.0}) + "\n" for r in records))
    settings = {
        "data.source": "jsonl",
        "data.path": str(same),
        "warmup.steps": 0,
        "train.max_steps": 2,
        "echo.alpha": 0.0,
        "train.plots": False,
        "data.heldout_size": 0,
        "train.checkpoint_every": 1,
    }
    skipped = train(fast_config(tmp_path / "skip", **settings), log=lambda _: None)
    monkeypatch.setattr(recipe, "no_gradient", lambda *a: None)
    computed = train(fast_config(tmp_path / "full", **settings), log=lambda _: None)
    for row in _rows(skipped):
        assert row["update_forward"] == "skipped: every advantage is 0 and no echo row"
        assert row["grad_norm"] == 0.0
    assert all(r["update_forward"] == "shared_prefix" for r in _rows(computed))
    assert all(r["grad_norm"] == 0.0 for r in _rows(computed))
    from safetensors.torch import load_file

    a = load_file(skipped / "final-model" / "model.safetensors")
    b = load_file(computed / "final-model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_no_gradient_reasons():
    """Which losses may train without an advantage: not skipped."""

    class Mb:
        def __init__(self, rl: int, echo: int, adv: float):
            x = LossInputs(rl_mask=torch.tensor([True, False]), advantages=torch.tensor([adv, 0.0]))
            self.inputs = [x]
            self.norms = Normalizers(rl_tokens=rl, echo_tokens=echo)

    class Run:
        def __init__(self, **loss):
            self.cfg = parse_config({"loss": loss})
            self.ranks = type("R", (), {"world": 1})()

    from echoloss.train.regimes import phase_at

    run = Run()
    c = run.cfg
    rl = phase_at(0, 0, warmup=c.warmup, echo=c.echo, rl_lr=c.optim.lr)
    assert recipe.no_gradient(run, Mb(0, 0, 0.0), rl) == "no row carries loss"
    assert recipe.no_gradient(run, Mb(1, 0, 0.0), rl) == "every advantage is 0 and no echo row"
    assert recipe.no_gradient(run, Mb(1, 0, 0.5), rl) is None
    assert recipe.no_gradient(run, Mb(1, 2, 0.0), rl) is None  # echo trains
    for loss in ({"entropy_coef": 0.01}, {"kl_tau": 1e-3}, {"policy": "dppo", "kl_tau": None}):
        assert recipe.no_gradient(Run(**loss), Mb(1, 0, 0.0), rl) is None, loss


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_generation_with_the_prompt_prefilled_once_samples_what_it_would_without(
    dtype, monkeypatch
):
    """The tiny model plays two groups of mirrorgrid episodes (several turns each) with the
    shared system prompt prefilled once, and without: the same replies and the same sampling
    logprobs (fp64: 1e-12; fp32: 1e-5, the rounding of a different prefill batch shape)."""
    from echoloss.train import data
    from echoloss.train.envs import make_env
    from echoloss.train.model import build_tokenizer

    tok = build_tokenizer()
    model = build_tiny_model(
        arch="qwen3", vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, intermediate_size=48, max_position_embeddings=1024, seed=0,
    ).to(dtype)  # fmt: skip
    env = make_env("mirrorgrid")
    tasks = [(g, env.task(seed=0, index=g)) for g in range(2)]
    prefills = []
    real = data.prefill

    def counted(*args, **kwargs):
        prefills.append(len(args[1]))
        return real(*args, **kwargs)

    def play():
        torch.manual_seed(3)
        return data.generate_rollouts(
            model, tok, env, tasks, group_size=3, temperature=1.0, max_new_tokens=4,
            device=torch.device("cpu"),
        )  # fmt: skip

    monkeypatch.setattr(data, "prefill", counted)
    shared = play()
    assert len(prefills) == 1 and prefills[0] >= 16  # once for the whole call, every turn
    monkeypatch.setattr(data, "_shared_prompt", lambda *a: False)
    plain = play()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    turns = 0
    for a, b in zip(shared, plain, strict=True):
        for sa, sb in zip(a.steps, b.steps, strict=True):
            assert sa.prompt_ids == sb.prompt_ids and sa.completion_ids == sb.completion_ids
            torch.testing.assert_close(
                torch.tensor(sa.completion_logprobs), torch.tensor(sb.completion_logprobs),
                rtol=tol, atol=tol,
            )  # fmt: skip
            turns += 1
    assert turns > len(shared)  # later turns reused the prefix too
