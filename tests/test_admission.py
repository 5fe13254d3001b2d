"""Generate only what will be trained: version-gated admission, oldest-first batches, no length
bias."""

from __future__ import annotations

from pathlib import Path
from statistics import fmean

import pytest
from admission import RunAhead
from engine_helpers import FakeEngine
from run_helpers import checked, recipe_dict, run_metrics, run_timeline

from orbit.engine.pool import EnginePool
from orbit.rollout.pipeline import Admission
from orbit.run.lifecycle import train

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out

OVERLAPPED = ("async-full", "async-adapter", "double-buffer")


def _recipe(model: Path, out: Path, **patch) -> dict:
    return recipe_dict(
        model,
        out,
        {
            "engine": {"max_inflight": 32, "max_running": 32},
            "rollout": {"max_new_tokens": 16},
            "trainer": {"steps": 6},
            "seed": 2,
        },
        **patch,
    )


def test_admission_rule():
    """A group started at version v with g groups before it is trained at step g // B: it may start
    only when g < (v + K + 1) * B. The former rule counted only what was in flight or buffered."""

    def allows(rule: Admission, version: int, started: int, in_pipeline: int = 0) -> bool:
        pool = EnginePool([FakeEngine()], [8], monitor=False)
        pool.serves(pool.members[0], version)
        return rule.pick(pool, started, in_pipeline) is not None

    rule = Admission(batch=4, max_staleness=1)
    assert [allows(rule, 0, started) for started in (0, 7, 8)] == [True, True, False]
    assert allows(rule, 1, 11) and not allows(rule, 1, 12)
    on_policy = Admission(batch=4, max_staleness=0)
    # exactly one batch per version
    assert allows(on_policy, 3, 15) and not allows(on_policy, 3, 16)
    assert allows(Admission(2, None), 0, 3) and not allows(Admission(2, None), 0, 4)
    former = RunAhead(batch=4, max_staleness=1)
    assert allows(former, 0, 100, 7) and not allows(former, 0, 0, 8)  # blind to the version


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", OVERLAPPED)
def test_staleness_bound_holds_and_nothing_is_wasted(tmp_path, tiny_llama, mode):
    """K = 0, 1, 2: the bound holds on every step, nothing hangs (the test timeout), and what is
    generated is trained (no drop, no waste); K = 0 is on-policy, K > 0 still uses the overlap.
    Double-buffer has K + 2 slots, so a load never meets requests still running on its slot."""
    for k in (0, 1, 2):
        run_dir = tmp_path / f"k{k}"
        engine = {"max_inflight": 32, "max_running": 32, "slots": max(2, k + 2)}
        train(
            checked(_recipe(tiny_llama, run_dir, mode=mode, max_staleness=k, engine=engine)),
            live=False,
        )
        rows = run_metrics(run_dir)
        assert len(rows) == 6
        assert all(r["staleness_max"] <= k for r in rows), (k, [r["staleness_max"] for r in rows])
        assert sum(r["stale_dropped"] for r in rows) == 0 and all(
            r["waste_frac"] == 0.0 for r in rows
        )
        if k > 0:  # the overlap the bound allows is used
            assert max(r["staleness_max"] for r in rows) >= 1


@pytest.mark.timeout(300)
def test_trained_samples_are_not_biased_toward_short_ones(tmp_path, tiny_llama):
    """Long-tailed output lengths (common stop tokens, a high cap): with version admission,
    oldest-first batches and the deadline rule (a group due this step is waited for, not overtaken),
    the mean length of the trained samples is within 5% of the mean length of every sample generated
    in the run."""
    run_dir = tmp_path / "run"
    recipe = checked(
        _recipe(
            tiny_llama,
            run_dir,
            mode="double-buffer",
            max_staleness=1,
            # eight of the tiny model's common single tokens end a sample: about 5% a token, so most
            # samples are short and a few run to the cap
            rollout={
                "max_new_tokens": 96,
                "stop": [" 4", ",", " m", "war", "vv", "odel", "'", "f"],
                "prompts_per_step": 2,
            },
            engine={"max_inflight": 24, "max_running": 24, "slots": 3},
            trainer={"steps": 24},
            seed=3,
        )
    )
    train(recipe, live=False)
    rows = run_metrics(run_dir)
    trained = sum(r["trained_tokens"] for r in rows) / (len(rows) * 8)
    # every sample that finished, trained or not (the last groups in flight at the end included)
    generated = [
        e["tokens"]
        for e in run_timeline(run_dir)
        if e["kind"] == "request" and e["finish"] != "abort"
    ]
    lengths = sorted(generated)
    assert lengths[-1] >= 3 * lengths[len(lengths) // 2], "outputs are not long-tailed"
    ratio = trained / fmean(generated)
    print(
        f"\ntrained mean length {trained:.1f}, generated {fmean(generated):.1f}, "
        f"ratio {ratio:.2f}, dropped {sum(r['stale_dropped'] for r in rows)}, resubmitted "
        f"{sum(r['resubmitted'] for r in rows)}"
    )
    assert ratio >= 0.95
    assert sum(r["stale_dropped"] for r in rows) == 0  # no slow group overtaken and dropped
