"""Training clients: each a LoRA adapter on the one base the service holds (orbit/train/shared.py,
as a sweep's runs share theirs), with its own AdamW. `forward_backward` adds gradients until
`optim_step` applies them with the request's Adam parameters and clears them; `forward_only` changes
nothing.

A client's adapter: rank from the request, alpha ALPHA (the SDK cannot send one), targets from its
train_attn (q, k, v, o), train_mlp (gate, up, down) and train_unembed (the output projection), B = 0
at the start so that it is the base model until its first step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from torch import Tensor

from orbit.serve import losses
from orbit.serve.futures import Refused
from orbit.serve.wire import Datum
from orbit.train import peft_adapter, state
from orbit.train.packing import Route, Router
from orbit.train.sequences import micro_batches, target_logprobs
from orbit.train.shared import SharedBase

ALPHA = 32  # LoRA alpha of every client (docs/tinker.md): Tinker's, which the SDK cannot set
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
UNEMBED = ["lm_head"]
LOSSES_KEPT = 500  # a client's newest forward_backward losses, for the page
MICRO_BATCH_TOKENS = 4096  # padded tokens per forward/backward: memory bounded whatever the batch


class ClientError(Refused):
    """What a client asked that Orbit will not do (a refusal: nothing changed)."""


@dataclass(frozen=True)
class LoraSpec:
    """A client's LoRA, as `create_model`'s lora_config asks for it."""

    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def targets(self) -> list[str]:
        return (
            (ATTN if self.train_attn else [])
            + (MLP if self.train_mlp else [])
            + (UNEMBED if self.train_unembed else [])
        )

    def config(self) -> peft.LoraConfig:
        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=ALPHA,
            lora_dropout=0.0,
            target_modules=self.targets(),
            task_type="CAUSAL_LM",
        )


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping

    def check(self) -> None:
        values = (self.learning_rate, self.beta1, self.beta2, self.eps, self.weight_decay)
        if not all(math.isfinite(v) for v in (*values, self.grad_clip_norm)):
            raise ClientError(f"adam_params: a value is not finite ({self})")
        if self.learning_rate < 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ClientError(
                f"adam_params: learning_rate, eps, weight_decay out of range ({self})"
            )
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0) or self.grad_clip_norm < 0:
            raise ClientError(
                f"adam_params: betas must lie in [0, 1), grad_clip_norm >= 0 ({self})"
            )


@dataclass
class Request:
    """One forward or forward_backward request of a training client."""

    client: TrainingClient
    data: list[Datum]
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool

    def tokens(self) -> int:
        """The tokens its pass runs: a soft-target datum's once per column."""
        return sum(len(d.tokens) * len(_columns(self.loss_fn, d)) for d in self.data)


@dataclass
class Scored:
    """What forward_backward gives back: each datum's target logprobs, and the summed loss."""

    logprobs: list[Tensor]
    loss: float


class TrainingClient:
    """One adapter (`name`, peft's) on `base`, and its optimizer."""

    def __init__(self, model_id: str, name: str, base: SharedBase, spec: LoraSpec) -> None:
        self.model_id, self.name, self.base, self.spec = model_id, name, base, spec
        missing = [t for t in spec.targets() if not _present(base, t)]
        if missing:
            raise ClientError(f"lora_config: the base model has no {missing[0]} to adapt")
        generator_state = torch.get_rng_state()
        torch.manual_seed(spec.seed if spec.seed is not None else torch.seed())
        self.params = base.add(name, spec.config())  # LoRA A random, B zero (peft's init)
        torch.set_rng_state(generator_state)
        self.optimizer = torch.optim.AdamW(self.params, lr=0.0)
        self.steps = 0  # optimizer steps taken
        self.losses: deque[float] = deque(maxlen=LOSSES_KEPT)  # forward_backward's, newest last
        self.vocab = base.base.config.vocab_size

    # -- training --------------------------------------------------------------------------

    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: dict[str, float | str], forward_only: bool
    ) -> Scored:
        """Every datum's target logprobs and loss; unless `forward_only`, the loss's gradient added
        to the adapter's. A bad request is refused (ClientError) before anything is computed. A
        pass of its own over the base (peft's forward); `forward_backward` packs several."""
        return forward_backward(
            self.base, [Request(self, data, loss_fn, config, forward_only)], packed=False
        )[0]

    def check(
        self, data: list[Datum], loss_fn: str, config: dict[str, float | str]
    ) -> list[list[int]]:
        """Refuse (ClientError, naming the datum and field) what forward_backward cannot use; each
        datum's target tokens otherwise. Nothing is computed."""
        if loss_fn in losses.LOSSES[1:]:
            losses.algorithm(loss_fn, config)  # refuses clip bounds that mean nothing
        elif config:
            raise ClientError(f"loss_fn_config: {sorted(config)[0]!r} is not one {loss_fn} takes")
        if not data:
            raise ClientError("forward_backward: no datums (an empty batch)")
        targets = []
        for i, d in enumerate(data):
            where = f"datum {i}"
            if not d.tokens:
                raise ClientError(f"{where}: model_input has no tokens")
            losses.check(loss_fn, d.inputs, len(d.tokens), where)
            t = d.inputs["target_tokens"].to(torch.int64)
            for what, ids in (("model_input", d.tokens), ("target_tokens", t.flatten().tolist())):
                bad = [x for x in ids if not 0 <= x < self.vocab]
                if bad:
                    raise ClientError(
                        f"{where}: {what} has token id {bad[0]}, outside the vocabulary "
                        f"(0..{self.vocab - 1})"
                    )
            targets.append(t.tolist())
        # one output record holds every datum's logprobs, [N] or [N, K] for all of them alike
        kinds = {losses.columns(loss_fn, d.inputs) for d in data}
        if len(kinds) > 1:
            raise ClientError(
                f"forward_backward: soft targets of {sorted(kinds)} columns (0: one a position) in "
                "one request; send datums of one width together"
            )
        return targets

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Apply the gradients added since the last step with `adam`'s parameters, then clear them.
        A non-finite gradient norm is refused: the adapter and the optimizer stay as they were."""
        adam.check()
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if grads
            else 0.0
        )
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise ClientError(f"optim_step: the gradient norm is {norm}; the step is not made")
        if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
            for g in grads:
                g.mul_(adam.grad_clip_norm / (norm + 1e-6))
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": norm}

    # -- weights ---------------------------------------------------------------------------

    def adapter(self) -> tuple[dict[str, Tensor], dict]:
        """A copy of the adapter as the engines take it: peft's tensors and config (a snapshot:
        later steps do not change it)."""
        model = self._peft()
        # CPU copies (adapter_tensors), as every engine and a checkpoint's file take them
        tensors = peft_adapter.adapter_tensors(model, self.name)
        return tensors, peft_adapter.adapter_config_dict(model, self.name)

    def save(self, directory: Path, optimizer: bool) -> None:
        """The adapter in peft's format (what `orbit eval` and peft load), and with `optimizer` its
        state too, into `directory` (the caller writes it whole: orbit/host/files.py)."""
        opt = self.optimizer.state_dict() if optimizer else {}
        state.write(directory, self._peft(), self.name, opt, {"steps": self.steps})

    def load(self, directory: Path, optimizer: bool) -> None:
        """What `save` wrote: the adapter, and with `optimizer` the optimizer's state and step
        count."""
        try:
            saved = state.read(directory, self._peft(), self.name)
        except ValueError as err:
            raise ClientError(str(err)) from None
        with torch.no_grad():
            peft.set_peft_model_state_dict(self._peft(), saved.weights, adapter_name=self.name)
        if optimizer:
            if not saved.optimizer:
                raise ClientError(f"{directory}: holds no optimizer state (a sampler's weights)")
            self.optimizer.load_state_dict(saved.optimizer)
            self.steps = int(saved.state.get("steps", 0))
        for p in self.params:
            p.grad = None

    def _peft(self) -> peft.PeftModel:
        assert self.base.model is not None  # it holds this client's adapter
        return self.base.model


def _present(base: SharedBase, target: str) -> bool:
    return any(name.rpartition(".")[2] == target for name, _ in base.base.named_modules())


def forward_backward(base: SharedBase, requests: list[Request], packed: bool) -> list[Scored]:
    """Each request's Scored, computed in passes over `base` of at most MICRO_BATCH_TOKENS padded
    tokens; each loss's gradient added to its own client's adapter (unless forward_only, which all
    of them are or none). `packed`: the requests' rows share each pass, each under its own adapter
    (orbit/train/packing.py); otherwise one request, in a turn of its own. Every request is checked
    before anything is computed: a refusal (ClientError) computes nothing for any of them."""
    forward_only = requests[0].forward_only
    assert all(r.forward_only == forward_only for r in requests), "one kind a pack"
    assert packed or len(requests) == 1, "requests share a pass only when packed"
    targets = [r.client.check(r.data, r.loss_fn, r.config) for r in requests]
    cfgs = [
        None if r.loss_fn == "cross_entropy" else losses.algorithm(r.loss_fn, r.config)
        for r in requests
    ]
    # a scored row per datum, or per column of a soft-target datum's [N, K] (k; None: no columns)
    where = [
        (r, d, k)
        for r, req in enumerate(requests)
        for d, datum in enumerate(req.data)
        for k in _columns(req.loss_fn, datum)
    ]
    rows = [requests[r].data[d].tokens for r, d, _ in where]
    names = [requests[r].client.name for r, _, _ in where]
    # each datum's logprobs by column (None: its only one), whatever order the rows ran in
    out: list[list[dict[int | None, Tensor]]] = [[{} for _ in r.data] for r in requests]
    totals = [0.0] * len(requests)
    model = base.base
    with _on(base, names, packed) as router, torch.set_grad_enabled(not forward_only):
        for chunk in micro_batches(
            rows,
            MICRO_BATCH_TOKENS,
            names if packed else None,
        ):
            on_cpu = [losses.column(_datum(requests, where[i]).inputs, where[i][2]) for i in chunk]
            logp = target_logprobs(
                model.model,
                model.get_output_embeddings(),
                [rows[i] for i in chunk],
                [_column(targets[where[i][0]][where[i][1]], where[i][2]) for i in chunk],
                [
                    losses.weighted(requests[where[i][0]].loss_fn, x)
                    for i, x in zip(chunk, on_cpu, strict=True)
                ],
                Route(router, [names[i] for i in chunk]) if router is not None else None,
            )
            inputs = [_to(x, base.device) for x in on_cpu]
            datums = [
                losses.datum_loss(
                    requests[where[i][0]].loss_fn,
                    logp[row, : len(rows[i])],
                    inputs[row],
                    cfgs[where[i][0]],
                )
                for row, i in enumerate(chunk)
            ]
            per_datum = torch.stack(datums)
            loss = per_datum.sum()
            # back to the CPU once a pass (on a GPU each .cpu() or float() waits for it)
            values, logp_cpu = per_datum.detach().cpu().tolist(), logp.detach().cpu()
            for row, i in enumerate(chunk):
                r, d, k = where[i]
                totals[r] += values[row]
                out[r][d][k] = logp_cpu[row, : len(rows[i])]
            # a chunk whose every weight (advantage) is 0 has no gradient to add
            if not forward_only and loss.requires_grad:
                loss.backward()
    if not forward_only:
        for r, req in enumerate(requests):
            req.client.losses.append(totals[r])
    return [
        Scored(
            [
                _joined(cols, requests[r].loss_fn, req)
                for cols, req in zip(out[r], requests[r].data, strict=True)
            ],
            totals[r],
        )
        for r in range(len(requests))
    ]


def forward_backward_checked(base: SharedBase, requests: list[Request]) -> list[Scored | Refused]:
    """A pack of one kind's requests (orbit/serve/training.py): each checked again, a refusal
    its own answer, the rest computed together (`forward_backward`, packed when several)."""
    refused: dict[int, Refused] = {}
    for i, r in enumerate(requests):
        try:
            r.client.check(r.data, r.loss_fn, r.config)
        except Refused as err:  # ClientError, losses.LossError
            refused[i] = err
    good = [r for i, r in enumerate(requests) if i not in refused]
    scored = iter(forward_backward(base, good, len(good) > 1) if good else [])
    return [refused[i] if i in refused else next(scored) for i in range(len(requests))]


def _to(inputs: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """A datum's inputs (decoded on the CPU) where the trainer computes."""
    return {name: t.to(device) for name, t in inputs.items()}


def _datum(requests: list[Request], at: tuple[int, int, int | None]) -> Datum:
    return requests[at[0]].data[at[1]]


def _columns(loss_fn: str, datum: Datum) -> list[int | None]:
    """The rows a datum is scored as: itself, or each column of its soft targets."""
    k = losses.columns(loss_fn, datum.inputs)
    return list(range(k)) if k else [None]


def _column(targets: list, k: int | None) -> list[int]:
    return targets if k is None else [row[k] for row in targets]


def _joined(columns: dict[int | None, Tensor], loss_fn: str, datum: Datum) -> Tensor:
    """A datum's logprobs from its scored rows: [N], or [N, K] for soft targets."""
    k = losses.columns(loss_fn, datum.inputs)
    return torch.stack([columns[c] for c in range(k)], dim=1) if k else columns[None]


@contextmanager
def _on(base: SharedBase, names: list[str], packed: bool) -> Iterator[Router | None]:
    """The base for these rows' adapters: packed (yields the router), or the one's turn (None)."""
    if packed:
        with base.pack(list(dict.fromkeys(names))) as router:
            yield router
    else:
        with base.turn(names[0]):
            yield None
