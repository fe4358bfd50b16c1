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
   ``importance_sampling_level`` ([`grpo_loss_mapping`][echoloss.nn.grpo.grpo_loss_mapping]: mapped exactly or rejected with an
   error) on the model's tokens, plus ``λ · (-log p)`` on the echoed tool tokens with the
   normaliser of [`scale_echo_weights`][echoloss.nn.grpo.scale_echo_weights].

`EchoGRPOConfig` is ``GRPOConfig`` with the echo fields, so ``TrlParser`` reads them from
YAML and the command line. A ``rollout_func`` may return ``"echo_weights"`` itself (one list per
completion, aligned to ``completion_ids``, ``0.0`` = not echoed) next to TRL's ``"env_mask"``.

Importing this module does not import TRL; ``EchoGRPOTrainer`` and ``EchoGRPOConfig`` are built
on first access. ``docs/guides/trl.md`` has the option mapping and the measured equivalence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from echoloss import (
    EchoConfig,
    Normalizers,
    StepEcho,
    TokenAttribution,
    select_step_echo,
)
from echoloss._logging import warn_once
from echoloss.data.echo_config import check_echo_config
from echoloss.nn.grpo import (
    ECHO_NORMALIZATIONS,
    ECHO_TEMPERATURES,
    grpo_loss_mapping,
    row_temperature,
    scale_echo_weights,
)

__all__ = [  # noqa: F822 (the TRL classes are built on first access)
    "EchoGRPOConfig",
    "EchoGRPOTrainer",
    "completion_echo",
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
        echo: [`echoloss.EchoConfig`][echoloss.data.echo_config.EchoConfig] or its dict form; only the ``tool`` and ``assistant`` roles can apply
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

    echo = check_echo_config(
        "echo", echo, optional=False
    )  # a dict is validated, as interleave does
    ids = list(completion_ids)
    mask = list(tool_mask)
    for i, v in enumerate(mask):
        # 0/1 ints or bools only: a 2 would silently read as a model token.
        if isinstance(v, float) or not hasattr(v, "__index__") or int(v) not in (0, 1):
            raise ValueError(
                f"tool_mask[{i}] must be 0/1 (or a bool), got {type(v).__name__} {v!r}; 1 marks "
                "a model token, 0 a tool-result token (TRL's tool_mask)"
            )
        mask[i] = int(v)
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
        dummy: list[dict[str, Any]] = [
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
    """Build `EchoGRPOConfig` and `EchoGRPOTrainer` on TRL's classes (on first access)."""
    trl = _import_trl()
    config_cls = _config_class(trl.GRPOConfig)
    trainer_cls = _trainer_class(trl.GRPOTrainer, config_cls)
    for cls in (config_cls, trainer_cls):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    _CLASSES["EchoGRPOConfig"] = config_cls
    _CLASSES["EchoGRPOTrainer"] = trainer_cls


# -- EchoGRPOConfig ---------------------------------------------------------------------------


def _config_class(config_base: Any) -> type:
    @dataclass
    class EchoGRPOConfig(config_base):  # type: ignore[misc]
        """``trl.GRPOConfig`` plus the echo settings, so that ``TrlParser`` reads them from YAML
        and the command line (``--echo_tool_alpha 0.05``).

        ``bf16`` left unset on a machine without a bf16 GPU trains in fp32 (TRL's default,
        ``bf16=True``, is refused there by ``transformers``); set ``use_cpu=True, bf16=True`` for
        bf16 autocast on a CPU (the parameters stay fp32 when the model is loaded in fp32).

        Attributes:
            echo_tool_alpha: λ on tool-result bodies (None = tool results not echoed).
            echo_assistant_alpha: λ on every model token (None = off; such tokens leave RL).
            echo_tool_names: allow-list of tool names whose results are echoed (None = all).
            echo_target: ``"content"`` (bodies only) or ``"message"`` (with the template
                scaffold).
            echo_normalization: ``"token_mean"`` (echo tokens of the generation batch, like
                ``dapo``), ``"sequence_mean"`` (the ECHO paper's ``1/|O_i|``, then a mean over
                every completion, like ``grpo``) or ``"batch_token_mean"`` (each micro-batch's
                echo-token mean); see [`scale_echo_weights`][echoloss.nn.grpo.scale_echo_weights].
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
            _default_precision(self)
            super().__post_init__()
            _check_echo_fields(self)

        def echo_config(self) -> EchoConfig | None:
            """The [`echoloss.EchoConfig`][echoloss.data.echo_config.EchoConfig] of these fields (None when no role is on)."""
            return _echo_config_of(self)

    return EchoGRPOConfig


def _default_precision(args: Any) -> None:
    """An unset ``bf16`` where no GPU computes bf16: fp32, said once (TRL would default it to
    True, which ``transformers`` refuses without ``use_cpu``)."""
    if args.bf16 is not None or args.fp16 or args.use_cpu:
        return
    from transformers.utils.import_utils import (
        is_torch_bf16_gpu_available,
        is_torch_xla_available,
    )

    if is_torch_bf16_gpu_available() or is_torch_xla_available():
        return
    args.bf16 = False
    warn_once(
        "trl-cpu-fp32",
        "echoloss: no GPU computes bf16 here and bf16 is unset, so EchoGRPOConfig trains in "
        "fp32 (TRL's default bf16=True needs one); pass use_cpu=True, bf16=True for bf16 "
        "autocast on a CPU with native bf16",
    )


def _check_echo_fields(args: Any) -> None:
    """The ``echo_*`` fields' values (named in each error)."""
    if isinstance(args.echo_tool_names, str):  # a single name from YAML
        args.echo_tool_names = [args.echo_tool_names]
    for name, choices in (
        ("echo_target", ("content", "message")),
        ("echo_normalization", ECHO_NORMALIZATIONS),
        ("echo_temperature", ECHO_TEMPERATURES),
    ):
        value = getattr(args, name)
        if value not in choices:
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    for name in ("echo_tool_alpha", "echo_assistant_alpha"):
        value = getattr(args, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}={value!r}: expected a float λ ≥ 0, or None")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"{name}={value}: expected a finite λ ≥ 0 (0 = the echo ablation: "
                "attributed, weight 0), or None to switch the role off"
            )
    if args.echo_tool_names is not None and args.echo_tool_alpha is None:
        raise ValueError(
            "echo_tool_names is set but echo_tool_alpha is None: set echo_tool_alpha "
            "(the allow-list applies to the tool role)"
        )


def _echo_config_of(args: Any) -> EchoConfig | None:
    from echoloss import RoleEcho

    tool = assistant = None
    # λ = 0 (the ablation) attributes the role as if echoed; the trainer then sets the
    # weights of that role's tokens to 0 (see EchoGRPOTrainer.zero_alpha_roles).
    if args.echo_tool_alpha is not None:
        names = None if args.echo_tool_names is None else frozenset(args.echo_tool_names)
        tool = RoleEcho(alpha=args.echo_tool_alpha or 1.0, tool_names=names)
    if args.echo_assistant_alpha is not None:
        assistant = RoleEcho(alpha=args.echo_assistant_alpha or 1.0)
    if tool is None and assistant is None:
        return None
    return EchoConfig(tool=tool, assistant=assistant, target=args.echo_target)


# -- EchoGRPOTrainer --------------------------------------------------------------------------


#: Per completion, the echo weight and the observation flag of each token.
EchoLists = tuple[list[list[float]], list[list[bool]]]


def _trainer_class(trainer_base: Any, config_cls: Any) -> type:
    class EchoGRPOTrainer(trainer_base):  # type: ignore[misc]
        """``trl.GRPOTrainer`` whose loss is TRL's own objective (every ``loss_type`` mapped
        exactly, see [`grpo_loss_mapping`][echoloss.nn.grpo.grpo_loss_mapping]) plus the echo cross-entropy on tool-result bodies.

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
        Metrics are logged as ``echoloss/<name>``, and TRL's own metrics (``kl``, ``entropy``,
        ``clip_ratio/*``, ``cispo_clip_ratio``) with TRL's definitions over the RL tokens.
        A batch with image fields (``pixel_values``, ...) is refused: the loss forward is
        text-only.
        """

        _echo_pending: EchoLists | None = None

        def __init__(self, *args: Any, echo: EchoConfig | None = None, **kwargs: Any) -> None:
            if "loss_config" in kwargs:
                raise TypeError(
                    "EchoGRPOTrainer no longer takes loss_config: the loss follows the "
                    "GRPOConfig (loss_type, epsilon, beta, ...) exactly; set the echo fields of "
                    "EchoGRPOConfig for the echo term"
                )
            super().__init__(*args, **kwargs)
            self._init_echo(echo)
            _warn_low_precision_weights(self.model)

        def _init_echo(self, echo: EchoConfig | None) -> None:
            """Resolve the echo settings and the loss mapping (called by ``__init__``)."""
            _init_echo(self, echo, config_cls)

        def _generate(self, prompts: list[Any]) -> Any:
            out = super()._generate(prompts)
            _, completion_ids, tool_mask, completions, _, extra_fields, _, _ = out
            given = extra_fields.pop("echo_weights", None)
            self._echo_pending = _echo_selection(
                self, completion_ids, tool_mask, completions, given
            )
            return out

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            self._echo_pending = None
            output: dict[str, Any] = super()._generate_and_score_completions(inputs)
            if self._echo_pending is None:  # pragma: no cover - TRL changed its call graph
                raise RuntimeError("EchoGRPOTrainer: _generate was not called during generation")
            weights, observation = self._echo_pending
            self._echo_pending = None
            _add_echo_tensors(output, weights, observation, self.accelerator)
            return output

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            return self._echo_loss_from_logits(_completion_logits(self, model, inputs), inputs)

        def _echo_loss_from_logits(
            self, logits: torch.Tensor, inputs: dict[str, Any]
        ) -> torch.Tensor:
            """The loss of one micro-batch from its completion logits ``[B, T, V]``."""
            return _micro_batch_loss(self, logits, inputs)

        def _log_trl_metrics(
            self,
            mode: str,
            lp: torch.Tensor,
            old: torch.Tensor,
            adv: torch.Tensor,
            ref: torch.Tensor | None,
            ent: torch.Tensor,
            rl: torch.Tensor,
        ) -> None:
            """TRL's own metrics (``kl``, ``entropy``, ``clip_ratio/*``, ``cispo_clip_ratio``)
            with TRL's definitions, over the RL tokens (TRL's ``completion_mask · tool_mask``
            when no assistant token is echoed), so dashboards built on TRL keep working."""
            _log_trl_metrics(self, mode, lp, old, adv, ref, ent, rl)

    return EchoGRPOTrainer


def _init_echo(trainer: Any, echo: EchoConfig | None, config_cls: Any) -> None:
    """The trainer's echo settings (``echo`` or its `EchoGRPOConfig`'s fields, not both), the
    roles whose λ is 0, and TRL's loss mapping."""
    args = trainer.args
    from_args = args.echo_config() if isinstance(args, config_cls) else None
    if echo is not None and from_args is not None:
        raise ValueError(
            "echo settings given twice: pass echo=EchoConfig(...) or set the echo_* "
            "fields of EchoGRPOConfig, not both"
        )
    echo = echo if echo is not None else from_args
    if echo is not None:
        _check_trainer_echo(echo)
    else:
        warn_once(
            "trl-no-echo",
            "echoloss: EchoGRPOTrainer without echo settings trains TRL's loss only; set "
            "echo_tool_alpha (EchoGRPOConfig) or pass echo=EchoConfig(...)",
        )
    trainer.echo = echo
    #: roles whose λ is 0 in the EchoGRPOConfig (attributed, weight 0: the ablation)
    trainer.zero_alpha_roles = frozenset(
        role
        for role in ("tool", "assistant")
        if from_args is not None and getattr(args, f"echo_{role}_alpha", None) == 0
    )
    trainer.echo_normalization = getattr(args, "echo_normalization", "token_mean")
    trainer.echo_mapping = grpo_loss_mapping(
        args, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high
    )
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError(
            "router_aux_loss_coef != 0 on a model with router logits: EchoGRPOTrainer "
            "does not add the MoE load-balancing loss; set router_aux_loss_coef=0"
        )
    trainer._echo_pending = None


def _warn_low_precision_weights(model: Any) -> None:
    """Trainable bf16/fp16 parameters are the optimiser's master weights: an update smaller than
    half their spacing (lr 1e-5 against a weight of 0.01 in bf16) rounds away. Said once."""
    low = sorted(
        {str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype.itemsize < 4}
    )
    if low:
        warn_once(
            "trl-low-precision-weights",
            f"echoloss: the model's trainable parameters are {', '.join(low)}, so they are the "
            "optimiser's master weights and most small updates round away (lr 1e-5 moves a bf16 "
            "weight of 0.01 by less than half its spacing); load the model in fp32 and set "
            "bf16=True for bf16 autocast",
        )


def _check_trainer_echo(echo: Any) -> None:
    """Only the tool and assistant roles: system and user messages are TRL's prompt."""
    if not isinstance(echo, EchoConfig):
        raise TypeError(f"echo must be an echoloss.EchoConfig, got {type(echo).__name__}")
    unused = sorted(set(echo.role_settings()) - {"tool", "assistant"})
    if unused or echo.filter is not None or not echo.skip_initial_prompt:
        raise ValueError(
            "EchoGRPOTrainer echoes tool results (and optionally assistant tokens): "
            f"the system and user messages are the prompt, never echoed; remove "
            f"{unused or ''}{' filter' if echo.filter is not None else ''}"
            f"{' skip_initial_prompt=False' if not echo.skip_initial_prompt else ''} "
            "from the EchoConfig"
        )


# -- the echo weights of a generation batch ----------------------------------------------------


def _echo_selection(
    trainer: Any,
    completion_ids: Sequence[Sequence[int]],
    tool_mask: Sequence[Sequence[int]] | None,
    completions: Sequence[Any],
    given: Sequence[Sequence[float]] | None,
) -> EchoLists:
    """Per completion, the echo weight and the observation flag of every token: from a
    ``rollout_func``'s ``echo_weights`` (``given``), or attributed from TRL's tool messages."""
    if given is not None:
        return _given_echo_weights(completion_ids, given)
    if trainer.echo is None:
        return (
            [[0.0] * len(ids) for ids in completion_ids],
            [[False] * len(ids) for ids in completion_ids],
        )
    weights: list[list[float]] = []
    observation: list[list[bool]] = []
    for i, ids in enumerate(completion_ids):
        mask = tool_mask[i] if tool_mask is not None else [1] * len(ids)
        if trainer.rollout_func is not None:
            w, o = _rollout_func_echo(trainer, ids, mask)
        else:
            messages = completions[i] if isinstance(completions[i], list) else []
            sel = completion_echo(
                ids,
                mask,
                messages,
                trainer.processing_class,
                echo=trainer.echo,
                chat_template=trainer.chat_template,
                chat_template_kwargs=trainer.chat_template_kwargs,
            )
            w, o = [0.0 if x is None else x for x in sel.weights], sel.observation
        weights.append(w)
        observation.append(o)
    if trainer.zero_alpha_roles:
        for i, ids in enumerate(completion_ids):
            mask = tool_mask[i] if tool_mask is not None else [1] * len(ids)
            for k, m in enumerate(mask):
                if ("assistant" if m else "tool") in trainer.zero_alpha_roles:
                    weights[i][k] = 0.0
    return weights, observation


def _given_echo_weights(
    completion_ids: Sequence[Sequence[int]], given: Sequence[Sequence[float]]
) -> EchoLists:
    """A ``rollout_func``'s ``echo_weights``, one per completion token (``> 0`` = echoed)."""
    weights: list[list[float]] = []
    observation: list[list[bool]] = []
    for i, ids in enumerate(completion_ids):
        w = [float(x) for x in given[i]]
        if len(w) != len(ids):
            raise ValueError(
                f"rollout_func echo_weights[{i}] has length {len(w)}, expected "
                f"{len(ids)} (one per completion token)"
            )
        weights.append(w)
        observation.append([x > 0 for x in w])
    return weights, observation


def _rollout_func_echo(
    trainer: Any, ids: Sequence[int], mask: Sequence[int]
) -> tuple[list[float], list[bool]]:
    """A custom rollout without ``echo_weights``: TRL knows no tool messages to attribute its
    env tokens, so only the model's own tokens can be echoed (the assistant role)."""
    if any(not m for m in mask):
        warn_once(
            "trl-rollout-func-no-echo-weights",
            "echoloss: a rollout_func returned env tokens (env_mask) but no "
            "echo_weights; they are not echoed. Return 'echo_weights' (e.g. from "
            "echoloss.adapters.chat) to echo them",
        )
    sel = completion_echo(
        list(ids), [1] * len(ids), [], trainer.processing_class, echo=trainer.echo
    )
    weights = [0.0 if x is None or not m else x for x, m in zip(sel.weights, mask, strict=True)]
    observation = [o and bool(m) for o, m in zip(sel.observation, mask, strict=True)]
    return weights, observation


def _add_echo_tensors(
    output: dict[str, Any],
    weights: list[list[float]],
    observation: list[list[bool]],
    accelerator: Any,
) -> None:
    """``output["echo_weights"]`` and ``["observation_mask"]`` ``[B, T]`` (TRL's padding), and
    ``["num_echo_items_in_batch"]``: the generation batch's echo tokens on every process."""
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
    output["num_echo_items_in_batch"] = accelerator.gather((w > 0).sum()).sum()


# -- the loss of a micro-batch ---------------------------------------------------------------


def _completion_logits(trainer: Any, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """``[B, T, V]`` logits of the completion tokens (row ``j`` predicts token ``j``)."""
    given = sorted(k for k in _VISION_FIELDS if inputs.get(k) is not None)
    if given:
        raise ValueError(
            f"inputs {given}: EchoGRPOTrainer's loss forward takes text only, so these "
            "image fields would be dropped and the loss computed without the images; "
            "use trl.GRPOTrainer for vision-language models, or a text-only dataset"
        )
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    t = completion_ids.shape[1]
    with trainer.accelerator.autocast():
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            logits_to_keep=t + 1,
            use_cache=False,
        )
    logits: torch.Tensor = out.logits[:, :-1, :]  # row j predicts completion token j
    return logits


def _micro_batch_loss(trainer: Any, logits: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    """The loss of one micro-batch from its completion logits ``[B, T, V]``: TRL's objective on
    the RL tokens plus the echo term, divided as TRL divides it; logs the metrics."""
    from echoloss import echo_loss_from_logprobs, selective_logprobs
    from echoloss.loss.diagnosis import check_scored_rows

    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    b, t = completion_ids.shape
    valid = completion_mask.bool()
    echo_w = inputs["echo_weights"] * valid
    echo = echo_w > 0
    rl = valid & ~echo
    tool = inputs.get("tool_mask")
    if tool is not None:
        rl = rl & tool.bool()
    cfg, norms, scaled_echo = _divisors(trainer, inputs, rl, echo_w, valid)
    temp = row_temperature(rl, echo, trainer.temperature, cfg.echo_temperature)
    lp, ent = selective_logprobs(
        logits, completion_ids, temperature=temp, return_entropy=True, mask=rl | echo
    )
    adv = inputs["advantages"]
    adv = (adv.unsqueeze(1) if adv.dim() == 1 else adv).expand(b, t).float()
    old = inputs.get("old_per_token_logps")
    if old is None:
        # On-policy: TRL's denominator is the current logprobs, detached (same pass
        # here), so a non-finite one comes from the logits, and is named so.
        check_scored_rows(lp.reshape(-1), rl.reshape(-1), echo.reshape(-1), "logits")
        old = lp.detach()
    else:
        old = old.float()
    inference = None
    if cfg.mismatch is not None:
        sampling = inputs["sampling_per_token_logps"].float()
        # TRL gives a token whose sampling logprob is NaN an importance ratio of 1.
        inference = torch.where(torch.isnan(sampling), old, sampling)
    ref = inputs.get("ref_per_token_logps") if cfg.kl_coef > 0 else None
    record = _trl_record(
        rl_mask=rl,
        echo_weights=scaled_echo,
        advantages=adv,
        inference_logprobs=inference,
        old_logprobs=old,
        ref_logprobs=None if ref is None else ref.float(),
        sequence_ids=torch.arange(b, device=lp.device).unsqueeze(1).expand(b, t),
        observation_mask=inputs["observation_mask"] & valid,
    )
    result = echo_loss_from_logprobs(
        lp, record, entropy=ent.detach(), config=cfg, normalizers=norms
    )
    mode = "train" if trainer.model.training else "eval"
    for key, value in result.metrics.items():
        if key.endswith("/all"):
            trainer._metrics[mode][f"echoloss/{key[: -len('/all')]}"].append(float(value))
    trainer._log_trl_metrics(mode, lp.detach(), old, adv, ref, ent.detach(), rl)
    return result.loss


def _divisors(
    trainer: Any,
    inputs: dict[str, Any],
    rl: torch.Tensor,
    echo_w: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[Any, Normalizers, torch.Tensor]:
    """The micro-batch's `LossConfig`, its RL normaliser and its echo weights scaled by the
    echo normaliser, each as TRL accumulates (gradient accumulation, generation batches)."""
    mapping = trainer.echo_mapping
    training = trainer.model.training
    ga = trainer.current_gradient_accumulation_steps if training else 1
    spg = trainer.args.steps_per_generation if training else 1
    nproc = trainer.accelerator.num_processes
    cfg, norms = mapping.micro_batch(
        batch_size=rl.shape[0],
        max_completion_length=trainer.max_completion_length,
        num_items_in_batch=_as_float(inputs.get("num_items_in_batch")),
        num_processes=nproc,
        accumulation_steps=ga,
        steps_per_generation=spg,
        local_items=int(rl.sum()) if mapping.loss_type in ("dapo", "cispo") else None,
    )
    if mapping.loss_type == "bnpo":  # TRL: this micro-batch's loss tokens
        norms = Normalizers(rl_tokens=max(int(rl.sum()), 1) * ga)
    scaled_echo = scale_echo_weights(
        echo_w.float(),
        inputs["observation_mask"] & valid,
        normalization=trainer.echo_normalization,
        num_echo_items_in_batch=_as_float(inputs.get("num_echo_items_in_batch")),
        num_processes=nproc,
        accumulation_steps=ga,
        steps_per_generation=spg,
    )
    return cfg, norms, scaled_echo


def _log_trl_metrics(
    trainer: Any,
    mode: str,
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    ref: torch.Tensor | None,
    ent: torch.Tensor,
    rl: torch.Tensor,
) -> None:
    """TRL's ``kl``, ``entropy``, ``clip_ratio/*`` and ``cispo_clip_ratio`` over the RL tokens
    ``rl`` ``[B, T]``, as TRL defines them."""
    mask = rl.float()  # [B, T]
    log_ratio = torch.where(rl, lp - old, torch.zeros_like(lp))  # [B, T]
    if trainer.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_ratio = log_ratio.unsqueeze(-1)  # [B, 1]
    coef_1 = torch.exp(log_ratio)
    if trainer.loss_type != "cispo" and trainer.args.delta is not None:
        coef_1 = torch.clamp(coef_1, max=trainer.args.delta)
    a = adv[:, :1]  # [B, 1] TRL's per-sequence advantage

    def global_masked_mean(x: torch.Tensor) -> float:
        if x.shape[1] == 1:
            local_sum = x.sum()
            local_count = torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = trainer.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return float(totals[0] / totals[1].clamp(min=1.0))

    def masked_seq_mean(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    metrics = trainer._metrics[mode]
    if ref is not None:
        d = ref.float() - lp
        metrics["kl"].append(global_masked_mean(torch.exp(d) - d - 1))
    metrics["entropy"].append(global_masked_mean(ent))
    if trainer.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = ((coef_1 < 1 - trainer.epsilon_low) & (a < 0)).float()
        high = ((coef_1 > 1 + trainer.epsilon_high) & (a > 0)).float()
        metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
        metrics["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
        gathered_low = trainer.accelerator.gather(masked_seq_mean(low))
        metrics["clip_ratio/low_min"].append(float(_trl_nanmin(gathered_low)))
        gathered_high = trainer.accelerator.gather(masked_seq_mean(high))
        metrics["clip_ratio/high_max"].append(float(_trl_nanmax(gathered_high)))
    elif trainer.loss_type == "cispo":
        clipped = ((coef_1 > trainer.epsilon_high) & (a > 0)).float()
        metrics["cispo_clip_ratio"].append(global_masked_mean(clipped))


#: The image fields TRL's ``GRPOTrainer`` feeds to the loss forward of a vision-language model.
_VISION_FIELDS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)

#: The record's field names and TRL's names of the same tensors (for error messages).
_TRL_NAMES = (
    ("old_logprobs", "inputs['old_per_token_logps']"),
    ("ref_logprobs", "inputs['ref_per_token_logps']"),
    ("inference_logprobs", "inputs['sampling_per_token_logps']"),
    ("advantages", "inputs['advantages']"),
    ("echo_weights", "the echo weights (rollout_func 'echo_weights' or echo_tool_alpha)"),
)


def _trl_record(**fields: Any) -> Any:
    """``LossInputs(**fields)`` with errors naming TRL's input instead of the record's field."""
    from echoloss import LossInputs

    try:
        return LossInputs(**fields)
    except (TypeError, ValueError) as err:
        message = str(err)
        for ours, theirs in _TRL_NAMES:
            if message.startswith(ours):
                message = theirs + message[len(ours) :]
        raise type(err)(message) from None


def _trl_nanmin(t: torch.Tensor) -> torch.Tensor:
    from trl.trainer.utils import nanmin

    return nanmin(t)


def _trl_nanmax(t: torch.Tensor) -> torch.Tensor:
    from trl.trainer.utils import nanmax

    return nanmax(t)


def _as_float(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)
