"""echoloss: loss, mask and advantage primitives for LLM-agent RL with an echo term.

``L = L_RL(actions) + λ · L_CE(observations)``: the policy-gradient loss on the tokens the policy
sampled, plus a cross-entropy ("echo") term on the observation tokens the environment wrote back.
"""

from __future__ import annotations

__version__ = "0.1.0.dev0"

__all__: list[str] = ["__version__"]
