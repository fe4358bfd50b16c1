"""``torch.nn.Module`` losses shaped like Liger's, and the GRPO-family option mapping.

[`EchoFusedLinearGRPOLoss`][echoloss.nn.EchoFusedLinearGRPOLoss] takes the arguments of
Liger's ``LigerFusedLinearGRPOLoss`` plus the per-token echo inputs;
[`EchoGRPOLoss`][echoloss.nn.EchoGRPOLoss] is the same loss on logits.
``docs/guides/liger.md`` has the option table and the measured equivalence.
"""

from __future__ import annotations

from echoloss.nn.grpo import GRPOLossMapping, grpo_loss_mapping, scale_echo_weights
from echoloss.nn.modules import EchoFusedLinearGRPOLoss, EchoGRPOLoss

__all__ = [
    "EchoFusedLinearGRPOLoss",
    "EchoGRPOLoss",
    "GRPOLossMapping",
    "grpo_loss_mapping",
    "scale_echo_weights",
]
