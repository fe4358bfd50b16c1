"""Files in and out: the rollout JSONL interchange format and the token JSONL export.

* [`echoloss.io.rollouts`][echoloss.io.rollouts]: versioned, validated rollout records (token steps with attribution,
  or chat messages), a reader that reports every bad line and field, and a writer.
* [`echoloss.io.token_export`][echoloss.io.token_export]: what the loss saw, one JSON record per packed sequence.
"""

from __future__ import annotations

from echoloss.io.rollouts import (
    ROLLOUT_SCHEMA_VERSION,
    AttributionRecord,
    RecordError,
    RolloutFileError,
    RolloutRecord,
    StepRecord,
    dump_rollout,
    iter_rollouts,
    read_rollouts,
    write_rollouts,
)
from echoloss.io.token_export import (
    RL_ONLY_COLUMNS,
    TOKEN_EXPORT_SCHEMA_VERSION,
    TokenExporter,
    token_records,
)

__all__ = [
    "RL_ONLY_COLUMNS",
    "ROLLOUT_SCHEMA_VERSION",
    "TOKEN_EXPORT_SCHEMA_VERSION",
    "AttributionRecord",
    "RecordError",
    "RolloutFileError",
    "RolloutRecord",
    "StepRecord",
    "TokenExporter",
    "dump_rollout",
    "iter_rollouts",
    "read_rollouts",
    "token_records",
    "write_rollouts",
]
