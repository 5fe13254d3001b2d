"""The recipe: its schema, YAML loading and field-path errors.

A recipe that breaks the schema fails here, before any compute, with the field path, the bad value
and what is allowed. Flags from the command line are applied as dotted overrides and validated the
same way. What a recipe names outside itself (model directory, task, devices, installed packages)
is checked by orbit/run/preflight.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orbit.config.modes import MODE_NAMES, MODES
from orbit.config.task import BUILTIN_TASKS, BUILTINS, PatternTaskConfig, TaskConfig, TaskSection  # noqa: F401
from orbit.rl import AlgorithmConfig
from orbit.rl.config import recipe_section
from orbit.rl.presets import DEFAULT_PRESET

ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RecipeError(ValueError):
    """A recipe that cannot run. The message names the field, the value and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AdapterConfig(_Section):
    type: Literal["lora", "oft"] = Field(
        "lora", description="lora: a low-rank update; oft: an orthogonal rotation"
    )
    r: int = Field(8, ge=1, le=1024, description="LoRA rank")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scale = alpha / r)")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="adapter dropout while training (off when scoring)"
    )
    oft_block_size: int = Field(
        8, ge=2, le=1024, description="OFT block size (must divide in_features)"
    )
    target_modules: list[Literal[ADAPTER_TARGETS]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="the projections adapted, of every decoder layer",
    )


DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"


class EngineConfig(_Section):
    backend: Literal["auto", "embedded", "sglang", "sglang-server"] = Field(
        "auto",
        description="auto: sglang where it is installed and the engines are on GPUs (sglang-server "
        "when "
        "servers are given), else embedded",
    )
    max_inflight: int = Field(
        32, ge=1, le=4096, description="requests the producer keeps in flight, per engine"
    )
    max_running: int = Field(32, ge=1, le=4096, description="requests an engine decodes at once")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the engines' weights"
    )
    device: str = Field(
        "cpu", pattern=DEVICE_PATTERN, description="cpu or cuda:N, for every engine (or devices:)"
    )
    threads: int = Field(1, ge=1, le=256, description="torch threads of each engine process")
    borrow_cores: bool = Field(
        True,
        description="the embedded engine on this machine's CPU, with the trainer on it too: the "
        "engines also compute on the trainer's threads while it waits for a batch "
        "(bench/investigations/cores.py); SGLang fixes its threads when it starts",
    )
    replicas: int | None = Field(
        None,
        ge=1,
        le=64,
        description="engines in the pool; default: one per entry of devices, else 1",
    )
    devices: list[Annotated[str, Field(pattern=DEVICE_PATTERN)]] | None = Field(
        None,
        description="one device per engine, e.g. [cuda:1, cuda:2]; default: device for every "
        "engine",
    )
    flip: Literal["independent", "barrier"] = Field(
        "independent",
        description="independent: each engine loads and flips on its own and the trainer waits "
        "for none; barrier: pause all, load all, activate all, continue all while the trainer "
        "waits",
    )
    slots: int = Field(
        2,
        ge=2,
        le=16,
        description="adapter slots per engine, a ring (2: the classic double buffer)",
    )
    # sglang-server: servers Orbit starts (one per engine), or the ones given here (left running)
    servers: list[Annotated[str, Field(pattern=r"^https?://[^\s/]+/?$")]] | None = Field(
        None,
        description="sglang-server: attach to these running servers (one engine each) instead of "
        "starting any",
    )
    adapter_dir: Path | None = Field(
        None,
        description="a directory the servers read too: adapters reach servers "
        "on other hosts through it (peft format, written atomically)",
    )
    adapter_transport: Literal["auto", "local", "dir"] = Field(
        "auto",
        description="auto: local for servers on this host (adapter and weight files in Orbit's own "
        "directory in /dev/shm), dir (engine.adapter_dir) for the others",
    )
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="the name of an "
        "environment variable holding the servers' --api-key (never the key itself)",
    )
    mem_fraction: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="SGLang's --mem-fraction-static; default "
        "on a GPU shared with the trainer: computed from the model's size",
    )
    max_context: int | None = Field(
        None,
        ge=16,
        le=1 << 20,
        description="tokens per request (prompt + output); "
        "default min(the model's, 4096), or what a shared GPU's KV budget allows",
    )
    tp: int = Field(1, ge=1, le=64, description="SGLang's --tp-size (GPUs per engine)")
    restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="times an engine Orbit started is started again after it "
        "dies or hangs (waiting 1, 2, 4 ... s); attached servers are taken back once they answer "
        "again; 0: an engine that leaves the pool stays out",
    )
    sglang_args: dict[str, Any] = Field(
        default_factory=dict,
        description="further SGLang server arguments by "
        "ServerArgs name (e.g. {chunked_prefill_size: 512}), checked against "
        "SGLang's own parser at load; the ones Orbit sets are refused",
    )
    host: str = Field(
        "127.0.0.1",
        pattern=r"^[A-Za-z0-9.:\[\]-]+$",
        description="sglang-server: the address "
        "the servers Orbit starts listen on (this machine only unless set, e.g. 0.0.0.0)",
    )

    @model_validator(mode="after")
    def _replicas_and_devices(self) -> EngineConfig:
        if self.servers is not None:
            if self.backend not in ("sglang-server", "auto"):
                raise ValueError(
                    f"engine.servers: for engine.backend 'sglang-server', not {self.backend!r}"
                )
            if not self.servers:
                raise ValueError(
                    "engine.servers: empty; give the servers' URLs, or leave it unset to start "
                    "servers"
                )
            if self.devices is not None:
                raise ValueError(
                    "engine.devices: attached servers run where they run; set devices only for "
                    "servers Orbit starts (leave engine.servers unset)"
                )
            if self.replicas is not None and self.replicas != len(self.servers):
                raise ValueError(
                    f"engine.replicas: {self.replicas} for {len(self.servers)} engine.servers; one "
                    "engine per server (leave replicas unset)"
                )
        if (
            "borrow_cores" in self.model_fields_set
            and self.borrow_cores
            and self.backend in ("sglang", "sglang-server")
        ):
            raise ValueError(
                f"engine.borrow_cores: the embedded engine's; {self.backend}'s scheduler fixes its "
                "threads when it starts (leave it unset)"
            )
        if self.adapter_transport == "dir" and self.adapter_dir is None:
            raise ValueError("engine.adapter_transport: 'dir' needs engine.adapter_dir")
        if (
            self.devices is not None
            and self.replicas is not None
            and len(self.devices) != self.replicas
        ):
            raise ValueError(
                f"engine.devices: {len(self.devices)} device(s) for engine.replicas "
                f"{self.replicas}; give one device per engine (or leave replicas unset)"
            )
        if self.devices is not None and not self.devices:
            raise ValueError("engine.devices: empty; give one device per engine, or leave it unset")
        return self

    @property
    def engines(self) -> int:
        """How many engines the pool has."""
        return (
            len(self.servers)
            if self.servers
            else self.replicas or (len(self.devices) if self.devices else 1)
        )

    def engine_devices(self) -> list[str]:
        """The device of each engine of the pool."""
        return list(self.devices) if self.devices else [self.device] * self.engines


class RolloutConfig(_Section):
    group_size: int = Field(4, ge=2, le=1024, description="completions per prompt (GRPO group)")
    prompts_per_step: int = Field(
        4, ge=1, le=4096, description="groups per batch: one optimizer step's prompts"
    )
    max_new_tokens: int = Field(
        32, ge=1, le=32768, description="tokens a completion (an agent's call) may generate"
    )
    temperature: float = Field(
        1.0, gt=0.0, le=10.0, description="sampling temperature (the trainer scores with it)"
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="nucleus sampling (the trainer scores the truncated distribution)",
    )
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens; 0 = off")
    stop: list[str] = Field(
        default_factory=list,
        description="stop strings besides eos; each must be one token of the model's tokenizer",
    )
    replenish: bool = Field(
        True, description="submit a fresh prompt for every group dropped as stale"
    )
    max_attempts: int = Field(
        8, ge=1, le=1000, description="times a sample may be submitted (aborts resubmit it)"
    )
    stall_timeout_s: float = Field(
        600.0,
        gt=0,
        description="stop the run when no rollout arrives for this long while the trainer waits",
    )
    episode_timeout_s: float = Field(
        300.0, gt=0, description="agent tasks: an episode running longer is lost"
    )
    max_lost_frac: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="agent tasks: stop the run when more than this "
        "share of the episodes that ended since the last batch were lost (judged once a "
        "batch's worth ended)",
    )


class TrainerConfig(_Section):
    lr: float = Field(
        1e-3,
        ge=0.0,
        le=1.0,
        description="AdamW's learning rate (0: the adapter stays as "
        "initialised, a sweep's control run)",
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW's weight decay")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradients clipped to this norm")
    steps: int = Field(20, ge=1, description="batches to train on: the adapter's last version")
    save_every: int = Field(10, ge=1, description="checkpoint the adapter every N steps")
    keep_last: int = Field(
        3,
        ge=1,
        le=1000,
        description="checkpoints kept (RUN_DIR/checkpoints/step-N); "
        "RUN_DIR/adapter names the newest",
    )
    device: str = Field(
        "cpu", pattern=DEVICE_PATTERN, description="the trainer's device: cpu or cuda:N"
    )
    devices: list[Annotated[str, Field(pattern=DEVICE_PATTERN)]] | None = Field(
        None,
        description="one trainer rank per device of this host, e.g. [cuda:0, cuda:1] ([cpu, cpu]: "
        "two ranks "
        "on CPU, gloo); `orbit train` starts them through torch.distributed.run; default: [device]",
    )
    shard: Literal["none", "fsdp"] = Field(
        "none",
        description="with several ranks: none, every rank holds the "
        "whole base; fsdp, the frozen base is sharded over the ranks (FSDP2)",
    )
    rank_timeout_s: float = Field(
        60.0,
        gt=0.0,
        le=86400.0,
        description="with several ranks: a rank that stops "
        "answering this long stops the run on every rank (rank 0 saves the adapter)",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="the trainer's base weights (bfloat16 "
        "on a GPU halves them; adapter weights stay float32)",
    )
    threads: int = Field(1, ge=1, le=256, description="the trainer's torch threads")
    borrow_cores: bool = Field(
        True,
        description="on CPU, with the engines on this machine's CPU: the trainer also "
        "uses the engines' threads while they have nothing to generate (orbit/train/cores.py; "
        "bench/investigations/cores.py measured it faster on both engines)",
    )
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        description="padded tokens per forward/backward (samples of similar "
        "length together); 0 = the whole batch at once",
    )
    pack: bool = Field(
        True,
        description="in a sweep: runs whose batches are ready together take their steps in one "
        "forward/backward over the shared base (orbit/train/packed.py); false: one run at a time",
    )
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="the learning rate over the run: constant, or decaying to 0 at the last step "
        "(linear, cosine), after the warm-up",
    )
    warmup_steps: int = Field(
        0, ge=0, description="steps over which the learning rate rises linearly to lr"
    )

    @model_validator(mode="after")
    def _ranks(self) -> TrainerConfig:
        if self.devices is None:
            return self
        if not self.devices:
            raise ValueError("trainer.devices: empty; give one device per rank, or leave it unset")
        if "device" in self.model_fields_set:
            raise ValueError(
                "trainer.devices: set trainer.device (one rank) or trainer.devices (one rank "
                "each), not both"
            )
        if len({d == "cpu" for d in self.devices}) > 1:
            raise ValueError(
                f"trainer.devices: {self.devices} mixes CPU and GPUs; the ranks all use one kind"
            )
        twice = sorted({d for d in self.devices if d != "cpu" and self.devices.count(d) > 1})
        if twice:
            raise ValueError(
                f"trainer.devices: {twice[0]} is listed more than once; one rank per GPU"
            )
        return self

    def rank_devices(self) -> list[str]:
        """The device of each trainer rank on this host."""
        return list(self.devices) if self.devices else [self.device]


class ServedModel(_Section):
    model: Path = Field(..., description="its local checkpoint directory")
    names: list[str] = Field(
        default_factory=list, description="what Tinker clients may call it besides its path"
    )
    engine: EngineConfig | None = Field(
        None, description="its engines; unset: the recipe's engine: section"
    )


class ServeConfig(_Section):
    names: list[str] = Field(
        default_factory=list,
        description="what Tinker clients may call the recipe's model: besides its path (e.g. "
        "HuggingFaceTB/SmolLM2-135M-Instruct, for tinker-cookbook's model table)",
    )
    models: list[ServedModel] = Field(
        default_factory=list,
        description="`orbit serve`: more base models beside model:, each `{model: DIR, names: "
        "[...], engine: {...}}` (engine unset: this recipe's), with its own engines and its own "
        "copy in the trainer (a teacher, a grader or a reference beside the student)",
    )

    @model_validator(mode="after")
    def _one_model_a_name(self) -> ServeConfig:
        seen: dict[str, str] = {}
        lists = [("serve.names", self.names)]
        lists += [(f"serve.models[{i}].names", m.names) for i, m in enumerate(self.models)]
        for where, names in lists:
            for name in names:
                if not name.strip():
                    raise ValueError(f"{where}: an empty name")
                if name in seen:
                    raise ValueError(
                        f"{where}: {name!r} is also in {seen[name]}; a name names one model"
                    )
                seen[name] = where
        return self


class Recipe(_Section):
    model: Path = Field(
        ..., description="a local checkpoint directory (config.json, safetensors, tokenizer)"
    )
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = Field(
        default_factory=lambda: AlgorithmConfig.model_validate(recipe_section(None)),
        description=f"the estimator, loss and filters; unset: preset {DEFAULT_PRESET}",
    )
    task: TaskSection = Field(default_factory=PatternTaskConfig)
    mode: Literal[MODE_NAMES] = Field(  # type: ignore[valid-type]  # the names from modes.py
        "double-buffer",
        description="the loop and the push (docs/design.md §1)",
    )
    max_staleness: int | None = Field(
        1, ge=0, description="drop groups older than this many steps and replenish; null = keep all"
    )
    seed: int = Field(0, description="the adapter's init, the prompt stream, every sample's seed")
    out: Path = Field(Path("runs/latest"), description="the run directory")
    serve: ServeConfig = Field(
        default_factory=ServeConfig, description="`orbit serve`: the names and models it serves"
    )
    logging: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="trackers each step also goes to (metrics.jsonl always has it): "
        "tensorboard (RUN_DIR/tensorboard), wandb (RUN_DIR/wandb; WANDB_MODE=offline works); [] = "
        "none",
    )

    def bases(self) -> list[tuple[Recipe, list[str]]]:
        """`orbit serve`'s base models, each as a recipe of its own with the names clients may
        call it: this recipe's model:, then each of serve.models (with its engine: section, or
        this recipe's)."""
        bases = [(self, list(self.serve.names))]
        for more in self.serve.models:
            update = {"model": more.model, "engine": more.engine or self.engine}
            bases.append((self.model_copy(update=update, deep=True), list(more.names)))
        return bases

    @field_validator("algorithm", mode="before")
    @classmethod
    def _default_preset(cls, data: Any) -> Any:
        return recipe_section(data)

    @model_validator(mode="after")
    # twice: two writers into one directory, every step logged twice
    def _unique_logging(self) -> Recipe:
        twice = sorted({t for t in self.logging if self.logging.count(t) > 1})
        if twice:
            raise ValueError(
                f"logging: {twice[0]!r} is listed more than once; name each tracker once"
            )
        return self

    @model_validator(mode="after")
    def _algorithm(self) -> Recipe:
        algo, rollout = self.algorithm, self.rollout
        if (
            algo.overlong == "penalty"
            and algo.buffer(rollout.max_new_tokens) >= rollout.max_new_tokens
        ):
            why = " (the dapo preset, the default, sets it)" if algo.preset == "dapo" else ""
            raise ValueError(
                f"algorithm.overlong_buffer: {algo.buffer(rollout.max_new_tokens)} tokens leaves "
                f"no length unpunished under rollout.max_new_tokens {rollout.max_new_tokens}; set "
                f"a smaller buffer or a larger max_new_tokens, or algorithm.overlong: none to "
                f"drop the overlong penalty{why}"
            )
        if algo.minibatches > rollout.prompts_per_step:  # each mini-batch holds whole groups
            raise ValueError(
                f"algorithm.minibatches: {algo.minibatches} mini-batches of "
                f"{rollout.prompts_per_step} groups (rollout.prompts_per_step); each needs a group"
            )
        return self

    @model_validator(mode="after")
    def _sharded(self) -> Recipe:
        if self.trainer.shard == "fsdp" and MODES[self.mode].push == "full":
            raise ValueError(
                f"trainer.shard: fsdp spreads the base over the ranks, but mode {self.mode!r} "
                "pushes the whole model (the base merged with the adapter); use an adapter mode "
                "(sync-adapter, async-adapter, double-buffer) or trainer.shard: none"
            )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        if self.engine.max_inflight < self.rollout.group_size:
            # The producer submits whole groups; fewer slots than one group never completes one.
            raise ValueError(
                f"engine.max_inflight ({self.engine.max_inflight}) must be >= rollout.group_size "
                f"({self.rollout.group_size}), else no group ever completes"
            )
        screen = self.algorithm.screen
        if screen is not None and screen >= self.rollout.group_size:
            raise ValueError(
                f"algorithm.screen ({screen}): the samples generated first must be fewer than "
                f"rollout.group_size ({self.rollout.group_size})"
            )
        if screen is not None and MODES[self.mode].serial:
            # Probes run outside the step's grants; a serial step must end with nothing in flight
            # (the engine releases its memory while the trainer trains).
            overlapped = ", ".join(m.name for m in MODES.values() if not m.serial)
            raise ValueError(
                f"algorithm.screen: staged sampling's probes run beside the trainer; mode "
                f"{self.mode!r} is serial (use one of {overlapped})"
            )
        if (
            self.max_staleness is not None
            and not self.rollout.replenish
            and MODES[self.mode].loop == "overlapped"
        ):
            # Dropped groups would not be replaced: the pipeline drains and the trainer waits
            # forever. (Serial modes never drop: their batches are always fresh.)
            raise ValueError(
                "rollout.replenish: false with max_staleness set would, in the overlapped mode "
                f"{self.mode!r}, drop stale groups without replacing them and hang the trainer; "
                "set rollout.replenish: true or max_staleness: null"
            )
        return self


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _task_loc(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], str | None]:
    """A task option's location without the union's tag (`task.arith.colour` → `task.colour`), and
    the task."""
    if len(loc) >= 2 and loc[0] == "task" and (loc[1] in BUILTINS or loc[1] == "user"):
        return (loc[0], *loc[2:]), str(loc[1])
    return loc, None


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where, task = _task_loc(e["loc"])
        loc = _fmt_loc(where)
        if task in BUILTINS and e["type"] in ("extra_forbidden", "missing"):
            options = ", ".join(k for k in BUILTINS[task].model_fields if k != "name")
            what = "unknown key" if e["type"] == "extra_forbidden" else "required"
            lines.append(f"{loc}: {what} for task {task!r} (its options: {options})")
            continue
        value = e.get("input")
        if not e["loc"]:  # a cross-field rule: its message names the fields itself
            lines.append(e["msg"].removeprefix("Value error, "))
        elif e["type"] == "extra_forbidden" and loc == "trainer.loss":
            lines.append(
                "trainer.loss: the loss moved to the recipe's own `algorithm:` section (ratio, "
                "truncate_max, kl_coef as they were; clip_eps is now clip_eps_low and "
                "clip_eps_high)"
            )
        elif e["type"] == "extra_forbidden" and loc == "runs":
            lines.append(
                "runs: this recipe lists the runs of a sweep; start it with `orbit sweep RECIPE`"
            )
        elif e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key (value {value!r})")
        elif e["type"] == "missing":
            lines.append(f"{loc}: required field is missing")
        elif e["type"] == "value_error":  # a section's own rule: its message names the field
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(msg if msg.startswith(loc) else f"{loc}: {msg}")
        else:
            lines.append(f"{loc}: {e['msg']} (got {value!r})")
    return "\n".join(lines)


def parse_recipe(data: Any) -> Recipe:
    """Validate a recipe dict against the schema. Raises RecipeError with every bad field listed.
    What the recipe names outside itself (the model, the task, devices, installs) is checked by
    `orbit.run.preflight`."""
    if not isinstance(data, dict):
        raise RecipeError(f"recipe must be a mapping of sections, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_explain(err)) from None


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """Read a YAML recipe, apply dotted overrides (`{"trainer.steps": 5}`), validate."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {str(path)!r}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    data = data if data is not None else {}
    for dotted, value in (overrides or {}).items():
        if value is not None:
            set_dotted(data, dotted, value)
    return parse_recipe(data)


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """`data[a][b] = value` for `dotted` "a.b", creating sections on the way."""
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise RecipeError(f"{dotted}: cannot override inside a non-mapping value")
    node[leaf] = value


def dump_recipe(recipe: Recipe) -> str:
    return str(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
