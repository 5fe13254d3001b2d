"""What this machine allows on a workload: the engines' capacity and the trainer-free batch time.

`orbit bench` divides by these to draw each mode's floor (docs/design.md §6):
- capacity: tokens per second when the engines are never paused and always hold `max_inflight`
  requests each (requests are refilled the moment one finishes);
- barrier: the time one batch takes from idle engines to its last sample, as a serial step waits.
Both run the recipe's rollouts on the recipe's adapter slot (a fresh adapter), nothing else running.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from statistics import median

from orbit.config import Recipe
from orbit.devices import colocate
from orbit.engine import start_pool
from orbit.engine.base import ACTIVE
from orbit.modes import MODES
from orbit.rollout.groups import sampling_params
from orbit.tasks import make_task
from orbit.truncation import truncates

WAIT_S = 600.0  # no single request of a bench workload takes this long


@dataclass
class Capacity:
    tok_per_s: float  # all engines together
    barrier_s: float  # median over the probe's batches
    batch_tokens: float  # median tokens of one batch
    engines: int


def measure_capacity(recipe: Recipe, batches: int = 3) -> Capacity:
    """Start the recipe's engines, time `batches` lone batches (they warm the engines up), then the
    steady refilled rate over twice as many batches' worth of requests; stop the engines."""
    from transformers import AutoTokenizer

    from orbit.run import stop_token_ids
    from orbit.train.trainer import Trainer
    from orbit.updaters import PoolPush

    tokenizer = AutoTokenizer.from_pretrained(recipe.model)
    task = make_task(recipe.task, tokenizer)
    r = recipe.rollout
    sampling = sampling_params(r, stop_token_ids(tokenizer, r.stop))
    engine_cfg, _ = colocate(recipe)  # a GPU shared with the trainer: the same split as the runs
    trainer = Trainer(recipe.model, recipe.adapter, recipe.trainer, r.temperature, recipe.seed, top_p=r.top_p,
                      top_k=r.top_k)
    pool = start_pool(engine_cfg, recipe.model, recipe.seed, recipe.adapter,
                      call_timeout_s=r.stall_timeout_s, truncated=truncates(r.top_p, r.top_k) and r.temperature > 0)
    try:
        PoolPush(MODES["double-buffer"].push, recipe.adapter.type, pool).initial(pool, trainer)
        requests = _requests(task, recipe.seed, r.group_size, sampling)
        batch = r.group_size * r.prompts_per_step
        lone = [_one_batch(pool, [next(requests) for _ in range(batch)]) for _ in range(batches)]
        rate = _steady_rate(pool, requests, recipe.engine.max_inflight * recipe.engine.engines, 2 * batches * batch)
    finally:
        pool.shutdown()
    return Capacity(rate, median(s for s, _ in lone), median(t for _, t in lone), recipe.engine.engines)


def _requests(task, seed: int, group_size: int, sampling):
    """The workload's requests in rollout order: each prompt `group_size` times, a seed per sample."""
    prompts = task.prompts(seed)
    n = 0
    while True:
        prompt = next(prompts)
        for _ in range(group_size):
            n += 1
            yield list(prompt.prompt_ids), dataclasses.replace(sampling, seed=n)


def _one_batch(pool, batch: list) -> tuple[float, int]:
    """(seconds from submitting the whole batch to its last sample, tokens generated)."""
    t0 = time.time()
    futures = [pool.generate(ids, sp, slot=ACTIVE) for ids, sp in batch]
    done = [f.result(WAIT_S) for f in futures]
    return time.time() - t0, sum(len(c.output_ids) for c in done)


def _steady_rate(pool, requests, inflight: int, count: int) -> float:
    """Tokens/s over `count` completions with `inflight` requests always in flight, counted from the
    engines' own token counters once the first `inflight` completions have filled the pipeline."""
    running: set[Future] = {pool.generate(ids, sp, slot=ACTIVE) for ids, sp in (next(requests)
                                                                                 for _ in range(inflight))}
    finished, start = 0, None
    while start is None or finished < count:
        done, running = wait(running, timeout=WAIT_S, return_when=FIRST_COMPLETED)
        if not done:
            raise TimeoutError(f"capacity probe: no request finished in {WAIT_S:g} s ({pool.describe()})")
        for f in done:
            f.result()  # an engine error surfaces here
            ids, sp = next(requests)
            running.add(pool.generate(ids, sp, slot=ACTIVE))
        finished += len(done)
        if start is None and finished >= inflight:
            start, finished = (time.time(), pool.stats().tokens_generated), 0
    tokens = pool.stats().tokens_generated - start[1]
    return tokens / (time.time() - start[0])
