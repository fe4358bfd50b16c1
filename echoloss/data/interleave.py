"""Trajectory steps and training samples, and the multi-turn merge between them (``interleave``).

A multi-turn rollout is a list of [`Step`][echoloss.data.interleave.Step] (prompt + sampled completion per model call). When a
step's prompt extends an earlier step's prompt + completion, the two are one sequence and become one
[`Sample`][echoloss.data.interleave.Sample] whose "completion" region interleaves model tokens with the environment's tokens:
``[c1, obs1, c2, obs2, c3]``. Every per-token stream extends in lockstep.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from echoloss._logging import warn_once
from echoloss._validate import bool_list, check_len, describe, finite_float_list, problem
from echoloss.data._checks import (
    exact_bool,
    float32_weight,
    logprob_list,
    positive_float32,
    token_id_list,
)
from echoloss.data.attribution import TokenAttribution
from echoloss.data.echo_config import EchoConfig, check_echo_config
from echoloss.data.echo_weights import select_step_echo, validate_keep_mask
from echoloss.data.streams import TokenStream

__all__ = ["STREAMS", "Sample", "Step", "interleave"]

# Logprob written for environment tokens interleaved into a sample's completion region. They are
# never in the RL mask, so the value is never read by a loss; 0.0 matches what orchestrators send.
ENV_TOKEN_LOGPROB = 0.0


def _token_ids(owner: str, name: str, values: Any) -> list[int]:
    return token_id_list(f"{owner}.{name}", values)


def _logprobs(owner: str, name: str, values: Any) -> list[float]:
    return logprob_list(f"{owner}.{name}", values)


def _bool_list(owner: str, name: str, values: Any) -> list[bool]:
    return bool_list(f"{owner}.{name}", values)


def _float_list(owner: str, name: str, values: Any) -> list[float]:
    return finite_float_list(f"{owner}.{name}", values)


def _check_len(owner: str, name: str, values: Sequence[Any], expected: int, what: str) -> None:
    check_len(f"{owner}.{name}", values, expected, what)


@dataclass(kw_only=True)
class Step:
    """One model call of a trajectory: the prompt it saw and the completion it sampled.

    Args:
        prompt_ids: ``[P]`` prompt token ids.
        completion_ids: ``[C]`` sampled token ids.
        completion_logprobs: ``[C]`` sampling (inference) logprobs of the completion.
        completion_mask: ``[C]`` bool, True where the token is trained with RL (default all True).
        attribution: [`TokenAttribution`][echoloss.data.attribution.TokenAttribution] of the prompt (or its dict form), or ``None``.
        temperature: the sampling temperature of this call (> 0).
        metadata: free-form data for user echo filters (e.g. the raw messages).

    Examples:
        >>> Step(prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-0.5]).completion_mask
        [True]
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    completion_mask: list[bool] | None = None
    attribution: TokenAttribution | Mapping[str, Any] | None = None
    temperature: float = 1.0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_ids = _token_ids("Step", "prompt_ids", self.prompt_ids)
        self.completion_ids = _token_ids("Step", "completion_ids", self.completion_ids)
        c = len(self.completion_ids)
        if not self.prompt_ids and not c:
            raise ValueError(
                "Step.prompt_ids and Step.completion_ids are both empty; a model call has a "
                "prompt or a completion"
            )
        self.completion_logprobs = _logprobs(
            "Step", "completion_logprobs", self.completion_logprobs
        )
        _check_len(
            "Step", "completion_logprobs", self.completion_logprobs, c, "one per completion token"
        )
        if self.completion_mask is None:
            self.completion_mask = [True] * c
        self.completion_mask = _bool_list("Step", "completion_mask", self.completion_mask)
        _check_len("Step", "completion_mask", self.completion_mask, c, "one per completion token")
        self.temperature = positive_float32(
            "Step.temperature", self.temperature, "pass the sampling temperature, e.g. 0.7"
        )
        if not isinstance(self.metadata, dict):
            raise TypeError(problem("Step.metadata", "a dict", describe(self.metadata)))

    @property
    def token_ids(self) -> list[int]:
        """``prompt_ids + completion_ids``."""
        return self.prompt_ids + self.completion_ids


@dataclass(kw_only=True)
class Sample:
    """One training sequence: a prompt and a completion region, with per-token streams.

    The completion region of a merged multi-turn sample interleaves model tokens (RL) with
    environment tokens (never RL, possibly echoed). Each per-token list below is declared once in
    [`STREAMS`][echoloss.data.interleave.STREAMS], which every step of the data path loops over. Token ``t`` of ``prompt_ids + completion_ids``
    is the target predicted from tokens ``< t``, so **position 0 is never trained** (no RL, no echo).

    Args:
        prompt_ids: ``[P]`` token ids.
        completion_ids: ``[C]`` token ids.
        completion_mask: ``[C]`` bool, True = trained with RL. Disjoint from echo.
        completion_logprobs: ``[C]`` inference logprobs (``0.0`` placeholders on env tokens).
        completion_temperatures: ``[C]`` sampling temperature per completion token; ``None`` = 1.0.
        echo_weights: ``None`` (no echo at all) or ``[P + C]`` of ``float > 0`` (echoed with that
            weight) or ``None`` (not echoed).
        observation_mask: ``None`` or ``[P + C]`` bool, the tokens counted in the paper's per-sequence
            normaliser ``Z = |O|`` (observation body including warnings). Superset of the echoed tokens.
        advantage: the rollout's advantage, stamped after advantages are computed.
        env_name: environment name for per-env metrics (``"all"`` is reserved).

    Examples:
        >>> s = Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_mask=[True, True],
        ...            completion_logprobs=[-0.1, -0.2], echo_weights=[None, 0.5, None, None])
        >>> len(s), s.num_rl_tokens, s.num_echo_tokens
        (4, 2, 1)
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[bool]
    completion_logprobs: list[float]
    completion_temperatures: list[float] | None = None
    echo_weights: list[float | None] | None = None
    observation_mask: list[bool] | None = None
    advantage: float | None = None
    env_name: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def token_ids(self) -> list[int]:
        """``prompt_ids + completion_ids``."""
        return self.prompt_ids + self.completion_ids

    @property
    def num_rl_tokens(self) -> int:
        """Completion tokens trained with RL (echoed tokens and position 0 excluded)."""
        return sum(self.rl_mask())

    @property
    def num_echo_tokens(self) -> int:
        """Tokens trained with echo cross-entropy (position 0 excluded)."""
        return sum(1 for w in self.token_echo_weights() if w > 0)

    def rl_mask(self) -> list[bool]:
        """``[P + C]`` bool: trained with RL. Echo wins over RL; position 0 is never trained."""
        echo = self.echo_weights
        p = len(self.prompt_ids)
        out = [False] * p + list(self.completion_mask)
        if echo is not None:
            out = [m and echo[k] is None for k, m in enumerate(out)]
        if out:
            out[0] = False
        return out

    def token_echo_weights(self) -> list[float]:
        """``[P + C]`` float echo weight, ``0.0`` = not echoed; position 0 is always 0."""
        n = len(self)
        if self.echo_weights is None:
            return [0.0] * n
        out = [0.0 if w is None else w for w in self.echo_weights]
        if out:
            out[0] = 0.0
        return out

    def token_observation_mask(self) -> list[bool]:
        """``[P + C]`` bool ``Z = |O|`` membership; position 0 is always False."""
        if self.observation_mask is None:
            out = [w > 0 for w in self.token_echo_weights()]
        else:
            out = list(self.observation_mask)
        if out:
            out[0] = False
        return out

    def validate(self, *, where: str = "Sample") -> None:
        """Check every stream's type and length; raises with the field, both lengths and a fix."""
        self.prompt_ids = _token_ids(where, "prompt_ids", self.prompt_ids)
        self.completion_ids = _token_ids(where, "completion_ids", self.completion_ids)
        p, c = len(self.prompt_ids), len(self.completion_ids)
        n = p + c
        if n == 0:
            raise ValueError(
                f"{where}.prompt_ids and {where}.completion_ids are both empty; a sample needs at "
                "least one token"
            )
        for stream in STREAMS:
            setattr(self, stream.name, stream.validate(self, where))
            if stream.may_be_none and stream.carries_nothing(getattr(self, stream.name) or []):
                setattr(self, stream.name, None)  # an all-None list says nothing: no stream
        if self.observation_mask is not None and self.echo_weights is not None:
            for i, (w, o) in enumerate(zip(self.echo_weights, self.observation_mask, strict=True)):
                if w is not None and not o:
                    raise ValueError(
                        f"{where}.observation_mask[{i}] is False but echo_weights[{i}] = {w}; "
                        "every echoed token is an observation token (counted in Z = |O|)"
                    )
        if self.advantage is not None:
            if (
                isinstance(self.advantage, bool)
                or not isinstance(self.advantage, (int, float))
                or not math.isfinite(self.advantage)
            ):
                raise ValueError(
                    f"{where}.advantage must be a finite float or None, got {self.advantage!r}"
                )
            self.advantage = float(self.advantage)
        if not isinstance(self.env_name, str):
            raise TypeError(f"{where}.env_name must be a str, got {type(self.env_name).__name__}")
        if self.env_name == "all":
            raise ValueError(
                f"{where}.env_name 'all' is reserved for metrics over every environment; rename the env"
            )


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _resolve_keep_masks(
    steps: list[Step],
    echo: EchoConfig | None,
    keep: Sequence[Sequence[bool]] | None,
    echo_filter: Callable[[list[Step]], Any] | None,
    allow_import_paths: bool,
) -> list[list[bool] | None]:
    """Run the filter once and AND it with an explicit ``keep``; validate both."""
    masks: list[list[bool] | None] = [None] * len(steps)
    sources: list[tuple[str, Any]] = []
    if echo_filter is not None:
        label = getattr(echo_filter, "__name__", "echo_filter")
        sources.append((f"echo filter {label!r}", echo_filter(steps)))
    elif echo is not None and echo.filter is not None:
        fn = echo.filter.resolve(allow_import_paths=allow_import_paths)
        sources.append((f"echo filter {echo.filter.import_path!r}", fn(steps)))
    if keep is not None:
        sources.append(("keep", keep))
    for label, out in sources:
        if not isinstance(out, list):
            raise TypeError(
                f"{label} must return list[list[bool]] (one per step), got {type(out).__name__}"
            )
        if len(out) != len(steps):
            raise ValueError(
                f"{label} returned {len(out)} masks for {len(steps)} steps; return one per step"
            )
        for i, (step, m) in enumerate(zip(steps, out, strict=True)):
            m = validate_keep_mask(
                m,
                prompt_len=len(step.prompt_ids),
                completion_len=len(step.completion_ids),
                step_index=i,
            )
            prev = masks[i]
            masks[i] = list(m) if prev is None else [a and b for a, b in zip(prev, m, strict=True)]
    return masks


def interleave(
    steps: Sequence[Step],
    *,
    echo: EchoConfig | Mapping[str, Any] | None = None,
    errored: bool = False,
    keep: Sequence[Sequence[bool]] | None = None,
    env_name: str = "",
    echo_filter: Callable[[list[Step]], Any] | None = None,
    allow_import_paths: bool = False,
) -> list[Sample]:
    """Merge a trajectory's steps into training samples, with echo weights.

    A step *extends* an active sample when its prompt begins with that sample's last
    ``prompt + completion``; the longest such prefix wins (with rollback or compaction one prefix
    can be a strict prefix of another, and first-match would absorb another sample's tokens).
    Otherwise the step starts a new sample. On extension the new prompt tail joins the completion
    region with RL mask False and placeholder logprobs, then the new completion follows; echo
    weights, observation mask and temperatures extend in lockstep.

    Args:
        steps: the trajectory's steps in order.
        echo: the [`EchoConfig`][echoloss.data.echo_config.EchoConfig] (or its dict form), or ``None`` for no echo.
        errored: the rollout errored; it trains nothing, so no samples are returned.
        keep: optional explicit filter masks, one ``list[bool]`` of length ``P + C`` per step,
            AND-ed with ``echo.filter``'s output. Both can only narrow echo.
        env_name: stamped on every sample (``"all"`` is reserved).
        echo_filter: a filter callable ``fn(steps) -> list[list[bool]]``, used instead of
            ``echo.filter`` (e.g. ``echo.filter.resolve()`` resolved once per run). It needs an
            ``echo`` config: a filter can only narrow what the roles select.
        allow_import_paths: let ``echo.filter`` name an import path (it runs that module's
            code); by default only registered filter names resolve (docs/spec.md §4.9).

    Returns:
        The samples, in the order their first step appears. Tokens selected for echo are out of
        the RL mask; position 0 of each sample is neither RL nor echo; unless
        ``echo.reecho_restarted_prompts``, a new sample does not echo tokens an earlier sample of
        the trajectory already covered.

    Raises:
        TypeError: ``steps`` is not a list of [`Step`][echoloss.data.interleave.Step] (a single ``Step`` included), or an
            argument has the wrong type (``errored="no"``, a non-callable ``echo_filter``).
        ValueError: ``echo_filter`` without ``echo``, an import-path filter without
            ``allow_import_paths=True``, or filter/keep masks of the wrong count or length.

    Examples:
        >>> from echoloss import EchoConfig, RoleEcho
        >>> s0 = Step(prompt_ids=[10, 11], completion_ids=[20, 21], completion_logprobs=[-1.0, -1.0],
        ...           attribution={"message_indices": [0, 0], "is_content": [False, True],
        ...                        "message_roles": ["user"]})
        >>> s1 = Step(prompt_ids=[10, 11, 20, 21, 30, 31], completion_ids=[22],
        ...           completion_logprobs=[-0.5],
        ...           attribution={"message_indices": [-1, -1, -1, -1, 0, 0],
        ...                        "is_content": [False, False, False, False, False, True],
        ...                        "message_roles": ["tool"], "message_tool_names": ["lookup"]})
        >>> [sample] = interleave([s0, s1], echo=EchoConfig(tool=RoleEcho(alpha=0.5)))
        >>> sample.completion_ids, sample.completion_mask
        ([20, 21, 30, 31, 22], [True, True, False, False, True])
        >>> sample.echo_weights
        [None, None, None, None, None, 0.5, None]
    """
    if isinstance(steps, Step):
        raise TypeError(
            problem(
                "interleave: steps",
                "a list of echoloss.Step (one trajectory)",
                "a single Step",
                "wrap it: interleave([step])",
            )
        )
    if isinstance(steps, (str, bytes, Mapping)) or not isinstance(steps, Iterable):
        raise TypeError(problem("interleave: steps", "a list of echoloss.Step", describe(steps)))
    steps = list(steps)
    for i, s in enumerate(steps):
        if not isinstance(s, Step):
            raise TypeError(
                f"interleave: steps[{i}] must be an echoloss.Step, got {type(s).__name__}"
            )
    echo_cfg = check_echo_config("interleave: echo", echo, optional=True)
    exact_bool("interleave: errored", errored, "True marks a rollout that failed")
    exact_bool("interleave: allow_import_paths", allow_import_paths)
    if not isinstance(env_name, str):
        raise TypeError(problem("interleave: env_name", "a str", describe(env_name)))
    if keep is not None and echo_cfg is None:
        raise ValueError(
            "interleave: keep is set but echo is None; keep masks only narrow what the echo roles "
            "select, so with no echo config they would never apply. Pass echo=EchoConfig(...), or "
            "drop keep"
        )
    if echo_filter is not None:
        if not callable(echo_filter):
            raise TypeError(
                problem("interleave: echo_filter", "a callable or None", describe(echo_filter))
            )
        if echo_cfg is None:
            raise ValueError(
                "interleave: echo_filter is set but echo is None; a filter only narrows what the "
                "echo roles select, so with no echo config it would never apply. Pass "
                "echo=EchoConfig(...), or drop echo_filter"
            )
    if not steps:
        warn_once(
            "empty-trajectory", "echoloss: interleave got an empty trajectory; it yields no samples"
        )
        return []
    if errored:
        return []
    keep_masks = _resolve_keep_masks(steps, echo_cfg, keep, echo_filter, allow_import_paths)

    samples: list[Sample] = []
    # One entry per sample: the prompt + completion of the last step merged into it.
    prefixes: list[list[int]] = []
    seen_sequences: list[list[int]] = []
    first_prompt = steps[0].prompt_ids

    for i, step in enumerate(steps):
        tokens = step.token_ids
        p, c = len(step.prompt_ids), len(step.completion_ids)
        matches = [
            (len(prefix), j)
            for j, prefix in enumerate(prefixes)
            if len(prefix) <= p and step.prompt_ids[: len(prefix)] == prefix
        ]
        if len(matches) > 1:
            warn_once(
                "multiple-prefix-matches",
                f"echoloss: step {i} extends {len(matches)} samples (prefix lengths "
                f"{sorted(m[0] for m in matches)}); the longest prefix wins",
            )
        selection = None
        if echo_cfg is not None:
            initial = (
                None
                if i == 0
                else min(_common_prefix_len(step.prompt_ids, first_prompt), len(first_prompt))
            )
            seen = (
                0
                if matches
                else max(
                    (_common_prefix_len(step.prompt_ids, t) for t in seen_sequences), default=0
                )
            )
            selection = select_step_echo(
                step.attribution,
                echo_cfg,
                prompt_len=p,
                completion_len=c,
                keep=keep_masks[i],
                initial_prompt_len=initial,
                seen_prefix_len=seen,
                step_index=i,
                starts_sample=not matches,
            )
        rl = [
            m and (selection is None or selection.weights[p + k] is None)
            for k, m in enumerate(step.completion_mask or [])
        ]

        if matches:
            prefix_len, j = max(matches)
            _extend(samples[j], step, rl, selection, prefix_len)
            prefixes[j] = tokens
        else:
            samples.append(_new_sample(step, rl, selection, env_name))
            prefixes.append(tokens)
        seen_sequences.append(tokens)
    for sample in samples:
        sample.validate(where="interleave sample")
    return samples


def _new_sample(step: Step, rl: list[bool], selection: Any, env_name: str) -> Sample:
    """A sample of one model call: every stream's step values (completion part for completion
    streams), position 0 cleared where nothing is trained, all-absent optional streams None."""
    p = len(step.prompt_ids)
    values: dict[str, Any] = {}
    for stream in STREAMS:
        view = stream.step_view(step, selection, rl)
        if view is None:
            missing = [stream.missing] * stream.length(p, len(step.completion_ids))
            values[stream.name] = None if stream.optional else missing
            continue
        body = view[p:] if stream.scope == "completion" else view
        if stream.untrained_at_zero and body and (stream.scope == "sequence" or p == 0):
            body[0] = stream.missing  # position 0 has no valid prediction
        values[stream.name] = (
            None if stream.empty_is_none and stream.carries_nothing(body) else body
        )
    return Sample(
        prompt_ids=list(step.prompt_ids),
        completion_ids=list(step.completion_ids),
        env_name=env_name,
        **values,
    )


def _extend(sample: Sample, step: Step, rl: list[bool], selection: Any, prefix_len: int) -> None:
    """Append the step's tokens past ``prefix_len`` (the new prompt tail, then its completion) to
    ``sample``: every stream extends in lockstep; an optional stream the sample does not carry
    yet starts (absent on the earlier tokens) once the step gives it something."""
    new = len(step.prompt_ids) + len(step.completion_ids) - prefix_len
    before = {"sequence": len(sample), "completion": len(sample.completion_ids)}
    for stream in STREAMS:
        view = stream.step_view(step, selection, rl)
        tail = [stream.missing] * new if view is None else view[prefix_len:]
        current = getattr(sample, stream.name)
        if current is None and (
            view is None or (stream.empty_is_none and stream.carries_nothing(tail))
        ):
            continue
        head = [stream.missing] * before[stream.scope] if current is None else current
        setattr(sample, stream.name, head + tail)
    sample.completion_ids = (
        sample.completion_ids + step.prompt_ids[prefix_len:] + step.completion_ids
    )


def _completion_mask(step: Step, selection: Any, rl: list[bool]) -> list[bool]:
    return [False] * len(step.prompt_ids) + rl  # the prompt (and a merged tail) is never RL


def _completion_logprobs(step: Step, selection: Any, rl: list[bool]) -> list[float]:
    # Environment tokens merged into a completion get the placeholder logprob (never read).
    return [ENV_TOKEN_LOGPROB] * len(step.prompt_ids) + step.completion_logprobs


def _temperatures(step: Step, selection: Any, rl: list[bool]) -> list[float]:
    return [step.temperature] * (len(step.prompt_ids) + len(step.completion_ids))


def _echo_weights(step: Step, selection: Any, rl: list[bool]) -> list[float | None] | None:
    return None if selection is None else list(selection.weights)


def _observation(step: Step, selection: Any, rl: list[bool]) -> list[bool] | None:
    return None if selection is None else list(selection.observation)


def _temperature_list(name: str, values: Any) -> list[float]:
    temps = finite_float_list(name, values)
    for i, t in enumerate(temps):
        positive_float32(f"{name}[{i}]", t)
    return temps


def _echo_weight_list(name: str, values: Any) -> list[float | None]:
    if not isinstance(values, (list, tuple)):
        raise TypeError(problem(name, "None or a list of float | None", describe(values)))
    return [None if w is None else float32_weight(f"{name}[{i}]", w) for i, w in enumerate(values)]


def _prompt_temperature(sample: Sample) -> float:
    # The prompt's temperature is the sample's first sampling temperature (docs/spec.md §8.4).
    return sample.completion_temperatures[0] if sample.completion_temperatures else 1.0


#: Every per-token stream of a `Sample`, declared once: validation, the merge above,
#: ``truncate_sample``, ``pack``, ``unpack`` and ``next_token_targets`` loop over this table.
#: A new stream is a `Sample` field plus a row here (CONTRIBUTING.md, "Add a per-token stream").
STREAMS: tuple[TokenStream, ...] = (
    TokenStream(
        name="completion_mask",
        packed="rl_mask",
        kind="bool",
        scope="completion",
        fill=False,
        examples=(False, True),
        check=bool_list,
        from_step=_completion_mask,
        untrained_at_zero=True,
        pack_values=lambda s: s.rl_mask(),  # echo wins over RL; position 0 cleared
    ),
    TokenStream(
        name="completion_logprobs",
        packed="inference_logprobs",
        kind="float",
        scope="completion",
        fill=ENV_TOKEN_LOGPROB,
        examples=(-0.25, -1.5, -3.0),
        check=logprob_list,
        from_step=_completion_logprobs,
    ),
    TokenStream(
        name="completion_temperatures",
        packed="temperatures",
        kind="float",
        scope="completion",
        fill=1.0,
        optional=True,
        examples=(0.5, 1.0),
        check=_temperature_list,
        from_step=_temperatures,
        prompt_value=_prompt_temperature,
    ),
    TokenStream(
        name="echo_weights",
        packed="echo_weights",
        kind="float",
        scope="sequence",
        fill=0.0,
        optional=True,
        may_be_none=True,
        empty_is_none=True,
        examples=(None, 0.0625, 0.125, 0.5, 1.0, 2.0),
        check=_echo_weight_list,
        from_step=_echo_weights,
        untrained_at_zero=True,
    ),
    TokenStream(
        name="observation_mask",
        packed="observation_mask",
        kind="bool",
        scope="sequence",
        fill=False,
        optional=True,
        empty_is_none=True,
        examples=(False, True),
        check=bool_list,
        from_step=_observation,
        untrained_at_zero=True,
        pack_values=lambda s: s.token_observation_mask(),  # defaults to the echoed tokens
    ),
)
