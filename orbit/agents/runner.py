"""Running agent episodes: each on a thread of its own, with its own event loop and `openai` client.

An episode opens on the endpoint (bound to its group's engine and slot), runs the task's agent with
a client whose base URL names it, and closes; its record becomes the trajectory (record.py) and the
agent's reward its score. A thread per episode, so an agent that blocks (synchronous code where it
should await) holds only its own episode. An agent that raises, runs past `timeout_s` or returns a
reward that is not a finite number loses that episode: the future fails with `EpisodeFailed`, whose
message carries the agent's traceback.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from orbit.agents.endpoint import Endpoint
from orbit.agents.record import EpisodeRecord, Trajectory, trajectory
from orbit.engine.base import SamplingParams
from orbit.tasks.base import Prompt, Score, TaskError

# past the timeout, for an agent that ignores cancellation, before the episode is given up
_GRACE_S = 5.0


class EpisodeFailed(RuntimeError):
    """An agent episode that gives nothing to train on; the message says why (with the agent's
    traceback)."""


@dataclass
class AgentEpisode(Trajectory):
    """A finished episode: its trajectory, read as a Completion, and the agent's score."""

    score: Score = field(default_factory=lambda: Score(0.0))
    episode: str = ""


class AgentRunner:
    """Starts episodes of an agent task (`task.run(client, model, prompt)`) against an endpoint."""

    def __init__(
        self, endpoint: Endpoint, task, sampling: SamplingParams, timeout_s: float
    ) -> None:
        self.endpoint, self.task, self.sampling, self.timeout_s = (
            endpoint,
            task,
            sampling,
            timeout_s,
        )

    def start(
        self,
        prompt: Prompt,
        engine: int | None,
        slot: object,
        name: str | None = None,
        sampling: SamplingParams | None = None,
        meta: dict | None = None,
    ) -> Future:
        """Run one episode of `prompt` on `engine` and `slot`; a Future of its AgentEpisode. `meta`
        goes with every request of the episode (its group, for the timeline)."""
        episode = self.endpoint.open(engine, slot, sampling or self.sampling, name, meta)
        fut: Future = Future()
        thread = threading.Thread(
            target=self._run,
            args=(episode, prompt, fut),
            name=f"orbit-agent-{episode}",
            daemon=True,
        )
        timer = threading.Timer(self.timeout_s + _GRACE_S, self._give_up, args=(episode, fut))
        timer.daemon = True
        thread.start()
        timer.start()
        fut.add_done_callback(lambda _: timer.cancel())
        return fut

    def _run(self, episode: str, prompt: Prompt, fut: Future) -> None:
        try:
            score = asyncio.run(self._episode(episode, prompt))
            record = self._forget(episode)
            if record is None:
                return  # given up already
            path = trajectory(record)
            if path is None:
                why = (
                    f"the agent's {record.calls} call(s) all failed; the last: {record.failed}"
                    if record.failed
                    else "the agent returned without calling the model"
                )
                _settle(fut, error=EpisodeFailed(why))
                return
            info = {**score.info, "calls": record.calls, "forks": len(record.forks)}
            if record.forks:
                info["fork_reasons"] = record.forks
            if record.overridden:
                info["sampling_overridden"] = sorted(record.overridden)
            _settle(
                fut,
                result=AgentEpisode(**vars(path), score=Score(score.reward, info), episode=episode),
            )
        # whatever the agent did, the episode is lost, not the run
        except BaseException as err:  # noqa: BLE001
            _settle(fut, error=EpisodeFailed(_why(err)))
            self._forget(episode)

    async def _episode(self, episode: str, prompt: Prompt) -> Score:
        import openai

        client = openai.AsyncOpenAI(
            base_url=self.endpoint.base_url(episode),
            api_key="orbit",
            max_retries=0,
            timeout=self.timeout_s,
        )
        try:
            return await asyncio.wait_for(
                self.task.run(client, self.endpoint.model, prompt), self.timeout_s
            )
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11 on
            raise EpisodeFailed(
                f"the agent ran past rollout.episode_timeout_s ({self.timeout_s:g} s)"
            ) from None
        finally:
            await client.close()

    def _give_up(self, episode: str, fut: Future) -> None:
        self._forget(episode)
        _settle(
            fut,
            error=EpisodeFailed(
                f"the agent ran past rollout.episode_timeout_s ({self.timeout_s:g} s) and did not "
                "stop when cancelled (it blocks instead of awaiting)"
            ),
        )

    def _forget(self, episode: str) -> EpisodeRecord | None:
        try:
            return self.endpoint.close(episode)
        except KeyError:
            return None


def _settle(fut: Future, result=None, error: BaseException | None = None) -> None:
    try:
        fut.set_exception(error) if error is not None else fut.set_result(result)
    except InvalidStateError:
        pass  # the other side (the timeout, or the thread) settled it first


def _why(err: BaseException) -> str:
    # Orbit's own verdict (a timeout, a reward that is no number)
    if isinstance(err, EpisodeFailed | TaskError):
        return str(err)
    trace = "".join(traceback.format_exception(err)).rstrip()
    return f"the agent raised {type(err).__name__}: {err}\n{trace}"
