"""Role-conditioned advantage estimation (SPIRAL): one EMA baseline per key, with resumable state."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal

from echoloss.advantages._checks import (
    _REWARD_FIX,
    _as_list,
    _check_errored,
    _check_key,
    _finite_float,
)

__all__ = ["RAE", "RaeOrder"]

_RAE_STATE_VERSION = 1

RaeOrder = Literal["score_then_update", "update_then_score"]


def _key_to_state(key: Any) -> Any:
    # JSON has no tuples; lists are unhashable, so turning lists back into tuples is unambiguous.
    if isinstance(key, tuple):
        return [_key_to_state(k) for k in key]
    return key


def _key_from_state(obj: Any) -> Any:
    if isinstance(obj, list):
        return tuple(_key_from_state(k) for k in obj)
    return obj


class RAE:
    """Role-conditioned advantage estimation (SPIRAL): one EMA baseline per key.

    Each key (any hashable, e.g. ``(env_name, role)``) has a baseline ``b`` that starts at 0 and
    follows ``b ← decay · b + (1 - decay) · R``. Two orders are published:

    - ``"score_then_update"`` (SPIRAL's released code, prime-rl ``algo.type="rae"``):
      ``A = R - b``, then update; the advantage never includes its own reward.
    - ``"update_then_score"`` (the SPIRAL paper's Algorithm 1): update, then
      ``A = R - b_new = decay · (R - b_old)``.

    Rewards are processed in call order, one at a time, so the result depends on the order of
    rollouts sharing a key. No std normalisation; any group size works, including 1. With a
    single key this is REINFORCE with an EMA baseline.

    The state is in memory; [`state_dict`][echoloss.advantages.rae.RAE.state_dict] / [`load_state_dict`][echoloss.advantages.rae.RAE.load_state_dict] make a resumed run
    continue bit-identically. Keys that round-trip through JSON: ``str``, ``int``, ``float``,
    ``bool``, ``None`` and (nested) tuples of those; tuples are stored as lists and turned back
    into tuples on load. Other hashables (frozensets, enums, …) round-trip only through pickle
    (``torch.save`` / ``torch.load(weights_only=False)``).

    Args:
        decay: EMA decay in ``[0, 1)`` (SPIRAL's α; default 0.95 as in SPIRAL and prime-rl).
        order: ``"score_then_update"`` (default) or ``"update_then_score"``.

    Raises:
        ValueError: If ``decay`` is outside ``[0, 1)`` or ``order`` is unknown.

    Examples:
        >>> rae = RAE(decay=0.5)
        >>> rae.advantage(("chess", 0), 1.0)  # baseline 0 → A = 1; then b = 0.5·0 + 0.5·1
        1.0
        >>> rae.advantage(("chess", 0), 1.0), rae.baseline(("chess", 0))  # A = 1 - 0.5; b = 0.75
        (0.5, 0.75)
        >>> RAE(decay=0.5, order="update_then_score").advantage("solo", 1.0)  # b = 0.5 first
        0.5
    """

    def __init__(self, decay: float = 0.95, order: RaeOrder = "score_then_update") -> None:
        value = _finite_float(decay, "decay", "pass a decay in [0, 1), e.g. 0.95")
        if not 0.0 <= value < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {value}; SPIRAL and prime-rl use 0.95")
        if order not in ("score_then_update", "update_then_score"):
            raise ValueError(
                f"order must be 'score_then_update' (SPIRAL code, prime-rl) or "
                f"'update_then_score' (SPIRAL paper Alg. 1), got {order!r}"
            )
        self.decay: float = value
        self.order: RaeOrder = order
        self._baselines: dict[Hashable, float] = {}

    def __repr__(self) -> str:
        return f"RAE(decay={self.decay!r}, order={self.order!r}, keys={len(self._baselines)})"

    def baseline(self, key: Hashable) -> float:
        """The current baseline of ``key`` (0.0 if the key was never seen)."""
        return self._baselines.get(_check_key(key, "key"), 0.0)

    def advantage(self, key: Hashable, reward: float) -> float:
        """Score one reward against its key's baseline and update the baseline.

        Args:
            key: Any hashable, e.g. ``(env_name, role)``.
            reward: The rollout's (or the role's) finite scalar reward.

        Returns:
            The advantage ``R - b`` under the configured order.

        Raises:
            ValueError: On a non-finite reward, or an overflowing result (state unchanged).
        """
        key = _check_key(key, "key")
        r = _finite_float(reward, "reward", _REWARD_FIX)
        old = self._baselines.get(key, 0.0)
        new = self.decay * old + (1.0 - self.decay) * r
        advantage = r - (old if self.order == "score_then_update" else new)
        if not (math.isfinite(new) and math.isfinite(advantage)):
            raise ValueError(
                f"RAE advantage for key {key!r} overflows float64; rescale the rewards"
            )
        self._baselines[key] = new
        return advantage

    def advantages(
        self,
        keys: Sequence[Hashable],
        rewards: Sequence[float | None],
        *,
        errored: Sequence[bool] | None = None,
    ) -> list[float | None]:
        """Score a batch in order; errored rollouts get None and leave the baselines alone.

        Args:
            keys: ``[B]`` one key per rollout.
            rewards: ``[B]`` rewards (an errored rollout's reward is ignored and may be None).
            errored: ``[B]`` bool, True for rollouts that failed. Default: none failed.

        Returns:
            ``[B]`` advantages, None where ``errored``.

        Raises:
            ValueError: On mismatched lengths or a non-finite reward of a surviving rollout;
                the state is unchanged then.

        Examples:
            >>> rae = RAE(decay=0.5)
            >>> rae.advantages(["a", "a", "b"], [1.0, None, 2.0], errored=[False, True, False])
            [1.0, None, 2.0]
        """
        key_list = _as_list(keys, "keys")
        reward_list = _as_list(rewards, "rewards")
        n = len(key_list)
        if len(reward_list) != n:
            raise ValueError(f"rewards has length {len(reward_list)}, expected {n} (one per key)")
        failed = _check_errored(errored, n)
        for i in range(n):
            _check_key(key_list[i], f"keys[{i}]")
            if not failed[i]:
                _finite_float(reward_list[i], f"rewards[{i}]", _REWARD_FIX)
        snapshot = dict(self._baselines)
        try:
            return [
                None if failed[i] else self.advantage(key_list[i], reward_list[i]) for i in range(n)
            ]
        except ValueError:
            self._baselines = snapshot
            raise

    def state_dict(self) -> dict[str, Any]:
        """A JSON- and ``torch.save``-friendly copy of the state.

        Returns:
            ``{"version": 1, "decay": float, "order": str, "baselines": [[key, value], ...]}``,
            with tuple keys stored as lists and the baselines in first-seen order.

        Examples:
            >>> rae = RAE(decay=0.5)
            >>> _ = rae.advantage(("env", "p0"), 2.0)
            >>> rae.state_dict()
            {'version': 1, 'decay': 0.5, 'order': 'score_then_update', 'baselines': [[['env', 'p0'], 1.0]]}
        """
        return {
            "version": _RAE_STATE_VERSION,
            "decay": self.decay,
            "order": self.order,
            "baselines": [[_key_to_state(k), v] for k, v in self._baselines.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore baselines saved by [`state_dict`][echoloss.advantages.rae.RAE.state_dict] (after JSON or ``torch.save``).

        Args:
            state: A state dict whose ``decay`` and ``order`` equal this estimator's.

        Raises:
            ValueError: If the state is malformed, from another version, or was saved with a
                different ``decay``/``order`` (build the estimator with
                [`from_state_dict`][echoloss.advantages.rae.RAE.from_state_dict] to take them from the state instead).

        Examples:
            >>> import json
            >>> rae = RAE(decay=0.5)
            >>> _ = rae.advantage(("env", 1), 3.0)
            >>> restored = RAE(decay=0.5)
            >>> restored.load_state_dict(json.loads(json.dumps(rae.state_dict())))
            >>> restored.baseline(("env", 1))
            1.5
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"RAE state must be a dict from state_dict(), got {type(state).__name__}"
            )
        missing = {"version", "decay", "order", "baselines"} - set(state)
        if missing:
            raise ValueError(
                f"RAE state is missing {sorted(missing)}; expected the output of state_dict()"
            )
        if state["version"] != _RAE_STATE_VERSION:
            raise ValueError(
                f"RAE state version {state['version']!r} is not supported (expected {_RAE_STATE_VERSION})"
            )
        if state["decay"] != self.decay or state["order"] != self.order:
            raise ValueError(
                f"RAE state was saved with decay={state['decay']!r}, order={state['order']!r} but this "
                f"estimator has decay={self.decay!r}, order={self.order!r}; construct it with the "
                "saved values or use RAE.from_state_dict(state)"
            )
        entries = state["baselines"]
        if not isinstance(entries, (list, tuple)):
            raise ValueError(
                f"RAE state 'baselines' must be a list of [key, value] pairs, got {type(entries).__name__}"
            )
        baselines: dict[Hashable, float] = {}
        for i, entry in enumerate(entries):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise ValueError(
                    f"RAE state baselines[{i}] must be a [key, value] pair, got {entry!r}"
                )
            key = _check_key(_key_from_state(entry[0]), f"baselines[{i}] key")
            if key in baselines:
                raise ValueError(f"RAE state baselines[{i}] repeats key {key!r}")
            baselines[key] = _finite_float(
                entry[1], f"baselines[{i}] value", "the state is corrupt"
            )
        self._baselines = baselines

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> RAE:
        """Build an estimator with the ``decay``, ``order`` and baselines of ``state``.

        Examples:
            >>> rae = RAE(decay=0.9, order="update_then_score")
            >>> RAE.from_state_dict(rae.state_dict())
            RAE(decay=0.9, order='update_then_score', keys=0)
        """
        if not isinstance(state, Mapping) or "decay" not in state or "order" not in state:
            raise ValueError("RAE.from_state_dict needs the output of RAE.state_dict()")
        rae = cls(decay=state["decay"], order=state["order"])
        rae.load_state_dict(state)
        return rae
