"""Adapters from orchestrators and chat formats to echoloss samples.

Each adapter is a thin module imported on demand; none of them is imported by ``import echoloss``
or by this package, and none imports an optional dependency at module level:

* :mod:`echoloss.adapters.chat`: chat messages + any Hugging Face tokenizer with a chat template →
  token ids + :class:`echoloss.TokenAttribution`, and multi-turn messages → :class:`echoloss.Step`.
* :mod:`echoloss.adapters.verifiers`: verifiers v1 traces (message-graph nodes, branches) and the
  older rollout dicts whose steps carry ``tokens.prompt_attribution`` → :class:`echoloss.Sample`.
* :mod:`echoloss.adapters.openenv`: OpenEnv RFC 010 per-token tags (``action_mask``, ``obs_mask``,
  ``warning_mask``, world-model coefficient) → :class:`echoloss.Sample`.
* :mod:`echoloss.adapters.trl`: a TRL ``GRPOTrainer`` subclass that adds the echo term on tool
  observations (extra ``trl``).

``docs/adapters.md`` describes each one and its limits.
"""

from __future__ import annotations

__all__: list[str] = []
