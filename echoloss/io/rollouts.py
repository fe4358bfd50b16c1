"""echoloss's rollout JSONL: the neutral interchange format between an orchestrator and a trainer.

One JSON object per line, one rollout per object (``docs/adapters.md`` has the full schema)::

    {"schema_version": 1, "group_id": "q17", "env_name": "terminal", "reward": 1.0,
     "temperature": 0.8,
     "steps": [{"prompt_ids": [...], "completion_ids": [...], "completion_logprobs": [...],
                "attribution": {"message_indices": [...], "is_content": [...],
                                "message_roles": [...], "message_tool_names": [...]}}]}

A rollout carries either token ``steps`` (one per model call, with the prompt's attribution) or
chat ``messages`` (tokenized later with a tokenizer's chat template, see
[`echoloss.adapters.chat.steps_from_messages`][echoloss.adapters.chat.steps_from_messages]), or both (then the steps are the tokens and the
messages are kept for filters). The file is untrusted input: every record is validated, and
[`read_rollouts`][echoloss.io.rollouts.read_rollouts] reports the line number and field of *every* bad record before raising.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from echoloss.data._checks import FLOAT32_MAX, FLOAT32_TINY, LOGPROB_SLACK, MAX_TOKEN_ID
from echoloss.data.attribution import TokenAttribution
from echoloss.data.echo_config import EchoConfig
from echoloss.data.interleave import Sample, Step, interleave

__all__ = [
    "ROLLOUT_SCHEMA_VERSION",
    "AttributionRecord",
    "RecordError",
    "RolloutFileError",
    "RolloutRecord",
    "StepRecord",
    "dump_rollout",
    "iter_rollouts",
    "read_rollouts",
    "write_rollouts",
]

ROLLOUT_SCHEMA_VERSION = 1
"""The rollout JSONL schema version this echoloss reads and writes."""

_MAX_ERRORS_SHOWN = 20


def _finite(v: float) -> float:
    if not math.isfinite(v):
        raise ValueError(f"{v} is not finite")
    return v


def _positive(v: float) -> float:
    if not (math.isfinite(v) and FLOAT32_TINY <= v <= FLOAT32_MAX):
        raise ValueError(
            f"must be a finite number > 0 (in [1.18e-38, 3.4e38], a normal float32), got {v}"
        )
    return v


def _logprob(v: float) -> float:
    if not math.isfinite(v) or v < -FLOAT32_MAX:
        raise ValueError(f"a log-probability must be finite (>= -3.4e38), got {v}")
    if v > LOGPROB_SLACK:
        raise ValueError(
            f"a log-probability is <= 0, got {v}; write log p (sampling log-probabilities), not "
            "-log p"
        )
    return v


Finite = Annotated[float, AfterValidator(_finite)]
Positive = Annotated[float, AfterValidator(_positive)]
LogProb = Annotated[float, AfterValidator(_logprob)]
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]


class AttributionRecord(BaseModel):
    """The prompt attribution of one step ([`echoloss.TokenAttribution`][echoloss.data.attribution.TokenAttribution] as JSON)."""

    model_config = ConfigDict(extra="forbid")

    message_indices: list[StrictInt]
    is_content: list[StrictBool]
    message_roles: list[StrictStr]
    message_tool_names: list[StrictStr | None] | None = None
    is_warning: list[StrictBool] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> AttributionRecord:
        self.to_attribution()  # lengths, index ranges, warning placement
        return self

    def to_attribution(self) -> TokenAttribution:
        return TokenAttribution(
            message_indices=self.message_indices,
            is_content=self.is_content,
            message_roles=self.message_roles,
            message_tool_names=self.message_tool_names,
            is_warning=self.is_warning,
        )


class StepRecord(BaseModel):
    """One model call: the prompt it saw and the completion it sampled (token form)."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[TokenId]
    completion_ids: list[TokenId]
    completion_logprobs: list[LogProb]
    completion_mask: list[StrictBool] | None = None
    attribution: AttributionRecord | None = None
    temperature: Positive | None = Field(
        default=None, description="This call's temperature; None = the rollout's."
    )

    @model_validator(mode="after")
    def _lengths(self) -> StepRecord:
        c = len(self.completion_ids)
        if not self.prompt_ids and not c:
            raise ValueError("prompt_ids and completion_ids are both empty; a step has tokens")
        if len(self.completion_logprobs) != c:
            raise ValueError(
                f"completion_logprobs has length {len(self.completion_logprobs)}, expected {c} "
                "(one per completion_ids)"
            )
        if self.completion_mask is not None and len(self.completion_mask) != c:
            raise ValueError(
                f"completion_mask has length {len(self.completion_mask)}, expected {c} (one per "
                "completion_ids)"
            )
        if self.attribution is not None and len(self.attribution.message_indices) != len(
            self.prompt_ids
        ):
            raise ValueError(
                f"attribution covers {len(self.attribution.message_indices)} tokens but "
                f"prompt_ids has {len(self.prompt_ids)}; attribution describes the prompt tokens"
            )
        return self


class MessageRecord(BaseModel):
    """A chat message (OpenAI / Hugging Face format; extra keys such as ``tool_calls``,
    ``tool_call_id``, ``name``, ``reasoning_content`` are kept). An assistant message may carry
    ``completion_logprobs``: the sampling logprobs of its completion tokens."""

    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    completion_logprobs: list[LogProb] | None = None


class RolloutRecord(BaseModel):
    """One rollout of the JSONL file.

    Attributes:
        schema_version: ``1``.
        group_id: the rollout's group for group-relative advantages (required; a unique id
            makes a singleton group).
        reward: the rollout's scalar reward (finite).
        env_name: environment name (``"all"`` is reserved).
        temperature: sampling temperature (> 0) of every call without its own.
        id: optional rollout id.
        error: an error message if the rollout errored (it then trains nothing), else None. An
            empty message is rejected: it would read as "errored" and drop the rollout.
        steps: token form: one [`StepRecord`][echoloss.io.rollouts.StepRecord] per model call.
        messages: chat form: the conversation; ``tools`` are its tool schemas.
        metrics: named finite floats for logging.
        metadata: anything else (kept, not read).
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1]
    group_id: StrictStr = Field(min_length=1)
    reward: Finite
    env_name: StrictStr = ""
    temperature: Positive = 1.0
    id: StrictStr | None = None
    error: StrictStr | None = Field(default=None, min_length=1)
    steps: list[StepRecord] | None = None
    messages: list[MessageRecord] | None = None
    tools: list[dict[str, Any]] | None = None
    metrics: dict[str, Finite] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("metadata", "tools")
    @classmethod
    def _json_numbers(cls, v: Any) -> Any:
        # JSON has no NaN/Infinity: written, they would become null (a changed value).
        bad = _non_finite_path(v)
        if bad is not None:
            raise ValueError(
                f"{bad or 'the value'} is a non-finite number (JSON has no NaN or Infinity); "
                "write null, a string, or drop the entry"
            )
        return v

    @model_validator(mode="after")
    def _form(self) -> RolloutRecord:
        if not self.steps and not self.messages:
            raise ValueError(
                "a rollout needs 'steps' (token form) or 'messages' (chat form); both are empty"
            )
        if self.env_name == "all":
            raise ValueError("env_name 'all' is reserved for metrics over every environment")
        return self

    def to_steps(
        self,
        tokenizer: Any = None,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        extra_roles: Sequence[str] = (),
    ) -> list[Step]:
        """The rollout's [`echoloss.Step`][echoloss.data.interleave.Step] s: its token ``steps``, or else its ``messages``
        tokenized with ``tokenizer``'s chat template (which must then be given)."""
        if self.steps:
            return [
                Step(
                    prompt_ids=s.prompt_ids,
                    completion_ids=s.completion_ids,
                    completion_logprobs=s.completion_logprobs,
                    completion_mask=s.completion_mask,
                    attribution=None if s.attribution is None else s.attribution.to_attribution(),
                    temperature=s.temperature if s.temperature is not None else self.temperature,
                )
                for s in self.steps
            ]
        if tokenizer is None:
            raise ValueError(
                "this rollout has only 'messages'; pass a tokenizer to tokenize them with its "
                "chat template"
            )
        from echoloss.adapters.chat import steps_from_messages

        assert self.messages is not None
        messages: list[dict[str, Any]] = []
        logprobs: list[list[float] | None] = []
        for m in self.messages:
            d = m.model_dump(exclude={"completion_logprobs"}, exclude_none=True)
            messages.append(d)
            if m.role == "assistant":
                logprobs.append(m.completion_logprobs)
        given = [lp for lp in logprobs if lp is not None]
        if given and len(given) != len(logprobs):
            raise ValueError(
                "some assistant messages carry completion_logprobs and some do not; give them "
                "on every assistant message or on none"
            )
        return steps_from_messages(
            messages,
            tokenizer,
            tools=self.tools,
            logprobs=given or None,
            temperature=self.temperature,
            chat_template_kwargs=chat_template_kwargs,
            extra_roles=extra_roles,
        )

    def to_samples(
        self,
        *,
        echo: EchoConfig | None,
        tokenizer: Any = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        extra_roles: Sequence[str] = (),
    ) -> list[Sample]:
        """[`to_steps`][echoloss.io.rollouts.RolloutRecord.to_steps] merged with [`echoloss.interleave`][echoloss.data.interleave] (empty if ``error`` is set).

        Examples:
            >>> from echoloss import EchoConfig, RoleEcho
            >>> r = RolloutRecord.model_validate({
            ...     "schema_version": 1, "group_id": "g0", "reward": 1.0, "steps": [
            ...         {"prompt_ids": [1, 2], "completion_ids": [3], "completion_logprobs": [-0.5],
            ...          "attribution": {"message_indices": [0, 0], "is_content": [False, True],
            ...                          "message_roles": ["user"]}}]})
            >>> [s] = r.to_samples(echo=EchoConfig(tool=RoleEcho(alpha=0.1)))
            >>> s.token_ids, s.completion_mask
            ([1, 2, 3], [True])
        """
        if self.error is not None:
            return []
        steps = self.to_steps(
            tokenizer, chat_template_kwargs=chat_template_kwargs, extra_roles=extra_roles
        )
        return interleave(steps, echo=echo, env_name=self.env_name)


@dataclass(frozen=True)
class RecordError:
    """One problem in a rollout file: 1-based line number, field path (``""`` for the whole
    line) and message."""

    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"line {self.line}" + (f", {self.field}" if self.field else "")
        return f"{where}: {self.message}"


class RolloutFileError(ValueError):
    """A rollout file has bad records; ``errors`` lists every one of them."""

    def __init__(self, source: str, errors: list[RecordError]) -> None:
        self.source = source
        self.errors = errors
        shown = "\n".join(f"  {e}" for e in errors[:_MAX_ERRORS_SHOWN])
        more = len(errors) - _MAX_ERRORS_SHOWN
        tail = f"\n  ... and {more} more (see .errors)" if more > 0 else ""
        super().__init__(f"{source}: {len(errors)} bad rollout record(s):\n{shown}{tail}")


def _non_finite_path(value: Any, path: str = "") -> str | None:
    """The key path of the first NaN or infinite float inside ``value``, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _non_finite_path(v, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _non_finite_path(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a key given twice is an error (not the last one wins)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice in one object (which value is meant?)")
        out[k] = v
    return out


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} (JSON has no NaN or Infinity; write null)")


def _loc(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc)


def _parse_line(line: str, lineno: int) -> tuple[RolloutRecord | None, list[RecordError]]:
    try:
        obj = json.loads(line, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, ValueError) as e:
        return None, [RecordError(lineno, "", f"invalid JSON: {e}")]
    if not isinstance(obj, dict):
        return None, [RecordError(lineno, "", f"expected a JSON object, got {type(obj).__name__}")]
    version = obj.get("schema_version")
    if "schema_version" in obj and version != ROLLOUT_SCHEMA_VERSION:
        return None, [
            RecordError(
                lineno,
                "schema_version",
                f"{version!r} is not supported; this echoloss reads schema_version "
                f"{ROLLOUT_SCHEMA_VERSION}",
            )
        ]
    try:
        return RolloutRecord.model_validate(obj), []
    except ValidationError as e:
        return None, [
            RecordError(lineno, _loc(err["loc"]), err["msg"]) for err in e.errors(include_url=False)
        ]


def _lines(source: str | os.PathLike[str] | IO[str] | Iterable[str]) -> tuple[str, Iterable[str]]:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return str(path), path.open(encoding="utf-8")
    return getattr(source, "name", "<rollouts>"), source


def iter_rollouts(
    source: str | os.PathLike[str] | IO[str] | Iterable[str],
) -> Iterator[RolloutRecord]:
    """Stream rollouts from a JSONL file (path, open file or iterable of lines).

    Blank lines are skipped. Stops at the first bad record with a [`RolloutFileError`][echoloss.io.rollouts.RolloutFileError]
    naming its line and fields; use [`read_rollouts`][echoloss.io.rollouts.read_rollouts] to collect every error of a file.
    """
    name, lines = _lines(source)
    try:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            record, errors = _parse_line(line, lineno)
            if errors:
                raise RolloutFileError(name, errors)
            assert record is not None
            yield record
    finally:
        if hasattr(lines, "close") and isinstance(source, (str, os.PathLike)):
            lines.close()


def read_rollouts(
    source: str | os.PathLike[str] | IO[str] | Iterable[str],
) -> list[RolloutRecord]:
    """Read and validate every rollout of a JSONL file (path, open file or iterable of lines).

    Blank lines are skipped; every other line must be one valid rollout object.

    Returns:
        The records, in file order.

    Raises:
        RolloutFileError: one or more lines are bad (invalid JSON, not an object, unsupported
            ``schema_version``, a missing or wrongly typed field, lengths that do not match).
            ``errors`` holds one [`RecordError`][echoloss.io.rollouts.RecordError] (line, field, message) per problem, for
            every bad line of the file; nothing is skipped silently.

    Examples:
        >>> lines = ['{"schema_version": 1, "group_id": "g", "reward": 0.5, "messages": '
        ...          '[{"role": "user", "content": "hi"}]}',
        ...          '{"schema_version": 1, "group_id": "g", "reward": NaN}']
        >>> try:
        ...     read_rollouts(lines)
        ... except RolloutFileError as e:
        ...     print(e.errors[0])
        line 2: invalid JSON: non-finite number NaN (JSON has no NaN or Infinity; write null)
    """
    name, lines = _lines(source)
    records: list[RolloutRecord] = []
    errors: list[RecordError] = []
    try:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            record, errs = _parse_line(line, lineno)
            if errs:
                errors.extend(errs)
            elif record is not None:
                records.append(record)
    finally:
        if isinstance(source, (str, os.PathLike)):
            lines.close()  # type: ignore[attr-defined]  # a file object opened by _lines
    if errors:
        raise RolloutFileError(name, errors)
    return records


def dump_rollout(record: RolloutRecord | Mapping[str, Any]) -> str:
    """One rollout as a JSON line (no trailing newline), validated first.

    Raises:
        pydantic.ValidationError: ``record`` (a dict) is not a valid rollout.
    """
    if not isinstance(record, RolloutRecord):
        record = RolloutRecord.model_validate(dict(record))
    return json.dumps(
        record.model_dump(mode="json"), allow_nan=False, ensure_ascii=False, separators=(",", ":")
    )


def write_rollouts(
    destination: str | os.PathLike[str] | IO[str],
    records: Iterable[RolloutRecord | Mapping[str, Any]],
    *,
    append: bool = False,
) -> int:
    """Write rollouts as JSONL (each validated; a dict record is validated as a rollout).

    Args:
        destination: a path (created or truncated, or appended to with ``append=True``) or an
            open text file.
        records: [`RolloutRecord`][echoloss.io.rollouts.RolloutRecord] s or dicts.
        append: append to an existing file instead of truncating it.

    Returns:
        The number of records written.

    Raises:
        pydantic.ValidationError: a dict record is not a valid rollout; nothing after it is
            written (the lines before it are).
    """
    if isinstance(records, (Mapping, RolloutRecord, str, bytes)) or not isinstance(
        records, Iterable
    ):
        raise TypeError(
            f"records must be an iterable of RolloutRecord or dict records, got "
            f"{type(records).__name__}; pass a list, e.g. write_rollouts(path, [record])"
        )
    if not isinstance(destination, (str, os.PathLike)) and not hasattr(destination, "write"):
        raise TypeError(
            f"destination must be a path or an open text file, got {type(destination).__name__}"
        )
    if isinstance(destination, (str, os.PathLike)):
        with Path(destination).open("a" if append else "w", encoding="utf-8") as f:
            return write_rollouts(f, records)
    n = 0
    for record in records:
        if not isinstance(record, (RolloutRecord, Mapping)):
            raise TypeError(
                f"records[{n}] must be a RolloutRecord or a dict, got {type(record).__name__}"
            )
        destination.write(dump_rollout(record) + "\n")
        n += 1
    return n
