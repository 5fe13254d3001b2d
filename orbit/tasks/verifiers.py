"""`verifiers`: a verifiers environment's taskset as an agent task.

    task: {name: verifiers, taskset: recipes/verifiers/sums.py, python: .venv-verifiers/bin/python}

The environment runs in its own interpreter (`python`: the virtualenv verifiers is installed in,
`make verifiers`), one bridge process for the run (verifiers_bridge.py): verifiers 0.4 needs openai
and transformers newer than the ones SGLang pins, so the two cannot share Orbit's environment. Each
episode is one of the taskset's tasks; the bridge runs it with every model call sent to the
episode's own URL on Orbit's endpoint (orbit/agents/), which records the tokens, and the reward is
the one the taskset's rubric gives. Held out for `orbit eval`: every `holdout_every`-th task.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from pathlib import Path

from orbit.tasks.agent import AgentTask, episode_score, held_out
from orbit.tasks.base import Prompt, Score, TaskError

BRIDGE = Path(__file__).with_name("verifiers_bridge.py")
START_TIMEOUT_S = 180.0  # importing verifiers and loading a taskset on a loaded 2-core machine


class Bridge:
    """The bridge process: its task list, and episodes asked of it by id (any thread, any event
    loop)."""

    def __init__(self, python: str, taskset: str, harness: str | None) -> None:
        cmd = [
            python,
            "-P",
            str(BRIDGE),
            "--taskset",
            taskset,
            *(["--harness", harness] if harness else []),
        ]
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
        except OSError as err:
            raise ValueError(
                f"task.python: cannot run {python!r} ({err}); make verifiers sets up "
                ".venv-verifiers"
            ) from None
        # the three pipes opened above
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.to_bridge, self.from_bridge, self.bridge_errors = (
            self.proc.stdin,
            self.proc.stdout,
            self.proc.stderr,
        )
        self._stderr: deque[str] = deque(maxlen=20)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._next = 0
        threading.Thread(target=self._drain, name="orbit-verifiers-stderr", daemon=True).start()
        first = self._first_line()
        if "error" in first:
            self.close()
            raise ValueError(
                f"task.taskset: verifiers could not load {taskset!r}: {first['error']}"
            )
        self.tasks: list[dict] = first["tasks"]
        threading.Thread(target=self._read, name="orbit-verifiers", daemon=True).start()

    def _first_line(self) -> dict:
        box: list[str] = []
        reader = threading.Thread(
            target=lambda: box.append(self.from_bridge.readline()), daemon=True
        )
        reader.start()
        reader.join(START_TIMEOUT_S)
        if not box or not box[0]:
            self.close()
            why = f"did not answer within {START_TIMEOUT_S:g} s" if not box else "exited"
            raise ValueError(f"task.python: the verifiers bridge {why}: {self.stderr()}")
        try:
            return json.loads(box[0])
        except json.JSONDecodeError:
            self.close()
            raise ValueError(
                f"task.python: the verifiers bridge said {box[0].strip()[:200]!r} where its task "
                f"list was due: {self.stderr()}"
            ) from None

    def _drain(self) -> None:
        for line in self.bridge_errors:
            self._stderr.append(line.rstrip())

    def stderr(self) -> str:
        return " | ".join(self._stderr) or "(nothing on stderr)"

    def _read(self) -> None:
        for line in self.from_bridge:
            try:
                answer = json.loads(line)
                with self._lock:
                    fut = self._pending.pop(answer["id"], None)
            except (json.JSONDecodeError, KeyError, TypeError):
                # not the protocol's: kept for the next error message
                self._stderr.append(line.rstrip())
                continue
            if fut is not None:
                _settle(fut, result=answer)
        with self._lock:  # the bridge is gone: every episode waiting on it is lost
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            _settle(fut, error=TaskError(f"the verifiers bridge exited: {self.stderr()}"))

    def episode(self, task: int, base_url: str, model: str) -> Future:
        """A Future of the bridge's answer for one episode of task `task`."""
        fut: Future = Future()
        with self._lock:
            if self.proc.poll() is not None:
                raise TaskError(f"the verifiers bridge exited: {self.stderr()}")
            self._next += 1
            self._pending[self._next] = fut
            request = {"id": self._next, "task": task, "base_url": base_url, "model": model}
            try:
                self.to_bridge.write(json.dumps(request) + "\n")
            except OSError:
                self._pending.pop(self._next)
                raise TaskError(f"the verifiers bridge exited: {self.stderr()}") from None
        return fut

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.to_bridge.close()  # the bridge ends its episodes and exits
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def _settle(fut: Future, result: object = None, error: BaseException | None = None) -> None:
    """Answer an episode's future once: one its episode gave up on (a timeout cancels it) keeps what
    it has."""
    try:
        fut.set_exception(error) if error is not None else fut.set_result(result)
    except InvalidStateError:
        pass


class VerifiersTask(AgentTask):
    """The taskset's tasks as agent episodes; the bridge runs each one."""

    name = "verifiers"

    def __init__(
        self,
        tokenizer,
        taskset: str,
        python: str,
        harness: str | None = None,
        holdout_every: int = 10,
        success: float = 1.0,
    ) -> None:
        self.tokenizer, self.success = tokenizer, success
        self.entry = f"the verifiers taskset {taskset}"
        self.bridge = Bridge(python, taskset, harness)
        rows = [{"task": i, **t} for i, t in enumerate(self.bridge.tasks)]
        try:
            self.train, self.eval = held_out(
                rows, holdout_every, f"the verifiers taskset {taskset}"
            )
        except ValueError:
            self.bridge.close()
            raise

    async def run(self, client, model: str, prompt: Prompt) -> Score:
        """One episode of the prompt's task, run by the bridge against this episode's URL."""
        answer = await asyncio.wrap_future(
            self.bridge.episode(prompt.meta["example"]["task"], str(client.base_url), model)
        )
        if answer.get("reward") is None or answer.get("errors"):
            raise TaskError(
                f"{self.entry}: the episode failed: "
                f"{'; '.join(answer.get('errors') or ['no reward'])}"
            )
        return episode_score(
            answer["reward"], {"rewards": answer["rewards"]}, self.entry, self.success
        )

    def close(self) -> None:
        self.bridge.close()
