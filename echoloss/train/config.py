"""The trainer's configuration: a TOML file validated with pydantic, plus command-line overrides.

Every section rejects unknown keys, and every error names the key it is about
(``optim.lr: Input should be a valid number``). With no file, `DEFAULT_TOML` (the embedded
default) is used; ``configs/`` has annotated examples.

Examples:
    >>> cfg = load_config(None, overrides={"train.max_steps": 3})
    >>> cfg.train.max_steps, cfg.model.arch, cfg.echo.alpha
    (3, 'qwen3', 0.05)
    >>> parse_config({"optim": {"lr": "fast"}})
    Traceback (most recent call last):
    ...
    echoloss.train.config.ConfigError: invalid trainer config:
      optim.lr: Input should be a valid number, unable to parse string as a number (got 'fast')
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from echoloss.loss import LossConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["DEFAULT_TOML", "ConfigError", "TrainConfig", "load_config", "parse_config"]


class ConfigError(ValueError):
    """A configuration file or override that does not validate; the message names every key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """``[model]``: the tiny built-in model, or a local Hugging Face directory."""

    path: str | None = None  # a local HF causal-LM directory; None = the tiny built-in model
    arch: Literal["qwen3", "llama"] = "qwen3"
    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(192, ge=8)
    max_position_embeddings: int = Field(1024, ge=16)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attn_implementation: str = "sdpa"  # "eager", "sdpa", or "flash_attention_2" (packed varlen)

    @field_validator("path")
    @classmethod
    def _local_dir(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        p = Path(v).expanduser()
        if not p.is_dir():
            raise ValueError(f"no such directory {v!r} (a local Hugging Face model directory)")
        if not (p / "config.json").is_file():
            raise ValueError(f"{v!r} has no config.json: not a Hugging Face model directory")
        return str(p)

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.path is None and (
            self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads
        ):
            raise ValueError(
                "hidden_size must be a multiple of num_heads, and num_heads of num_kv_heads "
                f"(got {self.hidden_size}, {self.num_heads}, {self.num_kv_heads})"
            )
        return self


class EnvConfig(_Section):
    """``[env]``: the built-in tool environment."""

    name: Literal["gridwalk"] = "gridwalk"
    size: int = Field(4, ge=2, le=10)
    max_turns: int | None = Field(None, ge=1)


class DataConfig(_Section):
    """``[data]``: where rollouts come from and how they are batched."""

    source: Literal["generate", "jsonl"] = "generate"
    path: str | None = None  # the rollout JSONL file for source = "jsonl"
    prompts_per_step: int = Field(4, ge=1)  # prompts (groups) per optimiser step, all ranks
    group_size: int = Field(8, ge=1)  # rollouts per prompt
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(4, ge=1)  # per model call
    max_tokens: int = Field(1024, ge=16)  # longest sample; longer ones are an error
    heldout_size: int = Field(32, ge=0)  # held-out conversations for the observation CE

    @model_validator(mode="after")
    def _path(self) -> DataConfig:
        if self.source == "jsonl":
            if not self.path:
                raise ValueError("path: required when source = 'jsonl'")
            if not Path(self.path).expanduser().is_file():
                raise ValueError(f"path: no such file {self.path!r}")
        return self


class WarmupConfig(_Section):
    """``[warmup]``: SFT on scripted demonstrations (assistant tokens only) before RL."""

    steps: int = Field(60, ge=0)
    demos_per_step: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)  # SFT tolerates (and needs) a far larger step than RL


class EchoSection(_Section):
    """``[echo]``: the echo term on tool observations (``alpha = 0`` is plain RL)."""

    alpha: float = Field(0.05, ge=0)  # echo weight of tool-message tokens; 0 = no echo
    target: Literal["content", "message"] = "content"
    echo_warnings: bool = False
    max_tokens_per_message: int | None = Field(None, ge=1)


class AdvantageConfig(_Section):
    """``[advantages]``: the per-group estimator, or RAE (an EMA baseline per env)."""

    fn: str = "grpo"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    rae_decay: float | None = Field(None, ge=0, lt=1)  # set to use RAE instead of ``fn``


class OptimConfig(_Section):
    """``[optim]``: AdamW, clipping and micro-batching."""

    lr: float = Field(3e-4, gt=0)  # the RL learning rate (the warm-start has its own)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)  # None = no clipping
    micro_batch_tokens: int = Field(1024, ge=16)  # tokens per packed micro-batch (per rank)


class TrainSection(_Section):
    """``[train]``: the run."""

    max_steps: int = Field(150, ge=1)  # optimiser steps, warm-up included
    seed: int = Field(0, ge=0)
    output_dir: str = "runs/echoloss-train"
    eval_every: int = Field(10, ge=1)  # held-out observation CE every N steps (and at the end)
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    plots: bool = True
    export_tokens: bool = False  # write tokens.jsonl: what the loss saw, per token
    deterministic: bool = True  # torch.use_deterministic_algorithms (CPU runs are reproducible)
    progress: bool = True  # the progress bar (off when stderr is not a terminal)
    save_rollouts: bool = False  # append each step's rollouts to rollouts.rank<R>.jsonl
    threads: int | None = Field(None, ge=1)  # torch CPU threads (None = torch's default)


# The ECHO paper's recipe: clipped PPO ratio, per-sequence means for both terms (Z_i = |O_i|).
_LOSS_DEFAULTS: dict[str, Any] = {
    "policy": "ppo_clip",
    "kl_tau": 0.0,
    "rl_normalization": "sequence_mean_token_mean",
    "echo_normalization": "sequence_mean",
}


class TrainConfig(_Section):
    """The whole configuration (the TOML file's sections)."""

    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    data: DataConfig = DataConfig()
    warmup: WarmupConfig = WarmupConfig()
    echo: EchoSection = EchoSection()
    advantages: AdvantageConfig = AdvantageConfig()
    loss: LossConfig = LossConfig(**_LOSS_DEFAULTS)
    optim: OptimConfig = OptimConfig()
    train: TrainSection = TrainSection()

    @model_validator(mode="before")
    @classmethod
    def _loss_defaults(cls, data: Any) -> Any:
        # A partial [loss] table overrides the trainer's defaults key by key (not LossConfig's).
        if isinstance(data, dict) and isinstance(data.get("loss"), dict):
            data = {**data, "loss": {**_LOSS_DEFAULTS, **data["loss"]}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.data.source == "jsonl" and self.warmup.steps:
            raise ValueError("warmup.steps must be 0 with data.source = 'jsonl' (no env to script)")
        if self.loss.mode != "rl":
            raise ValueError("loss.mode must be 'rl' (the warm-start uses SFT by itself)")
        return self


# The embedded default: what `echoloss-train` runs with no --config (mirrors configs/default.toml).
DEFAULT_TOML = """\
# echoloss-train embedded default: a tiny Qwen3-style model learns gridwalk with GRPO + echo on CPU.
# 60 warm-start steps (SFT on demonstrations), then 90 RL steps of 4 prompts x 8 rollouts.
[model]
arch = "qwen3"

[train]
max_steps = 150
threads = 1   # a tiny model runs fastest on one thread (two leave a core to the OS / a 2nd run)
"""


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "missing"
        got = e.get("input")
        suffix = (
            ""
            if e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict)
            else f" (got {got!r})"
        )
        lines.append(f"  {key}: {msg}{suffix}")
    return "invalid trainer config:\n" + "\n".join(lines)


def parse_config(data: dict[str, Any]) -> TrainConfig:
    """Validate a dict (a parsed TOML file); raises `ConfigError` naming every bad key."""
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err)) from None


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"invalid trainer config:\n  {dotted}: {p} is not a section")
        node = child
    node[leaf] = value


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read ``path`` (None = the embedded default), apply ``{"section.key": value}`` overrides,
    validate.

    Raises:
        ConfigError: a TOML syntax error (with its line), an unknown key, a wrong type, a bad value.
        FileNotFoundError: ``path`` does not exist.
    """
    if path is None:
        text, where = DEFAULT_TOML, "<embedded default>"
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--config: no such file {str(p)!r}")
        text, where = p.read_text(), str(p)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{where}: not valid TOML: {err}") from None
    for key, value in (overrides or {}).items():
        _set(data, key, value)
    return parse_config(data)
