"""echoloss: loss, mask and advantage primitives for LLM-agent RL with an echo term.

``L = L_RL(actions) + λ · L_CE(observations)``: the policy-gradient loss on the tokens the policy
sampled, plus a cross-entropy ("echo") term on the observation tokens the environment wrote back.
"""

from __future__ import annotations

from echoloss.advantages import (
    RAE,
    broadcast_advantages,
    broadcast_packed_advantages,
    compute_advantages,
    register_advantage_fn,
    resolve_advantage_fn,
)
from echoloss.data import (
    EchoConfig,
    EchoFilter,
    NextTokenTargets,
    PackedBatch,
    RoleEcho,
    Sample,
    Step,
    StepEcho,
    TokenAttribution,
    echo_weights,
    interleave,
    list_echo_filters,
    next_token_targets,
    pack,
    register_echo_filter,
    select_step_echo,
    span_echo_filter,
    unpack,
)
from echoloss.loss import (
    LossConfig,
    LossInputs,
    LossOutput,
    Normalizers,
    PolicyInputs,
    PolicyOutput,
    all_reduce_normalizers,
    count_normalizers,
    echo_loss,
    echo_loss_from_hidden,
    echo_loss_from_logprobs,
    raise_deferred_errors,
    register_policy,
    undo_data_parallel_averaging,
)
from echoloss.ops import selective_logprobs
from echoloss.ops.fused_linear import linear_selective_logprobs

__version__ = "0.1.0.dev0"

__all__ = [
    "RAE",
    "EchoConfig",
    "EchoFilter",
    "LossConfig",
    "LossInputs",
    "LossOutput",
    "NextTokenTargets",
    "Normalizers",
    "PackedBatch",
    "PolicyInputs",
    "PolicyOutput",
    "RoleEcho",
    "Sample",
    "Step",
    "StepEcho",
    "TokenAttribution",
    "__version__",
    "all_reduce_normalizers",
    "broadcast_advantages",
    "broadcast_packed_advantages",
    "compute_advantages",
    "count_normalizers",
    "echo_loss",
    "echo_loss_from_hidden",
    "echo_loss_from_logprobs",
    "echo_weights",
    "interleave",
    "linear_selective_logprobs",
    "list_echo_filters",
    "next_token_targets",
    "pack",
    "raise_deferred_errors",
    "register_advantage_fn",
    "register_echo_filter",
    "register_policy",
    "resolve_advantage_fn",
    "select_step_echo",
    "selective_logprobs",
    "span_echo_filter",
    "undo_data_parallel_averaging",
    "unpack",
]
