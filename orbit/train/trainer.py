"""The trainer: a Hugging Face causal LM wrapped with a peft adapter, one version per batch.

Only the adapter trains; the base stays frozen in fp32. Logprobs are those of the distribution
the engine samples from, log_softmax(logits / T) truncated to top-k/top-p and renormalised when
those are set (orbit/rl/truncation.py): the same distribution the engine reports, so the two compare
token by token and the loss differentiates the policy that was actually sampled from.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from statistics import fmean
from typing import Any

import peft
import torch
from torch import Tensor
from transformers import set_seed

from orbit.config import AdapterConfig, Recipe, TrainerConfig
from orbit.host.threads import compute_threads
from orbit.rl import AlgorithmConfig, Norm, policy_loss
from orbit.rollout.sample import Sample
from orbit.train import peft_adapter as adapters
from orbit.train import state
from orbit.train.batch import (
    MAX_BUCKETS,
    Batch,
    bucket_cost,
    collate,
    micro_batches,
    minibatches,
    output_hidden,
    spread_over_groups,
    token_logprobs,
)
from orbit.train.cores import Cores
from orbit.train.measure import StepResult, Totals, matmul_params, saved_rows
from orbit.train.ranks import Alone, RankLost, Ranks
from orbit.train.schedule import scheduler
from orbit.train.shared import SharedBase
from orbit.train.state import DEFAULT_ADAPTER

SNAPSHOTS = 4  # adapter versions kept to re-score stale samples with the weights that made them
# The engine-agreement re-score of a step without fresh samples is one more no-grad forward, whose
# cost is its decoder tokens: each group's prompt once, each sample's outputs. RESCORE_GROUPS of the
# step's groups, their place in the batch moving on by as many each version (so no place, such as
# the batch's first group, is the only one ever measured), and up to RESCORE_SAMPLES samples of
# them, round-robin: about 0.10-0.13 of a laptop step alone, where 8 samples over all 4 groups took
# about 0.17 (bench/investigations/trainer.md, "Where a trainer step goes").
RESCORE_GROUPS = 2
RESCORE_SAMPLES = 4


def rescore_choice(samples: list[Sample], version: int) -> list[Sample]:
    """The samples the agreement re-score takes at `version`, of those it can score."""
    return spread_over_groups(
        samples, RESCORE_SAMPLES, RESCORE_GROUPS, first=version * RESCORE_GROUPS
    )


def _keep(samples: list[Sample], logp: Tensor) -> None:
    """Each sample's trainer logprobs, as measured against the engine's (samples.jsonl shows where
    they differ)."""
    rows = logp.detach().cpu()
    for row, s in enumerate(samples):
        s.trainer_logprobs = rows[row, : len(s.output_ids)].tolist()


def recipe_trainer(
    recipe: Recipe,
    ranks: Ranks | None = None,
    shared: SharedBase | None = None,
    name: str = DEFAULT_ADAPTER,
) -> Trainer:
    """The trainer a recipe asks for: its adapter, optimizer, schedule and loss, scoring as its
    rollouts sample."""
    r = recipe.rollout
    return Trainer(
        recipe.model,
        recipe.adapter,
        recipe.trainer,
        r.temperature,
        recipe.seed,
        top_p=r.top_p,
        top_k=r.top_k,
        ranks=ranks,
        shared=shared,
        name=name,
        algorithm=recipe.algorithm,
        max_new_tokens=r.max_new_tokens,
    )


class Trainer:
    """Trains a LoRA or OFT adapter on scored samples (see `step`). Composed of its base (`shared`:
    its own, or a sweep's shared by every run) and its ranks (`ranks`: `Alone`, or one of several
    trainer ranks, ranks.py, where rank 0's `step`, `logprobs` and `load` make the other ranks, in
    `follow`, do the same)."""

    def __init__(
        self,
        model_path: str | Path,
        adapter: AdapterConfig,
        cfg: TrainerConfig,
        temperature: float,
        seed: int,
        top_p: float = 1.0,
        top_k: int = 0,
        ranks: Ranks | None = None,
        shared: SharedBase | None = None,
        name: str = DEFAULT_ADAPTER,
        algorithm: AlgorithmConfig | None = None,
        max_new_tokens: int = 1,
    ) -> None:
        """`algorithm`: the loss and its optimizer steps (default: Orbit's default loss);
        `max_new_tokens`: the rollout's, seq-mean-token-sum-norm's default constant."""
        # The engine runs in its own process with its own threads; don't let torch take every core.
        compute_threads(cfg.threads)
        self.cfg = cfg
        self.algo = algorithm or AlgorithmConfig()
        self.norm_length = self.algo.norm(max_new_tokens)
        self.adapter = adapter
        self.ranks: Ranks | Alone = ranks or Alone(cfg.device)
        self._closed = False
        self.device = self.ranks.device
        # Temperature 0 means greedy on the engine, which then reports temperature-1 untruncated
        # logprobs.
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_p, self.top_k = (top_p, top_k) if temperature > 0 else (1.0, 0)
        # A sweep's runs share one base (shared.py); a single run has one of its own.
        self.shared = shared or SharedBase(model_path, cfg.dtype)
        self.name = name
        base = self.shared.base
        # python, numpy, torch: the adapter's init is random (LoRA A), the same in a sweep or alone
        set_seed(seed)
        self.params = self.shared.add(name, adapters.peft_config(adapter, base))
        assert self.shared.model is not None  # it holds this adapter now
        self.model: peft.PeftModel = self.shared.model
        # The decoder stack (with its final norm) and the output projection, run apart (batch.py).
        self._decoder = base.model
        self._head = base.get_output_embeddings().weight
        # the weights a token's forward multiplies by, counted before sharding: FLOP counts
        self.matmul_params = matmul_params(base)
        self._sharded = cfg.shard == "fsdp" and self.ranks.world > 1
        # Outputs in passes of similar lengths (batch.length_buckets), measured on a CPU; not on a
        # GPU, whose fixed cost of a pass is another matter: one pass there. FSDP ranks must make
        # the same forward calls: one pass too.
        on_cpu = torch.device(self.device).type == "cpu"
        self.buckets = MAX_BUCKETS if on_cpu and not self._sharded else 1
        layers = self._decoder.layers
        self.bucket_cost = bucket_cost(sum(p.numel() for p in layers.parameters()) / len(layers))
        if self._sharded:
            # The head is frozen and often tied to the (sharded) embedding: every rank keeps it
            # whole.
            self._head = self._head.detach().clone().to(self.device)
            self.ranks.shard_base(self._decoder, self.params)
        self.model.to(self.device)
        self.ranks.broadcast_params(self.params)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = scheduler(
            self.optimizer, self.algo.optimizer_steps, cfg.steps, cfg.warmup_steps, cfg.schedule
        )
        self.pad_id = base.config.pad_token_id or 0
        self.version = 0
        self._snapshots: dict[int, list[Tensor]] = {}
        self._snapshot()
        self.cores: Cores | None = None
        self._flops = 0.0

    def share_cores(self, cores: Cores) -> None:
        """Borrow the engines' threads while they are idle (cores.py): checked at every layer and
        micro-batch."""
        self.cores = cores
        cores.hook(self._decoder.layers)

    # -- training ---------------------------------------------------------------------------

    def step(self, samples: list[Sample]) -> StepResult:
        """One optimizer step on the batch, in micro-batches of at most `cfg.micro_batch_tokens`
        padded tokens (batch.py); with ranks, each on its share and the gradients summed."""
        if not samples:
            raise ValueError("step needs at least one sample")
        self.ranks.send("step", samples)
        if self.shared.packer is not None:  # a sweep's: with the other runs' steps ready now
            return self.shared.packer.step(self, samples)
        # after the adapters (of a sweep) that asked first
        with self.shared.turn(self.name) as waited:
            result = self._step(samples)
        result.queue_s = waited
        return result

    def _step(self, samples: list[Sample]) -> StepResult:
        """`algorithm.epochs` passes over the batch, each in `algorithm.minibatches` optimizer
        steps; the adapter becomes one version newer whatever their number. With more than one, the
        policy before the first is scored once (one no-grad forward): the decoupled loss's proximal
        policy, and the engine agreement."""
        totals = Totals()
        self._flops = 0.0
        several = self.algo.optimizer_steps > 1
        before = self._state() if several else None
        prox = self._proximal(samples, totals) if several else None
        norms, lr = [], 0.0
        try:
            for _ in range(self.algo.epochs):
                for part in minibatches(samples, self.algo.minibatches):
                    lr = self.optimizer.param_groups[0]["lr"]
                    norms.append(self._optimizer_step(part, totals, prox, measure=not several))
        except FloatingPointError:
            if before is not None:  # no half-trained batch: the adapter stays at its version
                self._set_state(before)
            raise
        return self._finish(totals, norms, len(samples), lr)

    def _finish(self, totals: Totals, norms: list[float], samples: int, lr: float) -> StepResult:
        """The adapter one version newer, kept; the step's figures."""
        self.version += 1
        self._snapshot()
        result = totals.result(
            self.version, fmean(norms), samples, len(norms), lr, self.algo.epochs
        )
        result.flops = self._flops
        result.borrowed_frac = self.cores.take_share() if self.cores is not None else 0.0
        return result

    def _optimizer_step(
        self, samples: list[Sample], totals: Totals, prox: dict[int, Tensor] | None, measure: bool
    ) -> float:
        """One optimizer step on `samples` (the batch, or one of its mini-batches), in micro-batches
        of at most `cfg.micro_batch_tokens` padded tokens (batch.py); with ranks, each on its share,
        the gradients summed. `measure`: this forward is the step's engine agreement (its weights
        are those that made fresh samples)."""
        norm = self._start_step(samples)
        step = Totals()
        for chunk, counts in self._micro_batches(samples):
            batch = self._collate(chunk)
            logp, entropy = self._logprobs(batch, entropy_grad=self.algo.entropy_coef > 0)
            self._chunk_loss(
                chunk, counts, batch, logp, entropy, norm, prox, step, measure
            ).backward()
        return self._end_step(samples, step, totals, measure)

    def _start_step(self, samples: list[Sample]) -> Norm:
        """Before an optimizer step's forwards: training mode, no gradient; the normaliser."""
        if not self.model.training:  # every switch goes through the peft model: its flag is true
            self.model.train()  # a walk over every module: a few ms a step on a small model
        self.optimizer.zero_grad(set_to_none=True)
        return self._norm(samples)  # the whole share's counts, on every rank

    def _chunk_loss(
        self,
        chunk: list[Sample],
        counts: bool,
        batch: Batch,
        logp: Tensor,
        entropy: Tensor,
        norm: Norm,
        prox: dict[int, Tensor] | None,
        step: Totals,
        measure: bool,
    ) -> Tensor:
        """A micro-batch's loss, to backward (a pad's, FSDP: times 0), its figures added to
        `step`."""
        ref = self._ref_logprobs(batch) if self.algo.kl_coef > 0 else None
        loss, stats = policy_loss(
            logp,
            batch.behaviour,
            batch.advantages,
            batch.loss_mask,
            self.algo,
            norm,
            ref_logp=ref,
            prox_logp=saved_rows(prox, chunk, logp) if prox else None,
            entropy=entropy,
        )
        # a pad (FSDP): its forward and backward are collectives, its loss is not ours
        if not counts:
            return loss * 0.0
        step.add(loss, stats, (logp.detach() - batch.behaviour).abs() if measure else None, batch)
        if measure:
            _keep(chunk, logp)
        return loss

    def _end_step(
        self, samples: list[Sample], step: Totals, totals: Totals, measure: bool
    ) -> float:
        """After an optimizer step's backwards: the gradients summed over ranks, the agreement
        measured apart where the forwards could not, the step made; its gradient norm."""
        self.ranks.sum_grads(self.params)
        step.sum_over(self.ranks)
        if measure and (step.diff_tokens[0] == 0 or self.adapter.dropout > 0):
            # No fresh token, or the training forward ran with dropout: measure agreement apart.
            step.diff[0], step.diff_tokens[0] = 0.0, 0
            self._rescore(samples, step)
        totals.merge(step)
        self._reshard()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        if not math.isfinite(grad_norm):
            # An update now would put NaN into the adapter that the engine serves next.
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"non-finite gradient norm ({grad_norm}) at version {self.version}"
            )
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm

    def _norm(self, samples: list[Sample]) -> Norm:
        trained = [0 if s.left_out else sum(1 for m in s.loss_mask if m) for s in samples]
        return Norm(
            tokens=sum(trained), sequences=sum(1 for t in trained if t), length=self.norm_length
        )

    @torch.no_grad()
    def _proximal(self, samples: list[Sample], totals: Totals) -> dict[int, Tensor]:
        """Each sample's logprobs under the adapter before this batch's first optimizer step (eval
        mode), by `id(sample)`; the engine agreement of the step measured on the way."""
        was_training = self.model.training
        self.model.eval()
        out: dict[int, Tensor] = {}
        step = Totals()
        # each mini-batch's micro-batches, as the optimizer steps will cut them (on each rank, its
        # share)
        try:
            for part in minibatches(samples, self.algo.minibatches):
                for chunk, counts in self._micro_batches(part):
                    batch = self._collate(chunk)
                    logp, _ = self._logprobs(batch)
                    # a pad's too (FSDP)
                    out.update({id(s): logp[row] for row, s in enumerate(chunk)})
                    if counts:
                        step.add_diff((logp - batch.behaviour).abs(), batch)
                        _keep(chunk, logp)
        finally:
            self.model.train(was_training)
        step.sum_over(self.ranks)
        if step.diff_tokens[0] == 0:
            self._rescore(samples, step)
        totals.diff, totals.diff_tokens = step.diff, step.diff_tokens
        return out

    def _state(self) -> tuple[list[Tensor], dict, dict]:
        """The adapter, its optimizer and its schedule as they are (adapters are small)."""
        return (
            [p.detach().clone() for p in self.params],
            copy.deepcopy(self.optimizer.state_dict()),
            self.scheduler.state_dict(),
        )

    @torch.no_grad()
    def _set_state(self, state: tuple[list[Tensor], dict, dict]) -> None:
        params, optimizer, schedule = state
        for p, old in zip(self.params, params, strict=True):
            p.copy_(old)
        self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(schedule)

    def _micro_batches(self, samples: list[Sample]) -> list[tuple[list[Sample], bool]]:
        """(micro-batch, whether it counts): all of them, or with ranks this rank's share's
        (ranks.py)."""
        return self.ranks.share(samples, self.cfg.micro_batch_tokens, pad=self._sharded)

    def _snapshot(self) -> None:
        """Keep a copy of the adapter at this version (adapters are small)."""
        self._snapshots[self.version] = [p.detach().clone() for p in self.params]
        for old in [v for v in self._snapshots if v <= self.version - SNAPSHOTS]:
            del self._snapshots[old]

    @torch.no_grad()
    def _rescore(self, samples: list[Sample], totals: Totals) -> None:
        """Engine-vs-trainer agreement in eval mode (dropout off): re-score a few samples of a few
        of the step's groups (`rescore_choice`), each under the exact adapter version that
        generated it, so `logprob_diff` measures numerics every step (not policy drift) even when
        every sample is stale."""
        versions = {id(s): s.versions() for s in samples}
        chosen = rescore_choice(
            [s for s in samples if any(v in self._snapshots for v in versions[id(s)])],
            self.version,
        )
        current = [p.detach().clone() for p in self.params]
        was_training = self.model.training
        self.model.eval()
        try:  # a multi-turn sample's turns may come from several versions: each token under its own
            for version in sorted(
                {v for s in chosen for v in versions[id(s)] if v in self._snapshots}
            ):
                # not stepped yet
                weights = current if version == self.version else self._snapshots[version]
                for p, old in zip(self.params, weights, strict=True):
                    p.copy_(old)
                these = [s for s in chosen if version in versions[id(s)]]
                batch = self._collate(these)
                ours = torch.zeros_like(batch.generated)
                for row, s in enumerate(these):
                    ours[row, : len(s.output_ids)] = torch.tensor(
                        [v == version for v in versions[id(s)]]
                    )
                diff = (self._logprobs(batch)[0] - batch.behaviour).abs()[batch.generated & ours]
                totals.diff[0] += float(diff.sum())
                totals.diff_tokens[0] += diff.numel()
        finally:
            for p, now in zip(self.params, current, strict=True):
                p.copy_(now)
            self.model.train(was_training)

    # -- logprobs ---------------------------------------------------------------------------

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Trainer logprobs of each sample's output tokens under the current adapter (eval mode)."""
        # every rank runs the same forwards (collectives under FSDP)
        self.ranks.send("logprobs", samples)
        with self.shared.turn(self.name):
            return self._sample_logprobs(samples)

    @torch.no_grad()
    def _sample_logprobs(self, samples: list[Sample]) -> list[list[float]]:
        self.model.eval()
        out: dict[int, list[float]] = {}
        index = {id(s): i for i, s in enumerate(samples)}
        for chunk in micro_batches(samples, self.cfg.micro_batch_tokens):
            batch = self._collate(chunk)
            logp, _ = self._logprobs(batch)
            for row, s in enumerate(chunk):
                out[index[id(s)]] = logp[row, : len(s.output_ids)].tolist()
        self._reshard()
        return [out[i] for i in range(len(samples))]

    def _reshard(self) -> None:
        """Under FSDP, leave every rank's base sharded after a command. FSDP keeps the root's
        weights gathered after a forward without backward, and rank 0 alone then reads the model's
        state (a push, a save), which reshards them there only: the next forward would all-gather on
        rank 0 alone."""
        if self._sharded:
            self._decoder.reshard()

    def _logprobs(self, batch: Batch, entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
        """[N, C] logprob of each output token under the sampling distribution, and that
        distribution's entropy (batch.py): each prompt runs once, the decoder to its last hidden
        state, the vocabulary projection a chunk at a time."""
        if self.cores is not None:
            self.cores.apply()
        self._count_flops(batch)
        hidden = output_hidden(self._decoder, batch, self.buckets, self.bucket_cost)
        return self._project(hidden, batch, entropy_grad)

    def _count_flops(self, batch: Batch) -> None:
        tokens = int(batch.prompt_mask.sum()) + int(batch.outputs.sum())
        # a backward: 2 more
        self._flops += (4 if torch.is_grad_enabled() else 2) * self.matmul_params * tokens

    def _project(self, hidden: Tensor, batch: Batch, entropy_grad: bool) -> tuple[Tensor, Tensor]:
        """`_logprobs` from the decoder's hidden states (`output_hidden`)."""
        return token_logprobs(
            hidden,
            self._head,
            batch.output_ids,
            batch.outputs,
            self.temperature,
            self.top_p,
            self.top_k,
            entropy_grad,
        )

    @torch.no_grad()
    def _ref_logprobs(self, batch: Batch) -> Tensor:
        with self.model.disable_adapter():  # the frozen base model is the KL reference
            return self._logprobs(batch)[0]

    def _collate(self, samples: list[Sample]) -> Batch:
        return collate(samples, self.pad_id, self.version, self.device)

    # -- export -----------------------------------------------------------------------------

    # Reading this adapter needs no turn of the base: another adapter's step never writes it.
    def adapter_tensors(self) -> dict[str, Tensor]:
        return adapters.adapter_tensors(self.model, self.name)

    def adapter_config(self) -> dict:
        return adapters.adapter_config_dict(self.model, self.name)

    def merged_weights(self, only_adapted: bool = False) -> dict[str, Tensor]:
        """Base weights with the adapter merged in; `only_adapted`: just the adapted modules'
        weights."""
        with self.shared.turn(self.name):  # merging reads the active adapter
            return adapters.merged_weights(self.model, only_adapted)

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, directory: str | Path, run_state: dict | None = None) -> Path:
        """Adapter in peft's format, optimizer state and trainer state (version, RNG, schedule, and
        the run's own `run_state`, e.g. where the prompt stream stands, which `load` returns):
        state.py."""
        directory = Path(directory)
        state.write(
            directory,
            self.model,
            self.name,
            self.optimizer.state_dict(),
            {
                "version": self.version,
                "run": run_state or {},
                "schedule": self.scheduler.state_dict(),
            },
        )
        return directory

    def load(self, directory: str | Path) -> dict:
        """Restore what `save` wrote, so training continues exactly where it stopped (with ranks: on
        every rank, however many ranks wrote it); returns the saved `run_state`."""
        saved = state.read(Path(directory), self.model, self.name)
        self.ranks.send("load", saved)
        self._restore(saved)
        return saved.state.get("run", {})

    def _restore(self, saved: state.SavedState) -> None:
        peft.set_peft_model_state_dict(
            self.model,
            {k: v.to(self.device) for k, v in saved.weights.items()},
            adapter_name=self.name,
        )
        self.optimizer.load_state_dict(saved.optimizer)  # moves the state to the parameters' device
        self.version = int(saved.state["version"])
        if "schedule" in saved.state:
            self.scheduler.load_state_dict(saved.state["schedule"])
        self._snapshots.clear()
        self._snapshot()
        state.set_rng(saved.state["rng"])

    # -- ranks other than 0 -----------------------------------------------------------------

    def close(self) -> None:
        """Rank 0: the other ranks stop following (when they can still hear it). Idempotent."""
        if (
            self.ranks.world > 1
            and self.ranks.leader
            and self.ranks.lost is None
            and not self._closed
        ):
            self._closed = True
            try:
                self.ranks.send("stop")
            except RankLost:
                pass  # they are gone already

    def follow(self) -> None:
        """Do what rank 0's trainer does, on this rank, until it says stop."""
        assert isinstance(self.ranks, Ranks), "a rank other than 0 follows rank 0"
        actions: dict[str, Callable[[Any], object]] = {
            "step": self._step,
            "logprobs": self._sample_logprobs,
            "load": self._restore,
        }
        while True:
            what, payload = self.ranks.receive()
            if what == "stop":
                return
            try:
                actions[what](payload)
            except FloatingPointError:
                pass  # rank 0 computed the same gradient norm: it stops the run and says so
