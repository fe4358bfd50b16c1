"""The data path, one module per step, in pipeline order.

1. ``attribution``: [`TokenAttribution`][echoloss.data.attribution.TokenAttribution], which message (and which part of it) produced each
   prompt token.
2. ``echo_config``: [`EchoConfig`][echoloss.data.echo_config.EchoConfig], which roles are echoed, with which weight.
3. ``echo_weights``: [`echo_weights`][echoloss.data.echo_weights] / [`select_step_echo`][echoloss.data.echo_weights.select_step_echo], one step's per-token echo
   weights and observation mask.
4. ``interleave``: [`Step`][echoloss.data.interleave.Step] (one model call) and [`Sample`][echoloss.data.interleave.Sample] (one training sequence), and
   [`interleave`][echoloss.data.interleave], which merges a trajectory's steps into samples;
   [`STREAMS`][echoloss.data.interleave.STREAMS], the table of a sample's per-token streams
   (``streams``: [`TokenStream`][echoloss.data.streams.TokenStream]) that every later step loops over.
5. ``packing``: [`pack`][echoloss.data.packing.pack] / [`unpack`][echoloss.data.packing.unpack], samples into FlashAttention-style micro-batches.
6. ``spans``: [`span_echo_filter`][echoloss.data.spans.span_echo_filter], echo only the character spans a
   selector marks (an ``echo_filter`` for ``interleave``).
7. ``targets``: [`next_token_targets`][echoloss.data.targets.next_token_targets], the row-aligned record a loss consumes.

The semantics are specified in ``docs/spec.md``; the public names are re-exported here and from
``echoloss``.
"""

from __future__ import annotations

from echoloss.data.attribution import TokenAttribution
from echoloss.data.echo_config import (
    STANDARD_ROLES,
    EchoConfig,
    EchoFilter,
    RoleEcho,
    list_echo_filters,
    register_echo_filter,
)
from echoloss.data.echo_weights import StepEcho, echo_weights, select_step_echo, validate_keep_mask
from echoloss.data.interleave import STREAMS, Sample, Step, interleave
from echoloss.data.packing import PackedBatch, pack, truncate_sample, unpack
from echoloss.data.spans import span_echo_filter, span_token_mask
from echoloss.data.streams import TokenStream
from echoloss.data.targets import NextTokenTargets, next_token_targets

__all__ = [
    "STANDARD_ROLES",
    "STREAMS",
    "EchoConfig",
    "EchoFilter",
    "NextTokenTargets",
    "PackedBatch",
    "RoleEcho",
    "Sample",
    "Step",
    "StepEcho",
    "TokenAttribution",
    "TokenStream",
    "echo_weights",
    "interleave",
    "list_echo_filters",
    "next_token_targets",
    "pack",
    "register_echo_filter",
    "select_step_echo",
    "span_echo_filter",
    "span_token_mask",
    "truncate_sample",
    "unpack",
    "validate_keep_mask",
]
