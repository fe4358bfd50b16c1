"""Adapters from orchestrators and chat formats to echoloss samples.

Each adapter is a thin module imported on demand; none of them is imported by ``import echoloss``
or by this package, and none imports an optional dependency at module level:

* [`echoloss.adapters.chat`][echoloss.adapters.chat]: chat messages + any Hugging Face tokenizer with a chat template →
  token ids + [`echoloss.TokenAttribution`][echoloss.data.attribution.TokenAttribution], and multi-turn messages → [`echoloss.Step`][echoloss.data.interleave.Step].
* [`echoloss.adapters.verifiers`][echoloss.adapters.verifiers]: verifiers v1 traces (message-graph nodes, branches) and the
  older rollout dicts whose steps carry ``tokens.prompt_attribution`` → [`echoloss.Sample`][echoloss.data.interleave.Sample].
* [`echoloss.adapters.openenv`][echoloss.adapters.openenv]: OpenEnv RFC 010 per-token tags (``action_mask``, ``obs_mask``,
  ``warning_mask``, world-model coefficient) → [`echoloss.Sample`][echoloss.data.interleave.Sample].
* [`echoloss.adapters.trl`][echoloss.adapters.trl]: a TRL ``GRPOTrainer`` subclass that adds the echo term on tool
  observations (extra ``trl``).

``docs/adapters.md`` describes each one and its limits.
"""

from __future__ import annotations

__all__: list[str] = []
