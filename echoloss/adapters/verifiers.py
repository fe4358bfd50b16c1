"""verifiers rollouts → echo-ready [`echoloss.Sample`][echoloss.data.interleave.Sample] s.

Two formats:

* **v1 traces** (verifiers 0.4): a message graph. Each ``MessageNode`` holds the tokens its
  message *adds* to the sequence (its leading template scaffold and its own tokens; for a sampled
  assistant node, the generation prompt then the sampled completion), a per-token ``mask`` (True
  on sampled tokens), ``is_content`` (True on message body tokens, empty when the renderer does not
  attribute content), and ``logprobs`` of the sampled tokens. A branch is a root-to-leaf path and
  becomes one sample. [`samples_from_trace`][echoloss.adapters.verifiers.samples_from_trace] accepts the ``Trace`` object or its JSON record
  (``trace.to_record()``, or the dict read back from disk); it needs no ``verifiers`` import.
* **rollout dicts** (the earlier format): ``{"trajectory": [{"tokens": {"prompt_ids": ...,
  "completion_ids": ..., "completion_mask": ..., "completion_logprobs": ...,
  "prompt_attribution": {...}}}, ...], "error": ...}``, where ``prompt_attribution`` is the
  renderer's attribution as a plain dict. [`samples_from_rollout`][echoloss.adapters.verifiers.samples_from_rollout] turns it into samples.

Echo selection follows the rest of echoloss (``docs/data-path.md``): only nodes after the first
sampled token are eligible (the initial task prompt is not echoed), only body tokens with
``target="content"``, and a node shared by several trainable branches is echoed in the first of
them only (it is the same prediction).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from echoloss._logging import warn_once
from echoloss.data.attribution import TokenAttribution
from echoloss.data.echo_config import EchoConfig
from echoloss.data.interleave import Sample, Step, interleave

__all__ = ["TRACE_VERSION", "samples_from_rollout", "samples_from_trace"]

TRACE_VERSION = 1
"""The verifiers trace schema version this adapter reads."""


class _In(BaseModel):
    # Read either the verifiers objects (attributes) or their JSON record (dicts); ignore the
    # many fields echo does not need.
    model_config = ConfigDict(extra="ignore", from_attributes=True)


class _Function(_In):
    name: str | None = None


class _ToolCall(_In):
    id: str | None = None
    name: str | None = None
    function: _Function | None = None

    def fn_name(self) -> str | None:
        if self.name is not None:
            return self.name
        return None if self.function is None else self.function.name


class _Message(_In):
    role: str
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Link(_In):
    node: StrictInt
    type: str


class _Node(_In):
    parent: StrictInt | None = None
    message: _Message
    sampled: StrictBool = False
    token_ids: list[StrictInt] = Field(default_factory=list)
    mask: list[StrictBool] = Field(default_factory=list)
    is_content: list[StrictBool] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    semantic_parents: list[_Link] = Field(default_factory=list)


class _Sampling(_In):
    temperature: float | None = None


class _Call(_In):
    node: StrictInt | None = None
    sampling: _Sampling | None = None


class _AgentConfig(_In):
    sampling: _Sampling | None = None


class _Agent(_In):
    trainable: StrictBool = True
    config: _AgentConfig | None = None


class _Trace(_In):
    model_config = ConfigDict(extra="ignore", from_attributes=True, title="verifiers trace")

    version: StrictInt = TRACE_VERSION
    nodes: list[_Node] = Field(default_factory=list)
    calls: list[_Call] = Field(default_factory=list)
    agent: _Agent | None = None
    ok: StrictBool | None = None


def _parse_trace(trace: Any) -> _Trace:
    if hasattr(trace, "model_dump") and not isinstance(trace, Mapping):
        # A verifiers Trace: read its fields as attributes (no copy of the token lists).
        t = _Trace.model_validate(trace)
    elif isinstance(trace, Mapping):
        t = _Trace.model_validate(dict(trace))
    else:
        raise TypeError(
            "samples_from_trace expects a verifiers Trace or its JSON record (a dict), got "
            f"{type(trace).__name__}"
        )
    if t.version != TRACE_VERSION:
        raise ValueError(
            f"trace.version = {t.version}, but this adapter reads verifiers trace version "
            f"{TRACE_VERSION}; upgrade echoloss or convert the trace"
        )
    for i, node in enumerate(t.nodes):
        where = f"trace.nodes[{i}]"
        if node.parent is not None and not 0 <= node.parent < i:
            raise ValueError(
                f"{where}.parent = {node.parent}; a parent must be an earlier node (0..{i - 1}) or "
                "None for a root"
            )
        n = len(node.token_ids)
        if len(node.mask) != n:
            raise ValueError(
                f"{where}.mask has length {len(node.mask)}, expected {n} (one per token_ids)"
            )
        if node.is_content and len(node.is_content) != n:
            raise ValueError(
                f"{where}.is_content has length {len(node.is_content)}, expected {n} (one per "
                "token_ids) or 0 (renderer without content attribution)"
            )
        sampled = sum(node.mask)
        if len(node.logprobs) != sampled:
            raise ValueError(
                f"{where}.logprobs has {len(node.logprobs)} values, expected {sampled} (one per "
                "sampled token, i.e. per True in mask)"
            )
        for j, lp in enumerate(node.logprobs):
            if not math.isfinite(lp):
                raise ValueError(f"{where}.logprobs[{j}] = {lp} is not finite")
    return t


def _branches(t: _Trace) -> list[tuple[list[int], bool]]:
    """Root-to-leaf node paths in leaf order, each with its trainable flag.

    A leaf marked as a ``compaction_attempt`` is trainable only if some node names it as the
    parent of a ``compaction`` link (the harness resumed from it), as in verifiers.
    """
    parents = {n.parent for n in t.nodes if n.parent is not None}
    accepted = {
        link.node for n in t.nodes for link in n.semantic_parents if link.type == "compaction"
    }
    out = []
    for leaf in (i for i in range(len(t.nodes)) if i not in parents):
        path: list[int] = []
        nid: int | None = leaf
        while nid is not None:
            path.append(nid)
            nid = t.nodes[nid].parent
        path.reverse()
        attempt = any(link.type == "compaction_attempt" for link in t.nodes[leaf].semantic_parents)
        out.append((path, not attempt or leaf in accepted))
    return out


def _tool_names(t: _Trace, path: list[int]) -> list[str | None]:
    names: list[str | None] = []
    issued: dict[str, str] = {}
    for nid in path:
        m = t.nodes[nid].message
        for tc in m.tool_calls or []:
            name = tc.fn_name()
            if tc.id and name:
                issued[tc.id] = name
        if m.role != "tool":
            names.append(None)
        elif m.name is not None:
            names.append(m.name)
        elif m.tool_call_id is None:
            names.append(None)
        elif m.tool_call_id in issued:
            names.append(issued[m.tool_call_id])
        else:
            raise ValueError(
                f"trace.nodes[{nid}] (role 'tool') has tool_call_id {m.tool_call_id!r}, which "
                "matches no tool call of an earlier assistant node on its branch (known ids: "
                f"{sorted(issued)}); the trace is inconsistent"
            )
    return names


def _temperatures(t: _Trace, temperature: float | None) -> tuple[dict[int, float], float | None]:
    per_node = {}
    for c in t.calls:
        if c.node is not None and c.sampling is not None and c.sampling.temperature is not None:
            per_node[c.node] = c.sampling.temperature
    default = temperature
    if default is None and t.agent is not None and t.agent.config is not None:
        s = t.agent.config.sampling
        default = None if s is None else s.temperature
    return per_node, default


def samples_from_trace(
    trace: Any,
    *,
    echo: EchoConfig | None,
    env_name: str = "",
    temperature: float | None = None,
    errored: bool | None = None,
) -> list[Sample]:
    """One sample per trainable branch of a verifiers v1 trace, with echo weights.

    A branch's tokens are the concatenation of its nodes' ``token_ids``. Each maximal run of
    sampled tokens (``mask`` True) is one model call: the tokens before it are its prompt, the
    run its completion. The calls are merged with [`echoloss.interleave`][echoloss.data.interleave] (they always extend
    each other along a branch), so a sample's prompt is everything before the branch's first
    sampled token and its completion region interleaves sampled turns (RL) with observations.
    Prompt attribution comes from the nodes: each node is one message (its role, its tool name
    from ``name`` or the ``tool_call_id`` of an earlier call on the branch), ``is_content``
    marks its body, and the generation-prompt tokens of a sampled node are scaffold of no message.

    Args:
        trace: a ``verifiers.v1.Trace`` or its JSON record (``trace.to_record()`` or
            ``json.loads`` of a saved trace).
        echo: the [`echoloss.EchoConfig`][echoloss.data.echo_config.EchoConfig], or None for RL only.
        env_name: stamped on every sample.
        temperature: sampling temperature of every call. None: each call's recorded
            ``calls[i].sampling.temperature``, else the agent config's, else 1.0.
        errored: the rollout errored, so it trains nothing. None: ``not trace.ok`` (verifiers
            sets ``ok`` when a rollout finishes without error); a record without ``ok`` then is
            an error rather than a silently dropped rollout.

    Returns:
        ``list[Sample]`` in branch (leaf) order; empty for an errored trace or an agent marked
        ``trainable=False``. Branches that verifiers marks non-trainable (abandoned compaction
        attempts) and branches without a sampled token give no sample (logged once). A node on
        several trainable branches is echoed (and counted in ``observation_mask``) in the first
        only; its sampled tokens are RL in every branch, as verifiers trains them.

    Raises:
        pydantic.ValidationError: a field has the wrong type (the error names its path).
        ValueError: inconsistent lengths (mask, is_content, logprobs vs token_ids), a parent
            that is not an earlier node, a ``tool_call_id`` that matches nothing, an
            unsupported trace version, or no ``ok`` field while ``errored`` is None.

    Examples:
        >>> from echoloss import EchoConfig, RoleEcho
        >>> record = {"version": 1, "ok": True, "nodes": [
        ...     {"message": {"role": "user", "content": "ls"}, "token_ids": [1, 2],
        ...      "mask": [False, False], "is_content": [False, True]},
        ...     {"parent": 0, "sampled": True, "token_ids": [3, 4, 5], "mask": [False, True, True],
        ...      "is_content": [False, True, True], "logprobs": [-0.5, -0.1],
        ...      "message": {"role": "assistant", "content": "",
        ...                  "tool_calls": [{"id": "c1", "name": "ls", "arguments": "{}"}]}},
        ...     {"parent": 1, "token_ids": [6, 7, 8], "mask": [False, False, False],
        ...      "is_content": [False, True, True],
        ...      "message": {"role": "tool", "tool_call_id": "c1", "content": "a b"}},
        ...     {"parent": 2, "sampled": True, "token_ids": [9, 10], "mask": [False, True],
        ...      "is_content": [False, True], "logprobs": [-0.2],
        ...      "message": {"role": "assistant", "content": "ok"}}]}
        >>> [s] = samples_from_trace(record, echo=EchoConfig(tool=RoleEcho(alpha=0.1)))
        >>> s.prompt_ids, s.completion_ids
        ([1, 2, 3], [4, 5, 6, 7, 8, 9, 10])
        >>> s.completion_mask
        [True, True, False, False, False, False, True]
        >>> s.echo_weights
        [None, None, None, None, None, None, 0.1, 0.1, None, None]
    """
    t = _parse_trace(trace)
    if errored is None:
        if t.ok is None:
            raise ValueError(
                "the verifiers trace has no 'ok' field, so whether the rollout errored is "
                "unknown; pass errored=False (or errored=True) to samples_from_trace"
            )
        errored = not t.ok
    elif not isinstance(errored, bool):
        raise TypeError(f"errored must be a bool or None, got {type(errored).__name__} {errored!r}")
    if errored:
        return []
    if t.agent is not None and not t.agent.trainable:
        return []
    per_node_temp, default_temp = _temperatures(t, temperature)
    covered: set[int] = set()
    samples: list[Sample] = []
    for path, trainable in _branches(t):
        if not trainable:
            warn_once(
                "verifiers-untrainable-branch",
                "echoloss: a verifiers trace has a non-trainable branch (an abandoned compaction "
                "attempt); it gives no sample",
            )
            continue
        sample = _branch_sample(
            t,
            path,
            echo=echo,
            env_name=env_name,
            temperature=temperature,
            per_node_temp=per_node_temp,
            default_temp=default_temp,
            covered=covered,
        )
        if sample is not None:
            samples.append(sample)
            covered.update(path)
    return samples


def _branch_sample(
    t: _Trace,
    path: list[int],
    *,
    echo: EchoConfig | None,
    env_name: str,
    temperature: float | None,
    per_node_temp: dict[int, float],
    default_temp: float | None,
    covered: set[int],
) -> Sample | None:
    names = _tool_names(t, path)
    tokens: list[int] = []
    mask: list[bool] = []
    owner: list[int] = []  # node id of each token
    indices: list[int] = []
    content: list[bool] = []
    logprobs: list[float] = []  # one per sampled token, in order
    missing_content = has_content = False
    for j, nid in enumerate(path):
        node = t.nodes[nid]
        n = len(node.token_ids)
        tokens += node.token_ids
        mask += node.mask
        owner += [nid] * n
        logprobs += node.logprobs
        # The unsampled head of a sampled node is the generation prompt: scaffold of no message.
        indices += [-1 if node.sampled and not m else j for m in node.mask]
        if node.is_content or n == 0:
            content += node.is_content
            has_content = has_content or n > 0
        else:
            content += [False] * n
            missing_content = True
    if not any(mask):
        warn_once(
            "verifiers-branch-without-samples",
            "echoloss: a verifiers trace branch has no sampled token (no model call committed "
            "tokens); it gives no sample",
        )
        return None
    if missing_content and has_content:
        warn_once(
            "verifiers-partial-is-content",
            "echoloss: some verifiers trace nodes have no is_content (the renderer did not "
            "attribute their body); their tokens are treated as scaffold and never echoed with "
            "target='content'",
        )
    if not has_content:
        content = []  # no content signal at all: echo's own rule applies (and warns)
    roles = [t.nodes[nid].message.role for nid in path]

    steps: list[Step] = []
    pos = 0  # index into `logprobs`
    k = 0
    while k < len(tokens):
        if not mask[k]:
            k += 1
            continue
        end = k
        while end < len(tokens) and mask[end] and owner[end] == owner[k]:
            end += 1
        temp = temperature
        if temp is None:
            temp = per_node_temp.get(owner[k], default_temp)
        steps.append(
            _step(
                tokens, k, end, logprobs[pos : pos + end - k], indices, content, roles, names, temp
            )
        )
        pos += end - k
        k = end
    last_end = len(steps[-1].prompt_ids) + len(steps[-1].completion_ids)
    if last_end < len(tokens):  # observations after the last call: echo-only step
        temp = steps[-1].temperature
        steps.append(
            _step(tokens, len(tokens), len(tokens), [], indices, content, roles, names, temp)
        )
    merged = interleave(steps, echo=echo, env_name=env_name)
    if len(merged) != 1 or merged[0].token_ids != tokens:  # pragma: no cover - internal invariant
        raise AssertionError("a verifiers branch did not merge into one sample")
    sample = merged[0]
    if covered and (sample.echo_weights is not None or sample.observation_mask is not None):
        for i, nid in enumerate(owner):
            if nid in covered:
                if sample.echo_weights is not None:
                    sample.echo_weights[i] = None
                if sample.observation_mask is not None:
                    sample.observation_mask[i] = False
        sample.validate(where="verifiers branch sample")
    return sample


def _step(
    tokens: list[int],
    start: int,
    end: int,
    logprobs: list[float],
    indices: list[int],
    content: list[bool],
    roles: list[str],
    names: list[str | None],
    temperature: float | None,
) -> Step:
    if temperature is None:
        warn_once(
            "verifiers-no-temperature",
            "echoloss: a verifiers trace records no sampling temperature (calls[i].sampling, "
            "agent.config.sampling); using 1.0. Pass temperature= to samples_from_trace",
        )
        temperature = 1.0
    return Step(
        prompt_ids=tokens[:start],
        completion_ids=tokens[start:end],
        completion_logprobs=logprobs,
        attribution=TokenAttribution(
            message_indices=indices[:start],
            is_content=content[:start],
            message_roles=roles,
            message_tool_names=names,
        ),
        temperature=temperature,
    )


# -- the earlier rollout dict ------------------------------------------------------------------


class _StepTokens(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt_ids: list[StrictInt]
    completion_ids: list[StrictInt]
    completion_mask: list[StrictBool | StrictInt] | None = None
    completion_logprobs: list[float]
    prompt_attribution: dict[str, Any] | None = None


class _TrajectoryStep(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tokens: _StepTokens | None = None


class _Rollout(BaseModel):
    model_config = ConfigDict(extra="ignore", title="verifiers rollout")

    trajectory: list[_TrajectoryStep]
    error: Any = None
    env_name: str | None = None
    sampling_args: dict[str, Any] | None = None


def samples_from_rollout(
    rollout: Mapping[str, Any],
    *,
    echo: EchoConfig | None,
    env_name: str | None = None,
    temperature: float | None = None,
) -> list[Sample]:
    """Samples from a rollout dict whose trajectory steps carry tokens and prompt attribution.

    Each ``trajectory[i].tokens`` becomes one [`echoloss.Step`][echoloss.data.interleave.Step] (``completion_mask`` may be
    0/1 ints; ``prompt_attribution`` is the renderer's attribution dict, full or bridged, passed
    through as is) and the steps are merged with [`echoloss.interleave`][echoloss.data.interleave].

    Args:
        rollout: ``{"trajectory": [...], "error": ..., "env_name": ..., "sampling_args": ...}``.
        echo: the [`echoloss.EchoConfig`][echoloss.data.echo_config.EchoConfig], or None.
        env_name: stamped on the samples; None = ``rollout["env_name"]`` or ``""``.
        temperature: None = ``rollout["sampling_args"]["temperature"]`` or 1.0.

    Returns:
        ``list[Sample]``; empty when ``rollout["error"]`` marks an error (an error dict, a
        message or True; None, False and ``""`` mean no error).

    Raises:
        pydantic.ValidationError: a field has the wrong type (the error names its path).
        ValueError: a step was never tokenized (``tokens`` is None), a mask value other than
            0/1, or inconsistent lengths; the error names the step.

    Examples:
        >>> from echoloss import EchoConfig, RoleEcho
        >>> rollout = {"error": None, "trajectory": [
        ...     {"tokens": {"prompt_ids": [1, 2], "completion_ids": [3], "completion_mask": [1],
        ...                 "completion_logprobs": [-0.3]}},
        ...     {"tokens": {"prompt_ids": [1, 2, 3, 4, 5], "completion_ids": [6],
        ...                 "completion_mask": [1], "completion_logprobs": [-0.2],
        ...                 "prompt_attribution": {"message_indices": [-1, -1, -1, 0, 0],
        ...                     "is_content": [False, False, False, False, True],
        ...                     "message_roles": ["tool"], "message_tool_names": [None]}}}]}
        >>> [s] = samples_from_rollout(rollout, echo=EchoConfig(tool=RoleEcho(alpha=0.5)))
        >>> s.completion_ids, s.echo_weights
        ([3, 4, 5, 6], [None, None, None, None, 0.5, None])
    """
    if not isinstance(rollout, Mapping):
        raise TypeError(f"samples_from_rollout expects a dict, got {type(rollout).__name__}")
    r = _Rollout.model_validate(dict(rollout))
    errored = _rollout_errored(r.error)
    if temperature is None:
        temperature = (r.sampling_args or {}).get("temperature")
        if temperature is None:
            temperature = 1.0
    steps: list[Step] = []
    for i, ts in enumerate(r.trajectory):
        where = f"rollout.trajectory[{i}].tokens"
        if ts.tokens is None:
            raise ValueError(
                f"{where} is None: the step was never tokenized (a backfilled step); tokenize it "
                "with its renderer first, or drop the rollout"
            )
        tk = ts.tokens
        mask = None
        if tk.completion_mask is not None:
            mask = []
            for j, v in enumerate(tk.completion_mask):
                if v not in (0, 1):
                    raise ValueError(f"{where}.completion_mask[{j}] = {v!r}; expected 0/1 or bool")
                mask.append(bool(v))
        try:
            steps.append(
                Step(
                    prompt_ids=tk.prompt_ids,
                    completion_ids=tk.completion_ids,
                    completion_logprobs=tk.completion_logprobs,
                    completion_mask=mask,
                    attribution=tk.prompt_attribution,
                    temperature=temperature,
                )
            )
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from e
    name = env_name if env_name is not None else (r.env_name or "")
    return interleave(steps, echo=echo, errored=errored, env_name=name)


def _rollout_errored(error: Any) -> bool:
    """``rollout["error"]``: None, False, ``""`` or ``{}`` mean no error; an error dict, a message or
    True mean the rollout errored. Anything else is ambiguous and an error."""
    if error is None or error is False or error == "" or (isinstance(error, Mapping) and not error):
        return False
    if error is True or isinstance(error, (str, Mapping)):
        return True
    raise TypeError(
        f"rollout['error'] must be None/False/'' (no error) or an error dict, message or True, "
        f"got {type(error).__name__} {error!r}"
    )
