"""TRL ``GRPOTrainer`` with the echo term on tool observations (extra ``trl``).

TRL's GRPO tool loop (``GRPOTrainer(tools=[...])``) appends each batch of tool results to the
completion as the chat template renders them, and marks those tokens ``tool_mask = 0`` so that RL
skips them. :class:`EchoGRPOTrainer` trains them with the echo cross-entropy instead:

1. After generation it rebuilds, for every completion, the tool messages TRL appended and
   attributes their tokens with :mod:`echoloss.adapters.chat`, rendering them exactly as TRL
   does (``_get_tool_suffix_ids``); the rendered ids must equal the completion's tokens. Only the
   tool result *bodies* are echoed (``EchoConfig(target="content")``), never the
   ``<tool_response>`` wrappers or the next generation prompt.
2. Its loss is :func:`echoloss.echo_loss` on the completion rows: RL (PPO-clip by default) on the
   model's tokens, ``α · (-log p)`` on the echoed tool tokens, each with its own normaliser.

A ``rollout_func`` may return ``"echo_weights"`` itself (one list per completion, aligned to
``completion_ids``, ``0.0`` = not echoed) next to TRL's ``"env_mask"``.

Importing this module does not import TRL; ``EchoGRPOTrainer`` is built on first access.
``docs/adapters.md`` has a complete example.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from echoloss._logging import warn_once
from echoloss.data.attribution import TokenAttribution
from echoloss.data.echo_config import EchoConfig
from echoloss.data.echo_weights import StepEcho, select_step_echo

if TYPE_CHECKING:  # pragma: no cover
    from echoloss.loss import LossConfig

__all__ = ["EchoGRPOTrainer", "completion_echo", "loss_config_from_grpo_args"]  # noqa: F822


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
    :func:`echoloss.adapters.chat.render_attributed` (bodies located exactly, prefix stability
    not required), checks that the ids equal the run's tokens, and selects echo on it with
    :func:`echoloss.select_step_echo` (tool role, tool-name allow-list, ``target``,
    ``max_tokens_per_message``). With the assistant role enabled, every model token
    (``tool_mask == 1``) gets the assistant weight.

    Args:
        completion_ids: ``[C]`` the completion's token ids (model and tool tokens).
        tool_mask: ``[C]`` 1 on model tokens, 0 on tool-result tokens (TRL's ``tool_mask``).
        completion_messages: the completion as messages (TRL's ``completions[i]``: assistant
            turns and the tool messages, each with ``name`` and ``content``).
        tokenizer: the tokenizer TRL renders with.
        echo: :class:`echoloss.EchoConfig`; only the ``tool`` and ``assistant`` roles can apply
            (the system and user messages are in the prompt, never echoed).
        chat_template: the template TRL renders with (``trainer.chat_template``), None = the
            tokenizer's.
        chat_template_kwargs: TRL's ``chat_template_kwargs``.

    Returns:
        :class:`echoloss.StepEcho` over the ``C`` completion tokens.

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


def loss_config_from_grpo_args(args: Any) -> LossConfig:
    """The default :class:`echoloss.LossConfig` for a ``GRPOConfig``: PPO-clip with its
    ``epsilon`` / ``epsilon_high``, its ``beta`` as a k3 reference KL, no ``kl_tau``; RL tokens
    averaged per sequence for ``loss_type="grpo"``, over all RL tokens otherwise; echo tokens
    averaged over the micro-batch's echo tokens."""
    from echoloss.loss import LossConfig

    eps = float(args.epsilon)
    eps_high = float(args.epsilon_high) if args.epsilon_high is not None else eps
    return LossConfig(
        policy="ppo_clip",
        eps_low=eps,
        eps_high=eps_high,
        kl_tau=0.0,
        kl_coef=float(args.beta),
        kl_estimator="k3",
        rl_normalization="sequence_mean_token_mean" if args.loss_type == "grpo" else "token_mean",
        echo_normalization="token_mean",
    )


_TRAINER_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    if name == "EchoGRPOTrainer":
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _trainer_class() -> type:
    global _TRAINER_CLASS
    if _TRAINER_CLASS is not None:
        return _TRAINER_CLASS
    try:
        import torch
        from trl import GRPOTrainer
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "echoloss.adapters.trl.EchoGRPOTrainer needs TRL: pip install 'echoloss[trl]'"
        ) from e
    from echoloss.loss import echo_loss
    from echoloss.ops import selective_logprobs

    class EchoGRPOTrainer(GRPOTrainer):  # type: ignore[misc, valid-type]
        """``trl.GRPOTrainer`` whose loss is :func:`echoloss.echo_loss`: RL on the model's tokens
        plus the echo cross-entropy on tool-result bodies.

        Args:
            *args, **kwargs: as ``trl.GRPOTrainer`` (pass ``tools=[...]`` to run TRL's tool loop).
            echo: :class:`echoloss.EchoConfig`; the ``tool`` role (and optionally ``assistant``)
                applies. ``EchoConfig(tool=RoleEcho(alpha=0.05))`` is ECHO's λ = 0.05.
            loss_config: :class:`echoloss.LossConfig`; None = :func:`loss_config_from_grpo_args`.
                TRL's ``loss_type``, ``delta``, ``top_entropy_quantile``, entropy bonus and vLLM
                importance-sampling correction are not used: the loss config decides.

        The loss of a micro-batch is divided by the gradient-accumulation steps, as TRL does for
        its per-micro-batch losses. Metrics are logged as ``echoloss/<name>``.
        """

        def __init__(
            self,
            *args: Any,
            echo: EchoConfig,
            loss_config: LossConfig | None = None,
            **kwargs: Any,
        ) -> None:
            if not isinstance(echo, EchoConfig):
                raise TypeError(f"echo must be an echoloss.EchoConfig, got {type(echo).__name__}")
            unused = sorted(set(echo.role_settings()) - {"tool", "assistant"})
            if unused or echo.filter is not None or not echo.skip_initial_prompt:
                raise ValueError(
                    "EchoGRPOTrainer echoes tool results (and optionally assistant tokens): the "
                    f"system and user messages are the prompt, never echoed; remove {unused or ''}"
                    f"{' filter' if echo.filter is not None else ''}"
                    f"{' skip_initial_prompt=False' if not echo.skip_initial_prompt else ''} "
                    "from the EchoConfig"
                )
            super().__init__(*args, **kwargs)
            self.echo = echo
            self.echo_loss_config = loss_config or loss_config_from_grpo_args(self.args)
            self._echo_pending: tuple[list[list[float]], list[list[bool]]] | None = None

        def _generate(self, prompts: list) -> Any:
            out = super()._generate(prompts)
            _, completion_ids, tool_mask, completions, _, extra_fields, _, _ = out
            given = extra_fields.pop("echo_weights", None)
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
            output["echo_weights"] = w
            output["observation_mask"] = o
            return output

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            b, t = completion_ids.shape
            with self.accelerator.autocast():
                out = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    logits_to_keep=t + 1,
                    use_cache=False,
                )
            logits = out.logits[:, :-1, :]  # row j predicts completion token j
            valid = completion_mask.bool()
            tool = inputs.get("tool_mask")
            echo_w = inputs["echo_weights"] * valid
            rl = valid & (echo_w == 0)
            if tool is not None:
                rl = rl & tool.bool()
            adv = inputs["advantages"]
            adv = (adv.unsqueeze(1) if adv.dim() == 1 else adv).expand(b, t).float()
            old = inputs.get("old_per_token_logps")
            if old is None:  # on-policy step: the ratio's denominator is the current policy
                with torch.no_grad():
                    old = selective_logprobs(
                        logits.detach(), completion_ids, temperature=self.temperature
                    )
            sampling = inputs.get("sampling_per_token_logps")
            inference = old if sampling is None else torch.nan_to_num(sampling, nan=0.0)
            cfg = self.echo_loss_config
            result = echo_loss(
                logits,
                completion_ids,
                rl_mask=rl,
                echo_weights=echo_w,
                advantages=adv,
                inference_logprobs=inference.float(),
                old_logprobs=old.float(),
                ref_logprobs=inputs.get("ref_per_token_logps") if cfg.kl_coef > 0 else None,
                temperature=self.temperature,
                config=cfg,
                sequence_ids=torch.arange(b, device=logits.device).unsqueeze(1).expand(b, t),
                observation_mask=inputs["observation_mask"] & valid,
            )
            mode = "train" if self.model.training else "eval"
            loss = result.loss
            if mode == "train":
                loss = loss / self.current_gradient_accumulation_steps
            for key, value in result.metrics.items():
                if key.endswith("/all"):
                    self._metrics[mode][f"echoloss/{key[: -len('/all')]}"].append(float(value))
            return loss

    EchoGRPOTrainer.__module__ = __name__
    _TRAINER_CLASS = EchoGRPOTrainer
    return EchoGRPOTrainer
