"""The trainer: a Hugging Face causal LM wrapped with a peft adapter, one optimizer step per batch.

Only the adapter trains; the base stays frozen in fp32. Logprobs are those of the distribution
the engine samples from, log_softmax(logits / T) truncated to top-k/top-p and renormalised when
those are set (orbit/truncation.py): the same distribution the engine reports, so the two compare
token by token and the loss differentiates the policy that was actually sampled from.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import peft
import torch
from torch import Tensor
from transformers import set_seed

from orbit import adapters
from orbit.config import AdapterConfig, TrainerConfig
from orbit.rollout.sample import Sample
from orbit.train.batch import Batch, collate, micro_batches, output_hidden, spread_over_groups, token_logprobs
from orbit.train.checkpoint import STATE_FILE
from orbit.train.loss import LossStats, policy_loss
from orbit.train.ranks import RankLost, Ranks, padded_micro_batches
from orbit.train.shared import SharedBase

SNAPSHOTS = 4  # adapter versions kept to re-score stale samples with the weights that made them
RESCORE_SAMPLES = 8  # at most this many samples re-scored per step (one extra no-grad forward)
OPTIMIZER_FILE = "optimizer.pt"
DEFAULT_ADAPTER = "default"  # peft's name for a model's one adapter


@dataclass
class StepResult:
    """One optimizer step. Diffs are NaN when no token of their kind was in the batch."""

    version: int  # the trainer's version after the step
    loss: float
    grad_norm: float  # before clipping
    ratio_mean: float
    ratio_max: float
    clip_frac: float
    kl: float  # NaN unless loss.kl_coef > 0
    tokens: int  # trained-on tokens (loss_mask 1)
    samples: int
    logprob_diff: float  # mean |trainer - engine| logprob, each sample under the weights that made it
    logprob_diff_tokens: int
    policy_drift: float  # the same mean on the stale samples
    policy_drift_tokens: int
    queue_s: float = 0.0  # waiting for the shared base while other adapters of a sweep trained (shared.py)


@dataclass
class _Totals:
    """Sums over micro-batches, turned into token-weighted means at the end."""

    loss: float = 0.0
    tokens: int = 0
    ratio_sum: float = 0.0
    ratio_max: float = -math.inf
    clipped: float = 0.0
    kl_sum: float = 0.0
    diff: list[float] = field(default_factory=lambda: [0.0, 0.0])  # fresh, stale
    diff_tokens: list[int] = field(default_factory=lambda: [0, 0])

    def add(self, loss: Tensor, stats: LossStats, abs_diff: Tensor, batch: Batch) -> None:
        self.loss += float(loss.detach())
        if stats.tokens:
            self.tokens += stats.tokens
            self.ratio_sum += stats.ratio_mean * stats.tokens
            self.ratio_max = max(self.ratio_max, stats.ratio_max)
            self.clipped += stats.clip_frac * stats.tokens
            self.kl_sum += stats.kl * stats.tokens
        for i, rows in enumerate((batch.fresh, ~batch.fresh)):
            mask = batch.loss_mask & rows.unsqueeze(-1)
            self.diff[i] += float(abs_diff[mask].sum())
            self.diff_tokens[i] += int(mask.sum())

    def sum_over(self, ranks: Ranks) -> None:
        """The whole batch's sums, from every rank's share."""
        sums = torch.tensor([self.loss, self.tokens, self.ratio_sum, self.clipped, self.kl_sum, *self.diff,
                             *self.diff_tokens], dtype=torch.float64)
        most = torch.tensor([self.ratio_max], dtype=torch.float64)
        ranks.all_reduce(sums)
        ranks.all_reduce(most, torch.distributed.ReduceOp.MAX)
        (self.loss, tokens, self.ratio_sum, self.clipped, self.kl_sum, d0, d1, t0, t1) = sums.tolist()
        self.tokens, self.diff, self.diff_tokens = int(tokens), [d0, d1], [int(t0), int(t1)]
        self.ratio_max = float(most)


@dataclass
class SavedState:
    """What a checkpoint holds for the trainer, as read from its directory (rank 0 reads, every rank restores)."""

    weights: dict[str, Tensor]
    optimizer: dict
    state: dict


def _mean(total: float, count: int) -> float:
    return total / count if count else math.nan


class Trainer:
    """Trains a LoRA or OFT adapter on scored samples (see `step`). With `ranks`, one of several trainer
    ranks (ranks.py): rank 0's `step`, `logprobs` and `load` make the other ranks, in `follow`, do the same."""

    def __init__(
        self, model_path: str | Path, adapter: AdapterConfig, cfg: TrainerConfig, temperature: float, seed: int,
        top_p: float = 1.0, top_k: int = 0, ranks: Ranks | None = None, shared: SharedBase | None = None,
        name: str = DEFAULT_ADAPTER,
    ) -> None:
        # The engine runs in its own process with its own threads; don't let torch take every core.
        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.adapter = adapter
        self.ranks = ranks
        self._closed = False
        self.device = ranks.device if ranks is not None else torch.device(cfg.device)
        # Temperature 0 means greedy on the engine, which then reports temperature-1 untruncated logprobs.
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_p, self.top_k = (top_p, top_k) if temperature > 0 else (1.0, 0)
        # A sweep's runs share one base (shared.py); a single run has one of its own.
        self.shared = shared or SharedBase(model_path, cfg.dtype)
        self.name = name
        base = self.shared.base
        set_seed(seed)  # python, numpy, torch: the adapter's init is random (LoRA A), the same in a sweep or alone
        self.params = self.shared.add(name, adapters.peft_config(adapter, base))
        self.model: peft.PeftModel = self.shared.model
        # The decoder stack (with its final norm) and the output projection, run apart (batch.py).
        self._decoder = base.model
        self._head = base.get_output_embeddings().weight
        self._sharded = ranks is not None and cfg.shard == "fsdp"
        if self._sharded:
            # The head is frozen and often tied to the (sharded) embedding: every rank keeps it whole.
            self._head = self._head.detach().clone().to(self.device)
            ranks.shard_base(self._decoder, self.params)
        self.model.to(self.device)
        if ranks is not None:
            ranks.broadcast_params(self.params)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.pad_id = base.config.pad_token_id or 0
        self.version = 0
        self._snapshots: dict[int, list[Tensor]] = {}
        self._snapshot()

    # -- training ---------------------------------------------------------------------------

    def step(self, samples: list[Sample]) -> StepResult:
        """One optimizer step on the batch, in micro-batches of at most `cfg.micro_batch_tokens` padded
        tokens (batch.py); with ranks, each on its share and the gradients summed."""
        if not samples:
            raise ValueError("step needs at least one sample")
        if self.ranks is not None:
            self.ranks.send("step", samples)
        with self.shared.turn(self.name) as waited:  # after the adapters (of a sweep) that asked first
            result = self._step(samples)
        result.queue_s = waited
        return result

    def _step(self, samples: list[Sample]) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = sum(sum(1 for m in s.loss_mask if m) for s in samples)  # the whole batch's, on every rank
        totals = _Totals()
        for chunk, counts in self._micro_batches(samples):
            batch = self._collate(chunk)
            logp = self._logprobs(batch)
            ref = self._ref_logprobs(batch) if self.cfg.loss.kl_coef > 0 else None
            loss, stats = policy_loss(
                logp, batch.behaviour, batch.advantages, batch.loss_mask, self.cfg.loss, ref, num_tokens
            )
            if not counts:  # a pad (FSDP): its forward and backward are collectives, its loss is not ours
                (loss * 0.0).backward()
                continue
            loss.backward()
            totals.add(loss, stats, (logp.detach() - batch.behaviour).abs(), batch)
        if self.ranks is not None:
            self.ranks.sum_grads(self.params)
            totals.sum_over(self.ranks)
        if totals.diff_tokens[0] == 0 or self.adapter.dropout > 0:
            # No fresh token, or the training forward ran with dropout: measure agreement apart.
            totals.diff[0], totals.diff_tokens[0] = 0.0, 0
            self._rescore(samples, totals)
        self._reshard()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
        if not math.isfinite(grad_norm):
            # An update now would put NaN into the adapter that the engine serves next.
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm ({grad_norm}) at version {self.version}")
        self.optimizer.step()
        self.version += 1
        self._snapshot()
        return self._result(totals, grad_norm, len(samples))

    def _micro_batches(self, samples: list[Sample]) -> list[tuple[list[Sample], bool]]:
        """(micro-batch, whether it counts): all of them, or with ranks this rank's share's (ranks.py)."""
        if self.ranks is None:
            return [(chunk, True) for chunk in micro_batches(samples, self.cfg.micro_batch_tokens)]
        return padded_micro_batches(samples, self.ranks.world, self.ranks.rank, self.cfg.micro_batch_tokens,
                                    pad=self._sharded)

    def _snapshot(self) -> None:
        """Keep a copy of the adapter at this version (adapters are small)."""
        self._snapshots[self.version] = [p.detach().clone() for p in self.params]
        for old in [v for v in self._snapshots if v <= self.version - SNAPSHOTS]:
            del self._snapshots[old]

    @torch.no_grad()
    def _rescore(self, samples: list[Sample], totals: _Totals) -> None:
        """Engine-vs-trainer agreement in eval mode (dropout off): re-score a few samples, spread over
        the step's groups, each under the exact adapter version that generated it, so `logprob_diff`
        measures numerics every step (not policy drift) even when every sample is stale."""
        chosen = spread_over_groups(
            [s for s in samples if s.version_start == s.version_end in self._snapshots], RESCORE_SAMPLES)
        current = [p.detach().clone() for p in self.params]
        was_training = self.model.training
        self.model.eval()
        try:
            for version in sorted({s.version_start for s in chosen}):
                weights = current if version == self.version else self._snapshots[version]  # not stepped yet
                for p, old in zip(self.params, weights, strict=True):
                    p.copy_(old)
                batch = self._collate([s for s in chosen if s.version_start == version])
                diff = (self._logprobs(batch) - batch.behaviour).abs()[batch.loss_mask]
                totals.diff[0] += float(diff.sum())
                totals.diff_tokens[0] += diff.numel()
        finally:
            for p, now in zip(self.params, current, strict=True):
                p.copy_(now)
            self.model.train(was_training)

    def _result(self, t: _Totals, grad_norm: float, n_samples: int) -> StepResult:
        return StepResult(
            version=self.version,
            loss=t.loss,
            grad_norm=grad_norm,
            ratio_mean=_mean(t.ratio_sum, t.tokens),
            ratio_max=t.ratio_max if t.tokens else math.nan,
            clip_frac=_mean(t.clipped, t.tokens),
            kl=_mean(t.kl_sum, t.tokens),
            tokens=t.tokens,
            samples=n_samples,
            logprob_diff=_mean(t.diff[0], t.diff_tokens[0]),
            logprob_diff_tokens=t.diff_tokens[0],
            policy_drift=_mean(t.diff[1], t.diff_tokens[1]),
            policy_drift_tokens=t.diff_tokens[1],
        )

    # -- logprobs ---------------------------------------------------------------------------

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Trainer logprobs of each sample's output tokens under the current adapter (eval mode)."""
        if self.ranks is not None:  # every rank runs the same forwards (they are collectives under FSDP)
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
            logp = self._logprobs(batch)
            for row, s in enumerate(chunk):
                out[index[id(s)]] = logp[row, : len(s.output_ids)].tolist()
        self._reshard()
        return [out[i] for i in range(len(samples))]

    def _reshard(self) -> None:
        """Under FSDP, leave every rank's base sharded after a command. FSDP keeps the root's weights
        gathered after a forward without backward, and rank 0 alone then reads the model's state (a
        push, a save), which reshards them there only: the next forward would all-gather on rank 0 alone."""
        if self._sharded:
            self._decoder.reshard()

    def _logprobs(self, batch: Batch) -> Tensor:
        """[N, C] logprob of each output token under the sampling distribution (batch.py): each prompt runs
        once, the decoder to its last hidden state, the vocabulary projection a chunk at a time."""
        hidden = output_hidden(self._decoder, batch)
        return token_logprobs(hidden, self._head, batch, self.temperature, self.top_p, self.top_k)

    @torch.no_grad()
    def _ref_logprobs(self, batch: Batch) -> Tensor:
        with self.model.disable_adapter():  # the frozen base model is the KL reference
            return self._logprobs(batch)

    def _collate(self, samples: list[Sample]) -> Batch:
        return collate(samples, self.pad_id, self.version, self.device)

    # -- export -----------------------------------------------------------------------------

    # Reading this adapter needs no turn of the base: another adapter's step never writes it.
    def adapter_tensors(self) -> dict[str, Tensor]:
        return adapters.adapter_tensors(self.model, self.name)

    def adapter_config(self) -> dict:
        return adapters.adapter_config_dict(self.model, self.name)

    def merged_weights(self, only_adapted: bool = False) -> dict[str, Tensor]:
        """Base weights with the adapter merged in; `only_adapted`: just the adapted modules' weights."""
        with self.shared.turn(self.name):  # merging reads the active adapter
            return adapters.merged_weights(self.model, only_adapted)

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, directory: str | Path, run_state: dict | None = None) -> Path:
        """Adapter in peft's format, optimizer state and trainer state (version, RNG, and the run's
        own `run_state`, e.g. where the prompt stream stands, which `load` returns), the trainer state
        last (a checkpoint is complete when it is there: orbit/train/checkpoint.py)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, selected_adapters=[self.name])
        if self.name != DEFAULT_ADAPTER:  # peft puts any other adapter in a directory of its name: one format
            for path in (directory / self.name).iterdir():
                path.replace(directory / path.name)
            (directory / self.name).rmdir()
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        state = {
            "version": self.version,
            "rng": {
                "python": random.getstate(),
                "torch": torch.get_rng_state().tolist(),
                "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
            },
            "run": run_state or {},
        }
        (directory / STATE_FILE).write_text(json.dumps(state))
        return directory

    def load(self, directory: str | Path) -> dict:
        """Restore what `save` wrote, so training continues exactly where it stopped (with ranks: on
        every rank, however many ranks wrote it); returns the saved `run_state`."""
        directory = Path(directory)
        weights = peft.utils.load_peft_weights(str(directory), device="cpu")
        expected = set(peft.get_peft_model_state_dict(self.model, adapter_name=self.name))
        if set(weights) != expected:
            raise ValueError(
                f"{directory}: adapter does not match this trainer's adapter config "
                f"(missing {sorted(expected - set(weights))[:3]}, unexpected {sorted(set(weights) - expected)[:3]})"
            )
        saved = SavedState(weights, torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True),
                           json.loads((directory / STATE_FILE).read_text()))
        if self.ranks is not None:
            self.ranks.send("load", saved)
        self._restore(saved)
        return saved.state.get("run", {})

    def _restore(self, saved: SavedState) -> None:
        peft.set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in saved.weights.items()},
                                       adapter_name=self.name)
        self.optimizer.load_state_dict(saved.optimizer)  # moves the state to the parameters' device
        self.version = int(saved.state["version"])
        self._snapshots.clear()
        self._snapshot()
        self._set_rng(saved.state["rng"])

    # -- ranks other than 0 -----------------------------------------------------------------

    def close(self) -> None:
        """Rank 0: the other ranks stop following (when they can still hear it). Idempotent."""
        if self.ranks is not None and self.ranks.leader and self.ranks.lost is None and not self._closed:
            self._closed = True
            try:
                self.ranks.send("stop")
            except RankLost:
                pass  # they are gone already

    def follow(self) -> None:
        """Do what rank 0's trainer does, on this rank, until it says stop."""
        actions = {"step": self._step, "logprobs": self._sample_logprobs, "load": self._restore}
        while True:
            what, payload = self.ranks.receive()
            if what == "stop":
                return
            try:
                actions[what](payload)
            except FloatingPointError:
                pass  # rank 0 computed the same gradient norm: it stops the run and says so

    @staticmethod
    def _set_rng(rng: dict) -> None:
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rng["cuda"]])
