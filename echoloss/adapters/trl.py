"""TRL ``GRPOTrainer`` with the echo term on tool observations (extra ``trl``).

TRL's GRPO tool loop (``GRPOTrainer(tools=[...])``) appends each batch of tool results to the
completion as the chat template renders them, and marks those tokens ``tool_mask = 0`` so that RL
skips them. `EchoGRPOTrainer` trains them with the echo cross-entropy instead:

1. After generation it rebuilds, for every completion, the tool messages TRL appended and
   attributes their tokens with [`echoloss.adapters.chat`][echoloss.adapters.chat], rendering them exactly as TRL
   does (``_get_tool_suffix_ids``); the rendered ids must equal the completion's tokens. Only the
   tool result *bodies* are echoed (``EchoConfig(target="content")``), never the
   ``<tool_response>`` wrappers or the next generation prompt.
2. Its loss is TRL's own objective for the configured ``loss_type`` and
   ``importance_sampling_level`` ([`trl_loss_mapping`][echoloss.adapters.trl.trl_loss_mapping]: mapped exactly or rejected with an
   error) on the model's tokens, plus ``λ · (-log p)`` on the echoed tool tokens with the
   normaliser of [`scale_echo_weights`][echoloss.adapters.trl.scale_echo_weights].

`EchoGRPOConfig` is ``GRPOConfig`` with the echo fields, so ``TrlParser`` reads them from
YAML and the command line. A ``rollout_func`` may return ``"echo_weights"`` itself (one list per
completion, aligned to ``completion_ids``, ``0.0`` = not echoed) next to TRL's ``"env_mask"``.

Importing this module does not import TRL; ``EchoGRPOTrainer`` and ``EchoGRPOConfig`` are built
on first access. ``docs/guides/trl.md`` has the option mapping and the measured equivalence.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from echoloss import (
    EchoConfig,
    Normalizers,
    StepEcho,
    TokenAttribution,
    select_step_echo,
)
from echoloss._logging import warn_once

if TYPE_CHECKING:  # pragma: no cover
    from echoloss import LossConfig, PolicyInputs, PolicyOutput

__all__ = [  # noqa: F822 (the TRL classes are built on first access)
    "ECHO_NORMALIZATIONS",
    "TRL_LOSS_TYPES",
    "EchoGRPOConfig",
    "EchoGRPOTrainer",
    "TrlLossMapping",
    "completion_echo",
    "scale_echo_weights",
    "trl_loss_mapping",
]


def _runs(mask: Sequence[int | bool], value: bool) -> list[tuple[int, int]]:
    out, k = [], 0
    while k < len(mask):
        if bool(mask[k]) != value:
            k += 1
            continue
        end = k
        while end < len(mask) and bool(mask[end]) == value:
            end += 1
        out.append((k, end))
        k = end
    return out


def _tool_groups(messages: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    groups: list[list[Mapping[str, Any]]] = []
    previous_tool = False
    for m in messages:
        is_tool = m.get("role") == "tool"
        if is_tool and previous_tool:
            groups[-1].append(m)
        elif is_tool:
            groups.append([m])
        previous_tool = is_tool
    return groups


def _eos_trimmed(ids: list[int], eos_id: int | None) -> list[int]:
    if eos_id is None or eos_id not in ids:
        return ids
    last = len(ids) - 1 - ids[::-1].index(eos_id)
    return ids[: last + 1]


def completion_echo(
    completion_ids: Sequence[int],
    tool_mask: Sequence[int | bool],
    completion_messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    echo: EchoConfig,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> StepEcho:
    """Echo weights over one TRL completion whose tool results TRL appended in its tool loop.

    Each maximal run of ``tool_mask == 0`` tokens is one batch of consecutive tool messages of
    ``completion_messages``. TRL renders such a batch as the suffix of
    ``[user, assistant(tool call)] + tool messages`` (with the generation prompt) after the
    assistant's end-of-turn token; this function renders it the same way with
    [`echoloss.adapters.chat.render_attributed`][echoloss.adapters.chat.render_attributed] (bodies located exactly, prefix stability
    not required), checks that the ids equal the run's tokens, and selects echo on it with
    [`echoloss.select_step_echo`][echoloss.data.echo_weights.select_step_echo] (tool role, tool-name allow-list, ``target``,
    ``max_tokens_per_message``). With the assistant role enabled, every model token
    (``tool_mask == 1``) gets the assistant weight.

    Args:
        completion_ids: ``[C]`` the completion's token ids (model and tool tokens).
        tool_mask: ``[C]`` 1 on model tokens, 0 on tool-result tokens (TRL's ``tool_mask``).
        completion_messages: the completion as messages (TRL's ``completions[i]``: assistant
            turns and the tool messages, each with ``name`` and ``content``).
        tokenizer: the tokenizer TRL renders with.
        echo: [`echoloss.EchoConfig`][echoloss.data.echo_config.EchoConfig]; only the ``tool`` and ``assistant`` roles can apply
            (the system and user messages are in the prompt, never echoed).
        chat_template: the template TRL renders with (``trainer.chat_template``), None = the
            tokenizer's.
        chat_template_kwargs: TRL's ``chat_template_kwargs``.

    Returns:
        [`echoloss.StepEcho`][echoloss.data.echo_weights.StepEcho] over the ``C`` completion tokens.

    Raises:
        ValueError: the tool-result runs and tool messages do not pair up, or a rendered batch of
            tool messages differs from the completion's tokens.
    """
    from echoloss.adapters.chat import render_attributed

    ids = list(completion_ids)
    mask = list(tool_mask)
    if len(mask) != len(ids):
        raise ValueError(
            f"tool_mask has length {len(mask)}, expected {len(ids)} (one per completion token)"
        )
    weights: list[float | None] = [None] * len(ids)
    observation = [False] * len(ids)
    runs = _runs(mask, False)
    groups = _tool_groups(completion_messages)
    if len(runs) != len(groups):
        raise ValueError(
            f"the completion has {len(runs)} run(s) of tool tokens (tool_mask == 0) but "
            f"{len(groups)} group(s) of tool messages; they must pair up one to one"
        )
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    eos_id = getattr(tokenizer, "eos_token_id", None)
    for j, ((a, b), group) in enumerate(zip(runs, groups, strict=True)):
        name = group[0].get("name")
        dummy = [
            {"role": "user", "content": "dummy"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}],
            },
        ]
        prefix = tokenizer.apply_chat_template(
            dummy, add_generation_prompt=False, tokenize=True, return_dict=False, **kwargs
        )
        prefix = _eos_trimmed([int(t) for t in prefix], eos_id)
        rendered = render_attributed(
            [*dummy, *group],
            tokenizer,
            add_generation_prompt=True,
            chat_template_kwargs=kwargs,
            require_prefix_stability=False,
        )
        p = len(prefix)
        if rendered.token_ids[:p] != prefix or rendered.token_ids[p:] != ids[a:b]:
            raise ValueError(
                f"tool results {j} (tokens {a}:{b} of the completion) do not render to the "
                "completion's tokens with this tokenizer and chat template; pass the template "
                "and kwargs the trainer renders with"
            )
        att = rendered.attribution
        suffix = TokenAttribution(
            message_indices=att.message_indices[p:],
            is_content=att.is_content[p:],
            message_roles=att.message_roles,
            message_tool_names=att.message_tool_names,
        )
        sel = select_step_echo(
            suffix, echo, prompt_len=b - a, completion_len=0, initial_prompt_len=0
        )
        weights[a:b] = sel.weights
        observation[a:b] = sel.observation
    assistant = echo.role_settings().get("assistant")
    if assistant is not None:
        for k, m in enumerate(mask):
            if m:
                weights[k] = assistant.alpha
                observation[k] = True
    return StepEcho(weights=weights, observation=observation)


# ---------------------------------------------------------------------------------------------
# TRL's loss_type / importance_sampling_level → echoloss, exactly or not at all.
# ---------------------------------------------------------------------------------------------

#: Every ``GRPOConfig.loss_type`` of TRL 1.16 and what happens to it (``docs/guides/trl.md``).
TRL_LOSS_TYPES: dict[str, str] = {
    "grpo": "mapped",
    "bnpo": "mapped",
    "dr_grpo": "mapped",
    "dapo": "mapped",
    "cispo": "mapped",
    "sapo": "mapped",
    "luspo": "mapped",
    "vespo": "rejected",
}

#: Echo normalisers an :class:`EchoGRPOConfig` offers, per micro-batch of ``B`` completions.
ECHO_NORMALIZATIONS = ("token_mean", "sequence_mean", "batch_token_mean")
ECHO_TEMPERATURES = ("one", "sampling")


@dataclass(frozen=True)
class TrlLossMapping:
    """How one ``GRPOConfig`` maps onto echoloss; built by [`trl_loss_mapping`][echoloss.adapters.trl.trl_loss_mapping].

    Attributes:
        loss_type: TRL's ``loss_type``.
        config: the [`echoloss.LossConfig`][echoloss.loss.config.LossConfig] of every micro-batch except its RL normaliser
            constant, which [`micro_batch`][echoloss.adapters.trl.TrlLossMapping.micro_batch] fills in (the echo term always uses
            ``echo_normalization="sum"`` on pre-scaled weights, see [`scale_echo_weights`][echoloss.adapters.trl.scale_echo_weights]).
        policy_fn: the custom policy of ``sapo`` and sequence-level ``cispo`` (TRL's formula on
            the RL rows), else None.
    """

    loss_type: str
    config: LossConfig
    policy_fn: Any = None

    def micro_batch(
        self,
        *,
        batch_size: int,
        max_completion_length: int,
        num_items_in_batch: float | None,
        num_processes: int,
        accumulation_steps: int,
        steps_per_generation: int,
    ) -> tuple[LossConfig, Normalizers | None]:
        """The config and normalisers whose RL term equals TRL's loss of one micro-batch.

        TRL divides each micro-batch's loss so that the accumulated gradients give its objective:

        ============  ===============================================================
        loss_type     RL divisor of ``Σ_t loss_t`` (train; eval sets ``accumulation_steps=1``)
        ============  ===============================================================
        grpo, sapo    per-sequence token mean, summed, over ``B · accumulation_steps``
                      (every completion counts, masked ones too)
        bnpo          this micro-batch's RL tokens ``· accumulation_steps``
        dr_grpo       ``B · max_completion_length · accumulation_steps``
        dapo, cispo   ``num_items_in_batch / num_processes · accumulation_steps /
                      steps_per_generation`` (RL tokens of the generation batch)
        luspo         ``B · accumulation_steps``
        ============  ===============================================================

        ``bnpo`` takes its divisor from the RL rows in the loss itself (``token_mean`` with
        ``rl_tokens`` scaled), every other type from the arguments.
        """
        cfg, lt = self.config, self.loss_type
        ga = accumulation_steps
        if lt in ("grpo", "sapo"):
            return cfg, _sequence_normalizers(batch_size * ga)
        if lt == "dr_grpo":
            constant = float(batch_size * max_completion_length * ga)
        elif lt in ("dapo", "cispo"):
            if num_items_in_batch is None:
                raise ValueError(
                    f"num_items_in_batch: loss_type={lt!r} divides by the RL tokens of the whole "
                    "generation batch (TRL's inputs['num_items_in_batch']); it is missing"
                )
            constant = max(float(num_items_in_batch), 1.0) / num_processes
            constant = constant * ga / steps_per_generation
        elif lt == "luspo":
            constant = float(batch_size * ga)
        else:  # bnpo: filled in by the caller from its RL-token count
            return cfg, None
        return cfg.model_copy(update={"rl_normalization_constant": constant}), None


def _sequence_normalizers(count: int) -> Normalizers:
    """Normalizers whose RL ``sequence_mean*`` denominator is ``count``.

    Every count the RL term divides by in the ``sequence_mean*`` modes is set (``rl_sequences``;
    ``sequences`` where that is the denominator), the others stay 0 (unused by these modes).
    """
    names = {f.name for f in dataclasses.fields(Normalizers)}
    return Normalizers(**{k: count for k in ("sequences", "rl_sequences") if k in names})


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def trl_loss_mapping(args: Any, *, epsilon_low: float, epsilon_high: float) -> TrlLossMapping:
    """Map a ``GRPOConfig`` onto echoloss exactly, or raise naming the setting and the fix.

    Mapped: every ``loss_type`` but ``vespo`` (see [`TRL_LOSS_TYPES`][echoloss.adapters.trl.TRL_LOSS_TYPES]), both
    ``importance_sampling_level`` values, ``epsilon``/``epsilon_high``, ``delta`` (as
    ``dual_clip``, which equals it whenever ``delta > 1 + epsilon_high``), ``beta`` (k3 reference
    KL, with ``use_bias_correction_kl=False``) and the vLLM importance-sampling correction (as
    ``LossConfig.mismatch``). Rejected with an error: ``vespo``, ``top_entropy_quantile < 1``,
    ``off_policy_mask_threshold``, an entropy bonus, ``use_bias_correction_kl=True`` with
    ``beta > 0``, ``delta`` with sequence-level ratios, and any unknown value.

    Args:
        args: a ``trl.GRPOConfig`` (or any object with its fields).
        epsilon_low, epsilon_high: the clip range the trainer resolved (TRL's
            ``trainer.epsilon_low`` / ``epsilon_high``).

    Returns:
        [`TrlLossMapping`][echoloss.adapters.trl.TrlLossMapping].

    Examples:
        >>> from types import SimpleNamespace as NS
        >>> args = NS(loss_type="grpo", importance_sampling_level="sequence", beta=0.0,
        ...           delta=None, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        ...           entropy_coef=0.0, use_adaptive_entropy=False, use_vllm=False,
        ...           use_bias_correction_kl=True, echo_temperature="one")
        >>> m = trl_loss_mapping(args, epsilon_low=3e-4, epsilon_high=4e-4)
        >>> m.config.policy, m.config.resolved_eps, m.config.rl_normalization
        ('gspo', (0.0003, 0.0004), 'sequence_mean_token_mean')
        >>> trl_loss_mapping(NS(**{**vars(args), "loss_type": "xyz"}), epsilon_low=0.2,
        ...                  epsilon_high=0.2)
        Traceback (most recent call last):
        ...
        ValueError: loss_type='xyz' is not a TRL 1.16 loss type; expected one of bnpo, cispo, dapo, dr_grpo, grpo, luspo, sapo, vespo
    """
    from echoloss import LossConfig

    lt = getattr(args, "loss_type", None)
    if lt not in TRL_LOSS_TYPES:
        raise ValueError(
            f"loss_type={lt!r} is not a TRL 1.16 loss type; expected one of "
            f"{', '.join(sorted(TRL_LOSS_TYPES))}"
        )
    _require(
        lt != "vespo",
        "loss_type='vespo' is not supported by EchoGRPOTrainer: its Gamma weight folds TRL's "
        "vLLM importance ratio into a sequence-level coefficient that echoloss has no exact "
        "equivalent for; use GRPOTrainer for vespo, or another loss_type",
    )
    level = getattr(args, "importance_sampling_level", "token")
    _require(
        level in ("token", "sequence"),
        f"importance_sampling_level={level!r}: expected 'token' or 'sequence'",
    )
    sequence = level == "sequence"
    _require(
        float(getattr(args, "top_entropy_quantile", 1.0)) >= 1.0,
        f"top_entropy_quantile={args.top_entropy_quantile} is not supported by EchoGRPOTrainer "
        "(echoloss has no high-entropy token mask); set top_entropy_quantile=1.0",
    )
    _require(
        getattr(args, "off_policy_mask_threshold", None) is None,
        "off_policy_mask_threshold is not supported by EchoGRPOTrainer (echoloss has no "
        "off-policy sequence mask); set it to None",
    )
    _require(
        float(getattr(args, "entropy_coef", 0.0)) == 0.0
        and not getattr(args, "use_adaptive_entropy", False),
        "entropy_coef / use_adaptive_entropy: TRL's entropy bonus is a per-micro-batch token "
        "mean independent of loss_type, which echoloss's entropy_coef (normalised with the RL "
        "term) does not reproduce; set entropy_coef=0 and use_adaptive_entropy=False",
    )
    beta = float(getattr(args, "beta", 0.0))
    _require(
        beta == 0.0 or not getattr(args, "use_bias_correction_kl", False),
        f"beta={beta} with use_bias_correction_kl=True: TRL multiplies the KL by the "
        "differentiable importance ratio, which echoloss's k3 KL does not; set "
        "use_bias_correction_kl=False (then kl_coef=beta, kl_estimator='k3' exactly)",
    )
    delta = getattr(args, "delta", None)
    if delta is not None:
        _require(
            lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo") and not sequence,
            f"delta={delta} is mapped for token-level PPO-clip loss types only "
            f"(loss_type={lt!r}, importance_sampling_level={level!r}); set delta=None",
        )
        _require(
            float(delta) > 1.0 + epsilon_high,
            f"delta={delta} must be > 1 + epsilon_high = {1.0 + epsilon_high} for an exact "
            "mapping (it is then LossConfig.dual_clip); raise delta or set it to None",
        )
    mismatch: dict[str, Any] = {}
    if getattr(args, "use_vllm", False) and getattr(
        args, "vllm_importance_sampling_correction", False
    ):
        mode = args.vllm_importance_sampling_mode
        hi = args.vllm_importance_sampling_clip_max
        _require(
            hi is not None,
            "vllm_importance_sampling_clip_max=None: echoloss's mismatch correction needs an "
            "upper bound (LossConfig.mismatch_max); set vllm_importance_sampling_clip_max",
        )
        mismatch = {
            "mismatch": mode,
            "mismatch_max": float(hi),
            "mismatch_min": args.vllm_importance_sampling_clip_min,
        }
    policy_fn = None
    fields: dict[str, Any] = {
        "kl_tau": 0.0,
        "kl_coef": beta,
        "kl_estimator": "k3",
        "log_ratio_clamp": None,  # TRL exponentiates the raw log ratio
        "echo_normalization": "sum",  # the echo weights arrive pre-scaled
        "echo_temperature": getattr(args, "echo_temperature", "one"),
        "compute_entropy": True,
        **mismatch,
    }
    if lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        fields.update(
            policy="gspo" if sequence else "ppo_clip",
            eps_low=epsilon_low,
            eps_high=epsilon_high,
            dual_clip=None if delta is None else float(delta),
        )
    elif lt == "cispo" and not sequence:
        fields.update(policy="cispo", cispo_max=epsilon_high, cispo_min=None)
    elif lt == "cispo":
        fields.update(policy="custom", allow_echo_with_custom_policy=True)
        policy_fn = _SequenceCispo(epsilon_high)
    else:  # sapo
        fields.update(policy="custom", allow_echo_with_custom_policy=True)
        policy_fn = _Sapo(
            float(args.sapo_temperature_pos), float(args.sapo_temperature_neg), sequence
        )
    fields["rl_normalization"] = {
        "grpo": "sequence_mean_token_mean",
        "sapo": "sequence_mean_token_mean",
        "bnpo": "token_mean",
    }.get(lt, "token_sum_constant")
    if fields["rl_normalization"] == "token_sum_constant":
        fields["rl_normalization_constant"] = 1.0  # replaced per micro-batch
    return TrlLossMapping(lt, LossConfig(**fields), policy_fn)


def _log_ratio(inputs: PolicyInputs, sequence: bool) -> torch.Tensor:
    from echoloss.loss.policy import sequence_mean

    log_ratio = inputs.logprobs - inputs.old_logprobs
    if not sequence:
        return log_ratio
    if inputs.sequence_index is None:  # pragma: no cover - the adapter always passes them
        raise ValueError("a sequence-level ratio needs sequence_ids")
    per_seq = sequence_mean(log_ratio, inputs.sequence_index, inputs.num_sequences)
    return per_seq[inputs.sequence_index]


@dataclass(frozen=True)
class _Sapo:
    """TRL's ``sapo``: ``-σ(τ (r - 1)) · 4/τ · A`` with ``τ`` by the sign of ``A``."""

    temperature_pos: float
    temperature_neg: float
    sequence: bool

    def __call__(self, inputs: PolicyInputs, config: LossConfig) -> PolicyOutput:
        from echoloss import PolicyOutput

        ratio = torch.exp(_log_ratio(inputs, self.sequence))
        adv = inputs.advantages
        tau = torch.where(
            adv > 0,
            torch.full_like(adv, self.temperature_pos),
            torch.full_like(adv, self.temperature_neg),
        )
        return PolicyOutput(-(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * adv, {})


@dataclass(frozen=True)
class _SequenceCispo:
    """TRL's ``cispo`` with sequence-level ratios: ``-sg(min(s, ε_high)) · A · log p``."""

    epsilon_high: float

    def __call__(self, inputs: PolicyInputs, config: LossConfig) -> PolicyOutput:
        from echoloss import PolicyOutput

        with torch.no_grad():
            ratio = torch.exp(_log_ratio(inputs, True))
            clipped = ratio > self.epsilon_high
            weight = ratio.clamp(max=self.epsilon_high)
        return PolicyOutput(-weight * inputs.advantages * inputs.logprobs, {"clipped": clipped})


def scale_echo_weights(
    echo_weights: torch.Tensor,
    observation_mask: torch.Tensor,
    *,
    normalization: str,
    num_echo_items_in_batch: float | None,
    num_processes: int,
    accumulation_steps: int,
    steps_per_generation: int,
) -> torch.Tensor:
    """``[B, T]`` echo weights pre-divided by the echo normaliser of one TRL micro-batch.

    The loss then sums ``w'_t · (-log p_t)`` (``echo_normalization="sum"``), so the echo term
    gets TRL's accumulation scaling exactly as the RL term does:

    - ``"token_mean"``: ``w / (num_echo_items_in_batch / num_processes · accumulation_steps /
      steps_per_generation)``: the mean over the echo tokens of the generation batch, like
      ``dapo`` for RL tokens.
    - ``"sequence_mean"`` (the ECHO paper): ``w / (|O_i| · B · accumulation_steps)`` with
      ``|O_i|`` the observation tokens of completion ``i`` (echoed or not); every completion
      counts in ``B``, like ``grpo``.
    - ``"batch_token_mean"``: ``w / (echo tokens of this micro-batch · accumulation_steps)``.

    Args:
        echo_weights: ``[B, T]`` float ≥ 0 (0 = not echoed).
        observation_mask: ``[B, T]`` bool, the rows counted in ``|O_i|``.
        normalization: one of [`ECHO_NORMALIZATIONS`][echoloss.adapters.trl.ECHO_NORMALIZATIONS].
        num_echo_items_in_batch: echo tokens in the generation batch over every process
            (``"token_mean"`` only).
        num_processes, accumulation_steps, steps_per_generation: as in TRL (eval: 1, 1, 1 for the
            last two factors' ratio).

    Examples:
        >>> w = torch.tensor([[0.0, 0.5, 0.5], [0.5, 0.0, 0.0]])
        >>> obs = torch.tensor([[False, True, True], [True, True, False]])
        >>> scale_echo_weights(w, obs, normalization="sequence_mean", num_echo_items_in_batch=None,
        ...                    num_processes=1, accumulation_steps=1, steps_per_generation=1)
        tensor([[0.0000, 0.1250, 0.1250],
                [0.1250, 0.0000, 0.0000]])
    """
    echoed = echo_weights > 0
    if normalization == "token_mean":
        if num_echo_items_in_batch is None:
            raise ValueError(
                "num_echo_items_in_batch: required by echo normalization 'token_mean' (echo "
                "tokens of the generation batch over every process)"
            )
        divisor = max(float(num_echo_items_in_batch), 1.0) / num_processes
        return echo_weights / (divisor * accumulation_steps / steps_per_generation)
    if normalization == "batch_token_mean":
        return echo_weights / (max(int(echoed.sum()), 1) * accumulation_steps)
    if normalization == "sequence_mean":
        z = (observation_mask | echoed).sum(dim=1, keepdim=True).clamp(min=1)
        return echo_weights / (z * echo_weights.shape[0] * accumulation_steps)
    raise ValueError(
        f"echo normalization={normalization!r}: expected one of {', '.join(ECHO_NORMALIZATIONS)}"
    )


def _row_temperature(
    rl: torch.Tensor, echo: torch.Tensor, temperature: float, echo_temperature: str
) -> torch.Tensor:
    temp = torch.full(rl.shape, float(temperature), device=rl.device)
    if echo_temperature == "one":
        temp = temp.masked_fill(echo, 1.0)
    return temp


# ---------------------------------------------------------------------------------------------
# TRL classes, built on first access (importing this module does not import TRL).
# ---------------------------------------------------------------------------------------------

_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name in ("EchoGRPOTrainer", "EchoGRPOConfig"):
        if not _CLASSES:
            _build_classes()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _import_trl() -> Any:
    try:
        import trl
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise ImportError("echoloss.adapters.trl needs TRL: pip install 'echoloss[trl]'") from e
    return trl


def _build_classes() -> None:
    trl = _import_trl()
    from echoloss import RoleEcho, echo_loss_from_logprobs, selective_logprobs

    @dataclass
    class EchoGRPOConfig(trl.GRPOConfig):  # type: ignore[misc, valid-type]
        """``trl.GRPOConfig`` plus the echo settings, so that ``TrlParser`` reads them from YAML
        and the command line (``--echo_tool_alpha 0.05``).

        Attributes:
            echo_tool_alpha: λ on tool-result bodies (None = tool results not echoed).
            echo_assistant_alpha: λ on every model token (None = off; such tokens leave RL).
            echo_tool_names: allow-list of tool names whose results are echoed (None = all).
            echo_target: ``"content"`` (bodies only) or ``"message"`` (with the template
                scaffold).
            echo_normalization: ``"token_mean"`` (echo tokens of the generation batch, like
                ``dapo``), ``"sequence_mean"`` (the ECHO paper's ``1/|O_i|``, then a mean over
                every completion, like ``grpo``) or ``"batch_token_mean"`` (each micro-batch's
                echo-token mean); see [`scale_echo_weights`][echoloss.adapters.trl.scale_echo_weights].
            echo_temperature: ``"one"`` (echo rows at ``T = 1``) or ``"sampling"`` (at
                ``temperature``).
        """

        echo_tool_alpha: float | None = field(
            default=None, metadata={"help": "Echo weight λ on tool-result bodies; None = off."}
        )
        echo_assistant_alpha: float | None = field(
            default=None,
            metadata={"help": "Echo weight on the model's own tokens (they leave RL); None = off."},
        )
        echo_tool_names: list[str] | None = field(
            default=None,
            metadata={"help": "Only echo the results of these tools; None = every tool."},
        )
        echo_target: str = field(
            default="content",
            metadata={"help": "Echo message bodies only, or the whole message.",
                      "choices": ["content", "message"]},
        )  # fmt: skip
        echo_normalization: str = field(
            default="token_mean",
            metadata={"help": "Normaliser of the echo term.", "choices": list(ECHO_NORMALIZATIONS)},
        )
        echo_temperature: str = field(
            default="one",
            metadata={"help": "Temperature of the echo rows.", "choices": list(ECHO_TEMPERATURES)},
        )

        def __post_init__(self) -> None:
            super().__post_init__()
            if isinstance(self.echo_tool_names, str):  # a single name from YAML
                self.echo_tool_names = [self.echo_tool_names]
            for name, choices in (
                ("echo_target", ("content", "message")),
                ("echo_normalization", ECHO_NORMALIZATIONS),
                ("echo_temperature", ECHO_TEMPERATURES),
            ):
                value = getattr(self, name)
                if value not in choices:
                    raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
            for name in ("echo_tool_alpha", "echo_assistant_alpha"):
                value = getattr(self, name)
                if value is not None and not (math.isfinite(value) and value > 0):
                    raise ValueError(
                        f"{name}={value}: expected a finite λ > 0, or None to switch the role off"
                    )
            if self.echo_tool_names is not None and self.echo_tool_alpha is None:
                raise ValueError(
                    "echo_tool_names is set but echo_tool_alpha is None: set echo_tool_alpha "
                    "(the allow-list applies to the tool role)"
                )

        def echo_config(self) -> EchoConfig | None:
            """The [`echoloss.EchoConfig`][echoloss.data.echo_config.EchoConfig] of these fields (None when no role is on)."""
            tool = assistant = None
            if self.echo_tool_alpha is not None:
                names = None if self.echo_tool_names is None else frozenset(self.echo_tool_names)
                tool = RoleEcho(alpha=self.echo_tool_alpha, tool_names=names)
            if self.echo_assistant_alpha is not None:
                assistant = RoleEcho(alpha=self.echo_assistant_alpha)
            if tool is None and assistant is None:
                return None
            return EchoConfig(tool=tool, assistant=assistant, target=self.echo_target)  # type: ignore[arg-type]

    class EchoGRPOTrainer(trl.GRPOTrainer):  # type: ignore[misc, valid-type]
        """``trl.GRPOTrainer`` whose loss is TRL's own objective (every ``loss_type`` mapped
        exactly, see [`trl_loss_mapping`][echoloss.adapters.trl.trl_loss_mapping]) plus the echo cross-entropy on tool-result bodies.

        Args:
            *args, **kwargs: as ``trl.GRPOTrainer`` (pass ``tools=[...]`` to run TRL's tool loop).
                ``args`` may be an `EchoGRPOConfig` carrying the echo settings.
            echo: [`echoloss.EchoConfig`][echoloss.data.echo_config.EchoConfig], instead of the ``echo_*`` fields of an
                `EchoGRPOConfig` (not both). The ``tool`` role (and optionally
                ``assistant``) applies. None with no ``echo_*`` field set = no echo term (TRL's
                loss alone).

        Raises:
            ValueError: a ``GRPOConfig`` setting has no exact echoloss equivalent (the message
                names it and the fix), or echo settings were given twice.

        The loss of a micro-batch is divided exactly as TRL divides it (gradient accumulation,
        ``num_items_in_batch`` for ``dapo``/``cispo``). On-policy steps
        (``old_per_token_logps`` None) take the ratio's denominator from the same logprob pass.
        Metrics are logged as ``echoloss/<name>``.
        """

        def __init__(self, *args: Any, echo: EchoConfig | None = None, **kwargs: Any) -> None:
            if "loss_config" in kwargs:
                raise TypeError(
                    "EchoGRPOTrainer no longer takes loss_config: the loss follows the "
                    "GRPOConfig (loss_type, epsilon, beta, ...) exactly; set the echo fields of "
                    "EchoGRPOConfig for the echo term"
                )
            super().__init__(*args, **kwargs)
            self._init_echo(echo)

        def _init_echo(self, echo: EchoConfig | None) -> None:
            """Resolve the echo settings and the loss mapping (called by ``__init__``)."""
            from_args = self.args.echo_config() if isinstance(self.args, EchoGRPOConfig) else None
            if echo is not None and from_args is not None:
                raise ValueError(
                    "echo settings given twice: pass echo=EchoConfig(...) or set the echo_* "
                    "fields of EchoGRPOConfig, not both"
                )
            echo = echo if echo is not None else from_args
            if echo is not None and not isinstance(echo, EchoConfig):
                raise TypeError(f"echo must be an echoloss.EchoConfig, got {type(echo).__name__}")
            if echo is not None:
                unused = sorted(set(echo.role_settings()) - {"tool", "assistant"})
                if unused or echo.filter is not None or not echo.skip_initial_prompt:
                    raise ValueError(
                        "EchoGRPOTrainer echoes tool results (and optionally assistant tokens): "
                        f"the system and user messages are the prompt, never echoed; remove "
                        f"{unused or ''}{' filter' if echo.filter is not None else ''}"
                        f"{' skip_initial_prompt=False' if not echo.skip_initial_prompt else ''} "
                        "from the EchoConfig"
                    )
            else:
                warn_once(
                    "trl-no-echo",
                    "echoloss: EchoGRPOTrainer without echo settings trains TRL's loss only; set "
                    "echo_tool_alpha (EchoGRPOConfig) or pass echo=EchoConfig(...)",
                )
            self.echo = echo
            self.echo_normalization = getattr(self.args, "echo_normalization", "token_mean")
            self.echo_mapping = trl_loss_mapping(
                self.args, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high
            )
            if getattr(self, "aux_loss_enabled", False):
                raise ValueError(
                    "router_aux_loss_coef != 0 on a model with router logits: EchoGRPOTrainer "
                    "does not add the MoE load-balancing loss; set router_aux_loss_coef=0"
                )
            self._echo_pending: tuple[list[list[float]], list[list[bool]]] | None = None

        def _generate(self, prompts: list) -> Any:
            out = super()._generate(prompts)
            _, completion_ids, tool_mask, completions, _, extra_fields, _, _ = out
            given = extra_fields.pop("echo_weights", None)
            if self.echo is None and given is None:
                self._echo_pending = (
                    [[0.0] * len(ids) for ids in completion_ids],
                    [[False] * len(ids) for ids in completion_ids],
                )
                return out
            weights: list[list[float]] = []
            observation: list[list[bool]] = []
            for i, ids in enumerate(completion_ids):
                if given is not None:
                    w = [float(x) for x in given[i]]
                    if len(w) != len(ids):
                        raise ValueError(
                            f"rollout_func echo_weights[{i}] has length {len(w)}, expected "
                            f"{len(ids)} (one per completion token)"
                        )
                    weights.append(w)
                    observation.append([x > 0 for x in w])
                    continue
                assert self.echo is not None
                mask = tool_mask[i] if tool_mask is not None else [1] * len(ids)
                if self.rollout_func is not None:
                    # Custom rollouts: TRL knows no tool messages to attribute their env tokens.
                    if any(not m for m in mask):
                        warn_once(
                            "trl-rollout-func-no-echo-weights",
                            "echoloss: a rollout_func returned env tokens (env_mask) but no "
                            "echo_weights; they are not echoed. Return 'echo_weights' (e.g. from "
                            "echoloss.adapters.chat) to echo them",
                        )
                    sel = completion_echo(
                        ids, [1] * len(ids), [], self.processing_class, echo=self.echo
                    )
                    weights.append(
                        [
                            0.0 if x is None or not m else x
                            for x, m in zip(sel.weights, mask, strict=True)
                        ]
                    )
                    observation.append(
                        [o and bool(m) for o, m in zip(sel.observation, mask, strict=True)]
                    )
                    continue
                messages = completions[i] if isinstance(completions[i], list) else []
                sel = completion_echo(
                    ids,
                    mask,
                    messages,
                    self.processing_class,
                    echo=self.echo,
                    chat_template=self.chat_template,
                    chat_template_kwargs=self.chat_template_kwargs,
                )
                weights.append([0.0 if x is None else x for x in sel.weights])
                observation.append(sel.observation)
            self._echo_pending = (weights, observation)
            return out

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            self._echo_pending = None
            output = super()._generate_and_score_completions(inputs)
            if self._echo_pending is None:  # pragma: no cover - TRL changed its call graph
                raise RuntimeError("EchoGRPOTrainer: _generate was not called during generation")
            weights, observation = self._echo_pending
            self._echo_pending = None
            completion_ids = output["completion_ids"]
            b, t = completion_ids.shape
            w = torch.zeros(b, t, dtype=torch.float32, device=completion_ids.device)
            o = torch.zeros(b, t, dtype=torch.bool, device=completion_ids.device)
            for i in range(b):
                n = len(weights[i])
                w[i, :n] = torch.tensor(weights[i], dtype=torch.float32)
                o[i, :n] = torch.tensor(observation[i], dtype=torch.bool)
            w = w * output["completion_mask"]  # truncated completions masked by TRL stay out
            output["echo_weights"] = w
            output["observation_mask"] = o
            # Like TRL's num_items_in_batch: echo tokens of the generation batch, all processes.
            output["num_echo_items_in_batch"] = self.accelerator.gather((w > 0).sum()).sum()
            return output

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            t = completion_ids.shape[1]
            with self.accelerator.autocast():
                out = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    logits_to_keep=t + 1,
                    use_cache=False,
                )
            logits = out.logits[:, :-1, :]  # row j predicts completion token j
            return self._echo_loss_from_logits(logits, inputs)

        def _echo_loss_from_logits(
            self, logits: torch.Tensor, inputs: dict[str, Any]
        ) -> torch.Tensor:
            """The loss of one micro-batch from its completion logits ``[B, T, V]``."""
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            b, t = completion_ids.shape
            valid = completion_mask.bool()
            echo_w = inputs["echo_weights"] * valid
            echo = echo_w > 0
            rl = valid & ~echo
            tool = inputs.get("tool_mask")
            if tool is not None:
                rl = rl & tool.bool()
            mapping = self.echo_mapping
            training = self.model.training
            ga = self.current_gradient_accumulation_steps if training else 1
            spg = self.args.steps_per_generation if training else 1
            nproc = self.accelerator.num_processes
            cfg, norms = mapping.micro_batch(
                batch_size=b,
                max_completion_length=self.max_completion_length,
                num_items_in_batch=_as_float(inputs.get("num_items_in_batch")),
                num_processes=nproc,
                accumulation_steps=ga,
                steps_per_generation=spg,
            )
            if mapping.loss_type == "bnpo":  # TRL: this micro-batch's loss tokens
                norms = Normalizers(rl_tokens=max(int(rl.sum()), 1) * ga)
            observation = inputs["observation_mask"] & valid
            scaled_echo = scale_echo_weights(
                echo_w.float(),
                observation,
                normalization=self.echo_normalization,
                num_echo_items_in_batch=_as_float(inputs.get("num_echo_items_in_batch")),
                num_processes=nproc,
                accumulation_steps=ga,
                steps_per_generation=spg,
            )
            temp = _row_temperature(rl, echo, self.temperature, cfg.echo_temperature)
            lp, ent = selective_logprobs(
                logits, completion_ids, temperature=temp, return_entropy=True, mask=rl | echo
            )
            adv = inputs["advantages"]
            adv = (adv.unsqueeze(1) if adv.dim() == 1 else adv).expand(b, t).float()
            old = inputs.get("old_per_token_logps")
            # On-policy: TRL's denominator is the current logprobs, detached; same pass here.
            old = lp.detach() if old is None else old.float()
            inference = None
            if cfg.mismatch is not None:
                sampling = inputs["sampling_per_token_logps"].float()
                # TRL gives a token whose sampling logprob is NaN an importance ratio of 1.
                inference = torch.where(torch.isnan(sampling), old, sampling)
            result = echo_loss_from_logprobs(
                lp,
                rl_mask=rl,
                echo_weights=scaled_echo,
                advantages=adv,
                inference_logprobs=inference,
                entropy=ent.detach(),
                config=cfg,
                normalizers=norms,
                old_logprobs=old,
                ref_logprobs=inputs.get("ref_per_token_logps") if cfg.kl_coef > 0 else None,
                sequence_ids=torch.arange(b, device=lp.device).unsqueeze(1).expand(b, t),
                observation_mask=observation,
                policy_fn=mapping.policy_fn,
            )
            mode = "train" if training else "eval"
            for key, value in result.metrics.items():
                if key.endswith("/all"):
                    self._metrics[mode][f"echoloss/{key[: -len('/all')]}"].append(float(value))
            return result.loss

    for cls in (EchoGRPOConfig, EchoGRPOTrainer):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    _CLASSES["EchoGRPOConfig"] = EchoGRPOConfig
    _CLASSES["EchoGRPOTrainer"] = EchoGRPOTrainer


def _as_float(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)
