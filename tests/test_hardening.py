"""A run never hangs without a word and never leaves a broken run directory: Ctrl-C, engine death,
silent stalls, endless aborts, failed starts, exact resume (embedded engine, tiny model)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from run_helpers import checked, engine_processes, recipe_dict, run_metrics
from safetensors.torch import load_file

import orbit.run.engines
import orbit.run.lifecycle
from orbit.config import RecipeError
from orbit.engine.base import EngineDeadError
from orbit.engine.pool import EnginePool
from orbit.host.interrupts import Interrupted
from orbit.rollout.pipeline import Pipeline, RolloutError
from orbit.rollout.producer import Producer
from orbit.run import RunStopped, train
from orbit.train.checkpoint import STATE_FILE

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out


def _recipe(model: Path, out: Path, **patch) -> dict:
    return recipe_dict(model, out, {"trainer": {"steps": 4}, "mode": "double-buffer"}, **patch)


def _saved_version(run_dir: Path) -> int | None:
    state = run_dir / "adapter" / STATE_FILE
    return yaml.safe_load(state.read_text())["version"] if state.exists() else None


def _capture_engine(monkeypatch) -> list:
    """The engines `train` starts (to kill or stop one from the test)."""
    started: list = []
    real = orbit.run.engines.start_pool

    def start(*args, **kwargs):
        engine = real(*args, **kwargs)
        started.append(engine)
        return engine

    monkeypatch.setattr(orbit.run.engines, "start_pool", start)
    return started


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _when(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


# ---- Ctrl-C --------------------------------------------------------------------------------------


@pytest.mark.alone  # a time bound: no other test beside it
@pytest.mark.timeout(240)
def test_ctrl_c_never_loses_a_step(tmp_path, tiny_llama):
    """SIGINT at random moments: the saved adapter's version always equals the last metrics line's,
    and --resume carries on from exactly there (no step trained without a line)."""
    rng = random.Random(0)
    for trial in range(3):
        run_dir = tmp_path / f"t{trial}"
        recipe = checked(_recipe(tiny_llama, run_dir, trainer={"steps": 200}))
        started = time.monotonic()

        def interrupt(delay=rng.uniform(0.3, 1.5), run_dir=run_dir):
            _when(
                lambda: (
                    (run_dir / "metrics.jsonl").exists()
                    and (run_dir / "metrics.jsonl").stat().st_size
                )
            )
            # somewhere inside a later step: waiting, training, pushing or writing
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGINT)

        killer = threading.Thread(target=interrupt, daemon=True)
        killer.start()
        with pytest.raises(Interrupted) as err:
            train(recipe, live=False)
        killer.join()
        rows = run_metrics(run_dir)
        saved = _saved_version(run_dir)
        assert saved == rows[-1]["version"] == len(rows), (
            f"trial {trial}: adapter {saved}, lines {len(rows)}"
        )
        assert f"step {saved}" in str(err.value) and "--resume" in str(err.value)
        assert time.monotonic() - started < 60
    # and the last one resumes from its checkpoint, numbering on
    recipe = checked(_recipe(tiny_llama, run_dir, trainer={"steps": saved + 2}))
    train(recipe, resume=True, live=False)
    assert [r["step"] for r in run_metrics(run_dir)] == list(range(saved + 2))


def test_ctrl_c_during_start_up_leaves_nothing_and_says_so(tmp_path, tiny_llama, monkeypatch):
    def interrupted_start(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(orbit.run.engines, "start_pool", interrupted_start)
    with pytest.raises(Interrupted, match="during start-up: nothing was trained"):
        train(checked(_recipe(tiny_llama, tmp_path / "run")), live=False)
    assert not (tmp_path / "run").exists()


# importing Orbit and torch; typer parsing, loading (later: above)
@pytest.mark.parametrize("after_s", [0.5, 1.5])
def test_ctrl_c_during_start_up_on_the_command_line(tmp_path, tiny_llama, after_s):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tiny_llama, tmp_path / "run")))
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "train", str(recipe), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "nothing was trained" in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---- an engine that dies or goes silent ----------------------------------------------------------


@pytest.mark.alone  # a time bound: no other test beside it
@pytest.mark.timeout(180)
def test_engine_death_saves_the_newest_adapter_on_the_command_line(tmp_path, tiny_llama):
    """Engine killed after 3 steps: orbit exits within 2 s with one clear line (no traceback),
    leaves nothing running, and the adapter of its last step is saved with that step's metrics
    line."""
    run_dir = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    # engine.restarts 0: it is not brought back (tests/test_pool.py has the comeback)
    recipe.write_text(
        yaml.safe_dump(_recipe(tiny_llama, run_dir, trainer={"steps": 500}, engine={"restarts": 0}))
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "train", str(recipe), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _when(
            lambda: (run_dir / "metrics.jsonl").exists() and len(run_metrics(run_dir)) >= 3,
            timeout=120,
        )
        engines = engine_processes(psutil.Process(proc.pid))
        assert engines, "no engine process found"
        said = _Said(proc, "the engine died")
        killed = time.monotonic()
        for e in engines:
            e.kill()
        proc.wait(timeout=30)
        took = said.result(30) - killed
    finally:
        proc.kill()
    err = said.text()
    assert proc.returncode == 1, err
    # noticed, its adapter saved and said, within the liveness bound and a second; the interpreter's
    # own exit after that (torch's teardown: seconds on a slow machine) is not what is bounded
    assert took < 2.0 + 1.0, f"took {took:.1f} s to notice the dead engine and say so"
    flat = " ".join(err.split())
    assert "the engine died" in flat and "died (exit code" in flat and "Traceback" not in err
    rows = run_metrics(run_dir)
    assert _saved_version(run_dir) == rows[-1]["version"] >= 3
    assert not [c for c in engines if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


class _Said:
    """A process's stderr, read as it comes: when a line holding `text` came, and the whole."""

    def __init__(self, proc: subprocess.Popen, text: str) -> None:
        self.lines: list[str] = []
        self.when: float | None = None
        self._came = threading.Event()
        self._done = threading.Event()

        def read() -> None:
            for line in proc.stderr:
                self.lines.append(line)
                if self.when is None and text in " ".join(("".join(self.lines)).split()):
                    self.when = time.monotonic()
                    self._came.set()
            self._done.set()
            self._came.set()

        threading.Thread(target=read, daemon=True).start()

    def result(self, timeout: float) -> float:
        self._came.wait(timeout)
        assert self.when is not None, f"never said:\n{''.join(self.lines)[-2000:]}"
        return self.when

    def text(self) -> str:
        self._done.wait(30)
        return "".join(self.lines)


class _GoesSilent:
    """A real task whose prompt stream stops yielding (without an error) after `n` prompts."""

    def __init__(self, task, n: int) -> None:
        self.task, self.n, self.name, self.score = task, n, task.name, task.score

    def prompts(self, seed, split="train"):
        for i, p in enumerate(self.task.prompts(seed, split)):
            if i == self.n:
                time.sleep(6)  # silent: nothing in flight, nothing arriving, no error
            yield p


@pytest.mark.timeout(120)
def test_a_silent_stall_stops_the_run_and_says_what_was_seen(tmp_path, tiny_llama, monkeypatch):
    """The producer goes quiet: the run stops after stall_timeout_s with what was seen (in flight,
    grants left, the engine's state), saves the adapter of its last step and leaves nothing
    running."""
    real = orbit.run.lifecycle.make_task
    monkeypatch.setattr(orbit.run.lifecycle, "make_task", lambda *a: _GoesSilent(real(*a), n=6))
    engines = _capture_engine(monkeypatch)
    run_dir = tmp_path / "run"
    recipe = checked(
        _recipe(tiny_llama, run_dir, trainer={"steps": 500}, rollout={"stall_timeout_s": 1.5})
    )
    with pytest.raises(RunStopped) as err:
        train(recipe, live=False)
    message = " ".join(str(err.value).split())
    assert (
        "rollouts cannot go on: no rollout arrived for" in message
        and "(rollout.stall_timeout_s: 1.5)" in message
    )
    assert (
        "group(s) in flight" in message
        and "grant(s) left" in message
        and "engine versions [" in message
    )
    # nothing in flight; paused or not: the stall may come while a push flips the engine
    assert re.search(r"engine 0: 0 running, 0 waiting, (not )?paused, active slot \d", message), (
        message
    )
    assert _saved_version(run_dir) == run_metrics(run_dir)[-1]["version"] >= 2
    assert _gone(engines[0].info.pid)


@pytest.mark.alone  # a time bound: no other test beside it
@pytest.mark.timeout(120)
def test_a_hung_engine_is_noticed_within_the_bound(tmp_path, tiny_llama, monkeypatch):
    """SIGSTOP: the engine is alive but silent. Whatever the trainer was doing (waiting for rollouts
    or pushing), the run stops within about stall_timeout_s, names the engine, saves, and kills
    it."""
    engines = _capture_engine(monkeypatch)
    run_dir = tmp_path / "run"
    recipe = checked(
        _recipe(
            tiny_llama,
            run_dir,
            trainer={"steps": 500},
            rollout={"stall_timeout_s": 2},
            engine={"restarts": 0},
        )
    )

    def stop_engine():
        _when(lambda: (run_dir / "metrics.jsonl").exists() and len(run_metrics(run_dir)) >= 2)
        os.kill(engines[0].info.pid, signal.SIGSTOP)

    threading.Thread(target=stop_engine, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(RunStopped) as err:
        train(recipe, live=False)
    message = " ".join(str(err.value).split())
    # whichever noticed first: a control call's bound, the pool's ping, or the rollout stall
    assert (
        (
            f"engine process {engines[0].info.pid} did not answer" in message
            and "it is hung" in message
        )
        or ("neither answered nor made progress for" in message and "(hung)" in message)
        or ("no rollout arrived" in message and "engine 0: no answer within 2 s" in message)
    ), message
    assert _saved_version(run_dir) == run_metrics(run_dir)[-1]["version"] >= 2
    # seconds, not for ever (a loaded 2-core CI machine is slow to start)
    assert time.monotonic() - t0 < 60
    assert _gone(engines[0].info.pid)


def test_a_sample_aborted_too_often_stops_with_its_prompt(tiny_llama):
    """Every request aborted (a pause in abort mode, again and again): after max_attempts the
    producer stops with the prompt and the last finish reason instead of resubmitting for ever."""
    from transformers import AutoTokenizer

    from orbit.engine.base import SamplingParams
    from orbit.engine.embedded import start_embedded_engine
    from orbit.tasks.pattern import PatternTask

    task = PatternTask(AutoTokenizer.from_pretrained(tiny_llama))
    with start_embedded_engine(tiny_llama, max_running=8) as engine:
        pool = EnginePool([engine], [8], monitor=False)
        pipeline = Pipeline(pool, 1, 0, group_size=2, max_inflight=8)
        producer = Producer(
            pipeline,
            pool,
            task,
            SamplingParams(max_new_tokens=200, ignore_eos=True),
            seed=0,
            max_attempts=3,
        )
        stop = threading.Event()

        def abort_everything():
            while not stop.is_set():
                engine.pause_generation("abort")
                engine.continue_generation()
                time.sleep(0.01)

        aborter = threading.Thread(target=abort_everything, daemon=True)
        aborter.start()
        pipeline.grant(1)
        producer.start()
        try:
            with pytest.raises(RolloutError) as err:
                pipeline.take(1, 0, stall_s=30)
        finally:
            stop.set()
            aborter.join()
            producer.stop()
    cause = str(err.value.__cause__)
    assert (
        "prompt 'pattern-" in cause
        and "aborted 3 times" in cause
        and "rollout.max_attempts: 3" in cause
    )
    assert "last finish reason 'abort'" in cause


@pytest.mark.alone  # a time bound: no other test beside it
def test_stall_error_from_a_producer_that_never_gets_an_answer():
    """Unit test of the pipeline's bound: nothing in flight ever answers."""
    from concurrent.futures import Future

    from engine_helpers import FakeEngine

    from orbit.engine.base import EngineStats, SamplingParams
    from orbit.tasks.pattern import PatternTask

    class Silent(FakeEngine):  # a test double for one piece: an engine whose requests never finish
        def generate(self, *a, **k):
            return Future()

        def stats(self):
            return EngineStats(running=2, waiting=0, paused=False, active_slot=0)

    class Tok:
        eos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [1, 2, 3]

    pool = EnginePool([Silent()], [8], monitor=False)
    pipeline = Pipeline(pool, 1, 1, group_size=2, max_inflight=8)
    producer = Producer(pipeline, pool, PatternTask(Tok()), SamplingParams(), seed=0)
    pipeline.grant(3)
    producer.start()
    t0 = time.monotonic()
    with pytest.raises(RolloutError) as err:
        pipeline.take(1, 0, stall_s=1.0)
    producer.stop()
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert "no rollout arrived for 1 s" in msg and "2 group(s) in flight (4 request(s))" in msg
    assert "engine 0: 2 running, 0 waiting, not paused" in msg and "grant(s) left" in msg


# ---- failed starts, resume -----------------------------------------------------------------------


def test_a_failed_start_leaves_nothing_in_the_way(tmp_path, tiny_llama, monkeypatch):
    run_dir = tmp_path / "run"
    recipe = checked(_recipe(tiny_llama, run_dir, trainer={"steps": 2}))

    def broken(*args, **kwargs):
        raise EngineDeadError("engine process failed to start (exit code 1)")

    with monkeypatch.context() as m:
        m.setattr(orbit.run.engines, "start_pool", broken)
        with pytest.raises(EngineDeadError):
            train(recipe, live=False)
    assert not run_dir.exists()
    # --resume of a run that never stepped says so
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")  # what older versions left behind
    with pytest.raises(RecipeError, match="never completed a step, so there is nothing to resume"):
        train(recipe, resume=True, live=False)
    # and the plain re-run just works
    assert train(recipe, live=False).steps_done == 2


@pytest.mark.parametrize("mode", ["sync-adapter", "sync"])
def test_a_serial_run_resumed_equals_the_run_never_stopped(tmp_path, tiny_llama, mode):
    """Fixed seeds, embedded engine: stop at step 2, resume to 4 — steps 2 and 3 and the final
    adapter are those of the uninterrupted run (no prompt replayed or skipped, the same random
    state)."""
    patch = dict(mode=mode, adapter={"dropout": 0.1}, rollout={"max_new_tokens": 10})
    whole = tmp_path / "whole"
    train(checked(_recipe(tiny_llama, whole, trainer={"steps": 4}, **patch)), live=False)
    part = tmp_path / "part"
    train(checked(_recipe(tiny_llama, part, trainer={"steps": 2}, **patch)), live=False)
    train(
        checked(_recipe(tiny_llama, part, trainer={"steps": 4}, **patch)), resume=True, live=False
    )
    a, b = run_metrics(whole), run_metrics(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for x, y in zip(a, b, strict=True):
        assert (
            x["reward_mean"] == y["reward_mean"] and x["tokens_generated"] == y["tokens_generated"]
        )
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-6)
    wa, wb = (
        load_file(whole / "adapter" / "adapter_model.safetensors"),
        load_file(part / "adapter" / "adapter_model.safetensors"),
    )
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
    assert any(float(t.abs().max()) > 0 for k, t in wa.items() if "lora_B" in k)  # it trained
    assert torch.equal(torch.tensor([r["version"] for r in a]), torch.tensor([1, 2, 3, 4]))


def test_a_call_cut_off_by_the_engines_shutdown_says_the_engine_is_gone():
    """A lost SGLang engine is shut down while its updater may still be inside a call: the call's
    future is cancelled, and the updater must hear EngineDeadError (and drop the engine), not a bare
    CancelledError that it would hand to the trainer as a refused push."""
    import asyncio
    from concurrent.futures import Future

    from orbit.engine.base import EngineDeadError
    from orbit.engine.sglang.event_loop import EngineLoop

    async def alive():
        return None

    cut = Future()
    cut.cancel()
    loop = EngineLoop(asyncio.new_event_loop(), alive, "engine 1")
    try:
        loop.dead = EngineDeadError("engine 1 was shut down")
        with pytest.raises(EngineDeadError, match="engine 1 was shut down"):
            loop.wait(cut)
    finally:

        async def nothing():
            pass

        loop.close(nothing)
