"""The trainer's configuration: a TOML file validated with pydantic, plus command-line overrides.

Every section rejects unknown keys, and every error names the key it is about
(``optim.lr: Input should be a valid number``). With no file, `DEFAULT_TOML` (the embedded
default) is used; ``configs/`` has annotated examples.

Examples:
    >>> cfg = load_config(None, overrides={"train.max_steps": 3})
    >>> cfg.train.max_steps, cfg.model.arch, cfg.echo.alpha
    (3, 'qwen3', 0.01)
    >>> parse_config({"optim": {"lr": "fast"}})
    Traceback (most recent call last):
    ...
    echoloss.train.config.ConfigError: invalid trainer config:
      optim.lr: Input should be a valid number, unable to parse string as a number (got 'fast')
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from echoloss.advantages import list_advantage_fns, resolve_advantage_fn
from echoloss.loss import LossConfig
from echoloss.train.envs import ENVS, make_env
from echoloss.train.envs.base import TurnsNeeded

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "DEFAULT_TOML",
    "ConfigError",
    "ConfigWarning",
    "TrainConfig",
    "advantage_fn",
    "load_config",
    "parse_config",
    "pretrained_rates_problem",
    "turns_needed",
]

#: The largest ``train.seed``: seeds are combined with the rank (``seed * 1000 + rank``) and fed
#: to torch, NumPy and Python generators; 2**32 - 1 keeps every derived seed inside torch's range.
MAX_SEED = 2**32 - 1
#: ``model.path = "packaged:NAME"``: a model shipped as a Python package (echoloss.pretrained).
PACKAGED_PREFIX = "packaged:"
#: The opt-in that lets a configuration name code by import path (key and command-line flag).
OPT_IN = "[train] allow_import_paths = true (or --allow-import-paths)"


def _is_import_path(spec: str) -> bool:
    return ":" in spec or "." in spec


def _import_path_refused(spec: str) -> str:
    return (
        f"advantages.fn: {spec!r} is an import path; a config runs code only from echoloss's "
        f"registry ({', '.join(list_advantage_fns())}) unless you opt in. If you trust this "
        f"config, set {OPT_IN}"
    )


def _resolve(spec: str, kwargs: Mapping[str, Any]) -> None:
    """Resolve ``spec`` and bind ``kwargs`` (imports an import path: call only when allowed)."""
    try:
        resolve_advantage_fn(spec, **kwargs)
    except (ValueError, TypeError) as err:
        raise ValueError(str(err)) from None


class ConfigError(ValueError):
    """A configuration file or override that does not validate; the message names every key."""


class ConfigWarning(UserWarning):
    """A configuration that validates but is almost surely a mistake."""


class _Section(BaseModel):
    # allow_inf_nan=False: `gt=0` alone admits +inf (an infinite learning rate validates).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelConfig(_Section):
    """``[model]``: the tiny built-in model, or a local Hugging Face directory."""

    # a local HF causal-LM directory, a .gguf file (dequantised to `dtype` on load), or
    # "packaged:NAME", a model installed as a Python package (echoloss.pretrained.PACKAGED_MODELS,
    # converted once into a cached directory); None = the tiny built-in model
    path: str | None = None
    gguf_file: str | None = None  # the .gguf file inside the directory `path` (a file name)
    arch: Literal["qwen3", "llama"] = "qwen3"
    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(192, ge=8)
    max_position_embeddings: int = Field(1024, ge=16)
    # auto: bf16 on a GPU, fp32 on CPU; fastest: bf16 on a GPU or a CPU with AVX512-BF16/AMX
    # (where bf16 matmuls are native), fp32 elsewhere (runtime.compute_dtype)
    dtype: Literal["auto", "fastest", "float32", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attn_implementation: str = "sdpa"  # "eager", "sdpa", or "flash_attention_2" (packed varlen)
    # The update's forward (echoloss.train.forward): "logits" (every row's logits), "packed" (the
    # LM head only on the rows that carry loss), "shared_prefix" (that, and a prompt prefix
    # shared by several samples computed once); auto = shared_prefix on one process with a
    # non-flash attention and no token export, else logits (FSDP, token export) or packed
    update_forward: Literal["auto", "logits", "packed", "shared_prefix"] = "auto"

    @field_validator("device")
    @classmethod
    def _cuda_available(cls, v: str) -> str:
        if v == "cuda" and not torch.cuda.is_available():
            why = (
                f"this torch ({torch.__version__}) is a CPU-only build"
                if torch.version.cuda is None
                else "no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
            )
            raise ValueError(f"'cuda' but {why}; use 'auto' (a GPU when there is one) or 'cpu'")
        return v

    @field_validator("path")
    @classmethod
    def _local_model(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        if v.startswith(PACKAGED_PREFIX):
            from echoloss.pretrained import PACKAGED_MODELS

            name = v.removeprefix(PACKAGED_PREFIX)
            if name not in PACKAGED_MODELS:
                raise ValueError(
                    f"{v!r}: no packaged model {name!r}; expected one of "
                    + ", ".join(f"'{PACKAGED_PREFIX}{n}'" for n in PACKAGED_MODELS)
                )
            return v
        p = Path(v).expanduser()
        if p.is_file() and p.suffix == ".gguf":
            return str(p)
        if not p.is_dir():
            raise ValueError(
                f"no such directory or .gguf file {v!r} (a local Hugging Face model directory, "
                "or a GGUF file)"
            )
        if not (p / "config.json").is_file() and not any(p.glob("*.gguf")):
            raise ValueError(f"{v!r} has no config.json: not a Hugging Face model directory")
        return str(p)

    @model_validator(mode="after")
    def _model_files(self) -> ModelConfig:
        if self.path is None:
            if self.gguf_file is not None:
                raise ValueError(
                    f"gguf_file = {self.gguf_file!r} needs model.path, the directory holding it"
                )
            return self
        p = Path(self.path)
        if self.path.startswith(PACKAGED_PREFIX):
            if self.gguf_file is not None:
                raise ValueError(f"gguf_file: not used with model.path = {self.path!r}")
            return self
        if self.gguf_file is not None:
            if p.is_file():
                raise ValueError(
                    f"gguf_file = {self.gguf_file!r} with model.path a file ({self.path!r}): "
                    "set one of them (model.path = the .gguf file alone is enough)"
                )
            if not (p / self.gguf_file).is_file():
                raise ValueError(f"gguf_file: no file {self.gguf_file!r} in {self.path!r}")
        elif p.is_dir() and not (p / "config.json").is_file():
            ggufs = sorted(f.name for f in p.glob("*.gguf"))
            hint = f"; to load a GGUF file there, set model.gguf_file (found: {ggufs})"
            raise ValueError(
                f"path: {self.path!r} has no config.json: not a Hugging Face model directory{hint}"
            )
        return self

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
    """``[env]``: the tool environment, by its name in `echoloss.train.envs.ENVS`, and its
    options (each registered environment declares the keys it takes)."""

    name: str = "mirrorgrid"  # a name registered in echoloss.train.envs.ENVS
    size: int = Field(4, ge=2, le=10)  # grid environments: the grid's side
    max_turns: int | None = Field(None, ge=1)
    # mirrorgrid: probability that an axis is mirrored in warm-up tasks (RL and evaluation: ½).
    # 0 = the warm-start knows only the ordinary world; the mirroring is learnt in RL
    warmup_flip_prob: float = Field(0.0, ge=0, le=1)
    # mirrorgrid: probability that a turn of a warm-up demonstration is a random move
    demo_explore: float = Field(0.0, ge=0, lt=1)
    # mirrorgrid: how long the hidden dynamics persist: "per-episode" (a mirroring drawn every
    # episode) or "per-world" (one fixed direction permutation, `world`, in every RL and
    # evaluation episode; warm-up in the ordinary world)
    level: Literal["per-episode", "per-world"] = "per-episode"
    world: int = 0  # the per-world level's world (a seed; `experiment` uses the run's seed)
    # mirrorgrid: the observation's direction words: the key names, or their own vocabulary
    # (north/south/west/east, no token shared with the action keys)
    words: Literal["keys", "compass"] = "keys"
    # calculator: held-out evaluation questions (None = the env's 8)
    eval_size: int | None = Field(None, ge=1)

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in ENVS:
            raise ValueError(f"expected one of {list(ENVS)} (echoloss.train.envs.ENVS), got {v!r}")
        return v

    def options(self) -> dict[str, Any]:
        """The keyword arguments of `echoloss.train.envs.make_env`: the keys the named
        environment takes, with their values.

        Example:
            >>> EnvConfig(name="gridwalk", size=3).options()
            {'size': 3, 'max_turns': None}
        """
        return {k: getattr(self, k) for k in ENVS[self.name].options}

    @model_validator(mode="after")
    def _fits_the_env(self) -> EnvConfig:
        taken = ENVS[self.name].options
        for key, spec in type(self).model_fields.items():
            if key == "name" or key in taken or getattr(self, key) == spec.default:
                continue
            takers = [n for n, e in ENVS.items() if key in e.options]
            raise ValueError(
                f"{key}: applies to the environments {', '.join(takers)}, not {self.name} (got "
                f"{getattr(self, key)}); leave it unset"
            )
        env = make_env(self.name, **self.options())  # its own checks run too
        need = env.turns_needed if isinstance(env, TurnsNeeded) else 2  # optional capability
        if self.max_turns is not None and self.max_turns < 2:
            raise ValueError(
                f"max_turns: {self.max_turns} turn cannot solve any task (the nearest goal is one "
                f"move, then 'done'); set max_turns >= {need} to make every task solvable, or "
                "leave it unset"
            )
        if self.max_turns is not None and self.max_turns < need:
            warnings.warn(
                f"env.max_turns = {self.max_turns}: some {self.name} tasks cannot be solved (the "
                f"scripted demonstration of the longest one takes {need} turns, 'done' included); "
                f"they reward 0 for every policy and their warm-start demonstrations stop "
                f"unsolved. Set max_turns >= {need}, or leave it unset",
                ConfigWarning,
                stacklevel=2,
            )
        return self


#: A model with more parameters than this is a pretrained one (the built-in tiny models, and the
#: models the experiment trains from them, have well under a million).
PRETRAINED_PARAMETERS = 10_000_000
#: The largest learning rate (warm-up or RL) that is not suspicious for a pretrained model: one
#: warm-up update at 1e-3 took SmolLM2-135M-Instruct from loss_sft 4.25 / obs_nll 2.1 to
#: 7.16 / 16.5 (RL then started at 100 % invalid replies); the same update at 1e-5 lowered them.
PRETRAINED_MAX_LR = 1e-4


def pretrained_rates_problem(cfg: TrainConfig, parameters: int) -> str | None:
    """Why the learning rates do not suit a pretrained model of ``parameters`` loaded from
    ``model.path``, or None.

    A rate is suspicious when it is above `PRETRAINED_MAX_LR` and is the built-in tiny model's:
    it comes from the defaults or from a config file that does not set ``model.path`` (e.g.
    ``--config fast --set model.path=DIR``). A rate set on the command line or in the file that
    sets ``model.path`` was chosen for that model (``configs/gpu.toml``'s warm-up at 3e-3 teaches
    mirrorgrid's reply format on purpose) and is left alone.

    Examples:
        >>> cfg = parse_config({"optim": {"lr": 1e-3}})
        >>> pretrained_rates_problem(cfg, 135_000_000) is None  # no model.path: the tiny model
        True
    """
    if cfg.model.path is None or parameters <= PRETRAINED_PARAMETERS:
        return None
    chosen = cfg._rates_chosen
    high = []
    if cfg.warmup.steps and cfg.data.source != "jsonl" and "warmup.lr" not in chosen:
        high += [f"warmup.lr = {cfg.warmup.lr:g}"] if cfg.warmup.lr > PRETRAINED_MAX_LR else []
    if "optim.lr" not in chosen and cfg.optim.lr > PRETRAINED_MAX_LR:
        high.append(f"optim.lr = {cfg.optim.lr:g}")
    if not high:
        return None
    return (
        f"model.path loads a pretrained model ({parameters / 1e6:.0f}M parameters) but "
        f"{' and '.join(high)} are learning rates for the built-in tiny model: one warm-up "
        "update at 1e-3 took SmolLM2-135M-Instruct's SFT loss from 4.25 to 7.16 (at 1e-5 it "
        f"fell to 3.92). Use rates of at most {PRETRAINED_MAX_LR:g}, e.g. --set warmup.lr=1e-5 "
        "--set optim.lr=1e-6 (or start from a config written for a pretrained model)"
    )


def turns_needed(env: str, size: int) -> int:
    """The fewest assistant turns in which every task of ``env`` on a ``size``-grid is solved by
    its scripted demonstration (`echoloss.train.envs.base.Env.turns_needed`): the farthest goal
    (``2·(size−1)`` moves) and ``done``, plus, where the controls are secretly mirrored, a
    probing move and a move back per axis.

    With fewer, some tasks can never be solved and their warm-start demonstrations are cut short.

    Examples:
        >>> turns_needed("gridwalk", 3), turns_needed("mirrorgrid", 3)
        (5, 9)
    """
    built = make_env(env, size=size)
    return built.turns_needed if isinstance(built, TurnsNeeded) else 2


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
    """``[warmup]``: SFT on scripted demonstrations before RL (steps not counted in
    ``train.max_steps``)."""

    steps: int = Field(60, ge=0)
    demos_per_step: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)  # SFT tolerates (and needs) a far larger step than RL
    lr_ramp_steps: int = Field(10, ge=0)  # linear lr ramp over the first steps (0 = none)
    # CE weight of the observation tokens in the warm-up (0 = assistant tokens only; > 0 keeps
    # them calibrated; 1 with a short warm-up is the ActObs-style arm of the experiment)
    obs_weight: float = Field(0.1, ge=0)
    # Before the warm-up, train the tiny model on a generic in-context copy task (random token
    # ids, repeated; nothing about the environment) for this many steps: the skill a pretrained
    # model brings and a random-init one lacks (docs/experiment.md, the probe). 0 = none.
    copy_steps: int = Field(0, ge=0)
    copy_lr: float = Field(3e-3, gt=0)


class EchoSection(_Section):
    """``[echo]``: the echo term on tool observations (``alpha = 0`` is plain RL)."""

    alpha: float = Field(0.05, ge=0)  # echo weight of tool-message tokens; 0 = no echo
    # λ over RL steps (echoloss.schedules.echo_alpha): constant, warmup (linear ramp up over
    # schedule_steps) or decay (linear to final_alpha over schedule_steps)
    schedule: Literal["constant", "warmup", "decay"] = "constant"
    schedule_steps: int = Field(0, ge=0)
    final_alpha: float = Field(0.0, ge=0)
    target: Literal["content", "message"] = "content"
    echo_warnings: bool = False
    max_tokens_per_message: int | None = Field(None, ge=1)
    # which tokens of each observation are echoed: the whole body ("observation"), or only the
    # env's spans: "hidden" (the hidden-dependent word) or "noise" (the uninformative digit of
    # mirrorgrid-noise: the placebo). Through echoloss.span_echo_filter
    span: Literal["observation", "hidden", "noise"] = "observation"
    # The weight of error observations (envs with observation kinds: the calculator's
    # "error: ..." replies) relative to the others in the echo term: 1 = as any observation,
    # 0 = not echoed (they still count in Z), in between = down-weighted
    error_weight: float = Field(1.0, ge=0, le=1)


class AdvantageConfig(_Section):
    """``[advantages]``: the per-group estimator, or RAE (an EMA baseline per env)."""

    fn: str = "grpo"  # a registered name; an import path "pkg.mod:fn" needs allow_import_paths
    kwargs: dict[str, Any] = Field(default_factory=dict)
    rae_decay: float | None = Field(None, ge=0, lt=1)  # set to use RAE instead of ``fn``

    # The opt-in lives in [train]: parse_config passes it as the validation context. Without one
    # (a TrainConfig built in Python) nothing is imported here and TrainConfig checks the opt-in.
    @field_validator("fn")
    @classmethod
    def _known_fn(cls, v: str, info: ValidationInfo) -> str:
        allowed = (info.context or {}).get("allow_import_paths")
        if _is_import_path(v):
            if allowed is False:
                raise ValueError(_import_path_refused(v).removeprefix("advantages.fn: "))
            if allowed:
                _resolve(v, {})  # imports it now: a bad path is reported before any work
        elif v not in list_advantage_fns():
            raise ValueError(
                f"unknown advantage fn {v!r}; registered names: {', '.join(list_advantage_fns())}"
            )
        return v

    @field_validator("kwargs")
    @classmethod
    def _bind_kwargs(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        fn = info.data.get("fn")  # absent when fn itself failed
        allowed = (info.context or {}).get("allow_import_paths")
        if v and fn is not None and (not _is_import_path(fn) or allowed):
            _resolve(fn, v)
        return v

    @model_validator(mode="after")
    def _rae(self) -> AdvantageConfig:
        if self.rae_decay is not None and {"fn", "kwargs"} & self.model_fields_set:
            raise ValueError(
                "advantages.fn/kwargs are not used when advantages.rae_decay is set (RAE replaces "
                "the per-group estimator); remove one of them"
            )
        return self


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

    max_steps: int = Field(150, ge=0)  # RL optimiser steps, after the warmup.steps warm-up
    seed: int = Field(0, ge=0, le=MAX_SEED)
    output_dir: str = "runs/echoloss-train"
    # a fresh run into an output_dir that holds an earlier run replaces that run's outputs
    # (its metrics, evaluations, plots, checkpoints, final model) only if true (--overwrite);
    # otherwise it is refused: continue that run with --resume, or give a new output_dir
    overwrite: bool = False
    eval_every: int = Field(10, ge=1)  # held-out evaluation every N RL steps (and start, end)
    # sampled episodes per held-out task at the RL start and end (every evaluation also plays
    # each task once greedily): 240 tasks x (1 + 4) = 1,200 episodes on mirrorgrid 4x4
    eval_samples: int = Field(4, ge=0)
    # held-out tasks each evaluation plays: None = all of the env's evaluation set; N = N of
    # them, spread evenly over the set (the same N for every evaluation and arm); 0 = no
    # success evaluation at all (the held-out observation CEs are still measured)
    eval_episodes: int | None = Field(None, ge=0)
    eval_at_start: bool = True  # evaluate before the first RL step
    # every N RL steps (from the first) log echo_grad_norm and pg_grad_norm, the norms of the
    # echo term's gradient and of the rest (one extra backward pass on those steps; single
    # process only); 0 = never
    grad_ratio_every: int = Field(0, ge=0)
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    plots: bool = True
    export_tokens: bool = False  # write tokens.jsonl: what the loss saw, per token
    deterministic: bool = True  # torch.use_deterministic_algorithms (CPU runs are reproducible)
    progress: bool = True  # the progress bar (off when stderr is not a terminal)
    save_rollouts: bool = False  # append each step's rollouts to rollouts.rank<R>.jsonl
    threads: int | None = Field(None, ge=1)  # torch CPU threads (None = torch's default)
    # Code named by import path in this config (advantages.fn = "pkg.mod:fn") runs only if true:
    # a config copied from elsewhere must not run code unreviewed (docs/reliability.md).
    allow_import_paths: bool = False
    # Trackers besides metrics.jsonl (echoloss.train.tracking; the `tracking` extra)
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)

    @field_validator("output_dir")
    @classmethod
    def _named_dir(cls, v: str) -> str:
        if not v.strip():
            raise ValueError(
                "output_dir is empty: the run would write into the working directory; name a "
                "directory, e.g. runs/my-run"
            )
        return v

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, v: list[str]) -> list[str]:
        twice = sorted({t for t in v if v.count(t) > 1})
        if twice:
            raise ValueError(
                f"report_to lists {', '.join(twice)} more than once: every scalar would be "
                "logged once per entry; list each tracker once"
            )
        from echoloss._optional import MissingExtraError
        from echoloss.train.tracking import check_trackers

        try:
            check_trackers(v)
        except MissingExtraError as err:
            raise ValueError(str(err)) from None
        return v


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
    #: The learning rates (``"warmup.lr"``, ``"optim.lr"``) chosen for the model of
    #: ``model.path``: set on the command line (``--set``) or in the same file or table that sets
    #: ``model.path``. The others come from a source written for the built-in tiny model (the
    #: defaults, or a file without ``model.path``); `pretrained_rates_problem` warns about those.
    _rates_chosen: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="before")
    @classmethod
    def _loss_defaults(cls, data: Any) -> Any:
        # A partial [loss] table overrides the trainer's defaults key by key (not LossConfig's).
        if isinstance(data, dict) and isinstance(data.get("loss"), dict):
            data = {**data, "loss": {**_LOSS_DEFAULTS, **data["loss"]}}
        return data

    @field_validator("loss")
    @classmethod
    def _trainer_loss(cls, v: LossConfig) -> LossConfig:
        problems = [
            f"{k} = {x!r} is not finite"
            for k, x in v.model_dump().items()
            if isinstance(x, float) and not math.isfinite(x)
        ]
        if v.policy == "custom":
            from echoloss.loss import POLICIES

            names = ", ".join(n for n in POLICIES if n != "custom")
            problems.append(
                "policy = 'custom' needs a policy function passed to echo_loss in Python, which "
                f"a config cannot name; choose a registered policy ({names}), or register yours "
                "by name with echoloss.loss.register_policy before calling train()"
            )
        if v.mode != "rl":
            problems.append("mode must be 'rl' (the warm-start uses SFT by itself)")
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.data.source == "jsonl" and self.warmup.steps:
            raise ValueError("warmup.steps must be 0 with data.source = 'jsonl' (no env to script)")
        if _is_import_path(self.advantages.fn) and not self.train.allow_import_paths:
            raise ValueError(_import_path_refused(self.advantages.fn))
        e = self.echo
        if e.schedule != "constant" and e.schedule_steps < 1:
            raise ValueError(
                f"echo.schedule_steps must be >= 1 for echo.schedule = {e.schedule!r} (the ramp's "
                f"length in RL steps), got {e.schedule_steps}"
            )
        from echoloss.schedules import unused_schedule_settings

        ignored = unused_schedule_settings(
            e.schedule, steps=e.schedule_steps, final_alpha=e.final_alpha
        )
        if ignored:
            raise ValueError(
                "echo."
                + ignored.replace("steps=", "schedule_steps=", 1).replace(
                    "schedule=", "echo.schedule="
                )
            )
        evaluate_only = self.model.path is not None and self.train.eval_at_start
        if self.warmup.steps == 0 and self.train.max_steps == 0 and not evaluate_only:
            raise ValueError(
                "warmup.steps and train.max_steps are both 0: nothing to train (to only "
                "evaluate a model, give model.path and train.eval_at_start = true)"
            )
        problems = size_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def physical_memory() -> int:
    """Bytes of physical memory of this machine (``2**40`` where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return 2**40


#: Bytes a sample (a rollout, a demonstration, a held-out conversation) takes at the least while
#: the trainer holds it: its messages, token ids and masks as Python objects (far more in fact).
BYTES_PER_HELD_SAMPLE = 1024
#: Bytes a parameter of the built-in model takes at the least in training (fp32 weight, its
#: gradient and AdamW's two moments).
BYTES_PER_TRAINED_PARAMETER = 16


def size_problems(cfg: TrainConfig, memory: int | None = None) -> list[str]:
    """Sizes the machine cannot hold: each problem names the field, its value and the bound.

    The bounds are lower bounds of what a run needs, so a refused config could not run: an
    episode that reaches ``env.max_turns`` assistant turns holds at least one token per turn,
    and a sample longer than ``data.max_tokens`` is an error (a turn limit above the token
    limit is one no episode may reach); a step holds ``prompts_per_step · group_size``
    rollouts (the warm-up ``demos_per_step`` demonstrations, the evaluation ``heldout_size``
    conversations) at `BYTES_PER_HELD_SAMPLE` each at the least; the built-in model's
    parameters take `BYTES_PER_TRAINED_PARAMETER` each. ``memory``: the machine's bytes
    (default `physical_memory`).

    Examples:
        >>> cfg = parse_config({"env": {"max_turns": 10**9}})
        Traceback (most recent call last):
        ...
        echoloss.train.config.ConfigError: invalid trainer config:
          env.max_turns = 1000000000: ...
    """
    memory = physical_memory() if memory is None else memory
    d, m = cfg.data, cfg.model
    out = []
    if cfg.env.max_turns is not None and cfg.env.max_turns > d.max_tokens:
        out.append(
            f"env.max_turns = {cfg.env.max_turns}: a conversation of that many assistant turns "
            f"takes at least {cfg.env.max_turns} tokens, more than data.max_tokens = "
            f"{d.max_tokens} (a longer sample is an error); set env.max_turns <= "
            f"{d.max_tokens}, or leave it unset"
        )
    held = {
        "data.prompts_per_step * data.group_size": d.prompts_per_step * d.group_size,
        "warmup.demos_per_step": cfg.warmup.demos_per_step,
        "data.heldout_size": d.heldout_size,
    }
    for name, samples in held.items():
        need = samples * BYTES_PER_HELD_SAMPLE
        if need > memory:
            out.append(
                f"{name} = {samples} samples need at least {need / 2**30:.3g} GiB held at once, "
                f"more than this machine's {memory / 2**30:.3g} GiB; lower it"
            )
    if m.path is None:
        h, i, layers = m.hidden_size, m.intermediate_size, m.num_layers
        params = layers * (4 * h * h + 3 * h * i) + 2 * h * m.max_position_embeddings
        need = params * BYTES_PER_TRAINED_PARAMETER
        if need > memory:
            out.append(
                f"model: hidden_size = {h}, intermediate_size = {i}, num_layers = {layers} make "
                f"about {params:.3g} parameters, whose training needs at least "
                f"{need / 2**30:.3g} GiB, more than this machine's {memory / 2**30:.3g} GiB; "
                "lower them"
            )
    return out


def advantage_fn(cfg: TrainConfig) -> str | Callable[..., Any]:
    """``cfg.advantages.fn`` as ``compute_advantages(fn=...)`` should get it: the registered
    name, or (only with ``train.allow_import_paths``) the imported function.

    Raises:
        ConfigError: an import path without the opt-in.
    """
    spec = cfg.advantages.fn
    if not _is_import_path(spec):
        return spec
    if not cfg.train.allow_import_paths:
        raise ConfigError("invalid trainer config:\n  " + _import_path_refused(spec))
    return resolve_advantage_fn(spec)


# The embedded default: what `echoloss-train` runs with no --config (mirrors configs/default.toml).
DEFAULT_TOML = """\
# echoloss-train embedded default: a tiny Qwen3-style model learns mirrorgrid (secretly mirrored
# controls) with GRPO + echo on CPU: 80 warm-start steps (SFT on demonstrations in the unmirrored
# world), then 60 RL steps of 4 prompts x 8 rollouts. configs/default.toml spells every key out.
[model]
arch = "qwen3"

[env]
demo_explore = 0.2   # demonstrations take a random move 20 % of the time (exploration)

[warmup]
steps = 80
lr = 1e-2

[echo]
# λ on the tool-observation bodies (0 = plain GRPO): a demo value that shows the echo term at
# work, not a recommendation (docs/experiment.md reports what λ did in its experiments).
alpha = 0.01

[optim]
lr = 1e-3

[data]
heldout_size = 64

[train]
max_steps = 60
eval_every = 20
grad_ratio_every = 1   # the RL and echo terms' gradient norms on every RL step (the console shows them)
threads = 1   # a tiny model runs fastest on one thread (two leave a core to the OS / a 2nd run)
"""


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
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
        # A check across sections names its keys itself (its location is the whole config).
        lines.append(f"  {key}: {msg}{suffix}" if key else f"  {msg}{suffix}")
    return "invalid trainer config:\n" + "\n".join(lines)


_RATES = ("warmup.lr", "optim.lr")


def _rates_set(data: Mapping[str, Any]) -> set[str]:
    """The learning rates (of `_RATES`) that ``data`` (a config table) sets."""
    found = set()
    for dotted in _RATES:
        section, key = dotted.split(".")
        table = data.get(section)
        if isinstance(table, Mapping) and key in table:
            found.add(dotted)
    return found


def _sets_model_path(data: Mapping[str, Any]) -> bool:
    model = data.get("model")
    return isinstance(model, Mapping) and model.get("path") is not None


def parse_config(data: Mapping[str, Any]) -> TrainConfig:
    """Validate a dict (a parsed TOML file); raises `ConfigError` naming every bad key.

    Learning rates the dict sets together with ``model.path`` count as chosen for that model
    (`pretrained_rates_problem`)."""
    chosen = _rates_set(data) if isinstance(data, Mapping) and _sets_model_path(data) else set()
    return _validate(data, chosen)


def _validate(data: Mapping[str, Any], rates_chosen: set[str]) -> TrainConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"invalid trainer config: expected a table of sections (a dict, or a TOML file via "
            f"load_config), got {type(data).__name__}"
        )
    train = data.get("train")
    allowed = train.get("allow_import_paths") if isinstance(train, Mapping) else False
    try:
        cfg = TrainConfig.model_validate(
            dict(data), context={"allow_import_paths": allowed is True}
        )
    except ValidationError as err:
        raise ConfigError(_format(err)) from None
    cfg._rates_chosen = frozenset(rates_chosen)
    return cfg


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
    validate. Learning rates set by an override, or by a file that sets ``model.path``, count as
    chosen for that model (`pretrained_rates_problem`); the embedded default's are the tiny
    model's.

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
    chosen = _rates_set(data) if _sets_model_path(data) else set()
    chosen |= {key for key in overrides or {} if key in _RATES}
    for key, value in (overrides or {}).items():
        _set(data, key, value)
    return _validate(data, chosen)
