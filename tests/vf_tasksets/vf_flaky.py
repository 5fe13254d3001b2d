"""A verifiers taskset whose rubric fails on one episode in 4 (by the bridge's count of scored
episodes): those episodes are lost, not the run."""

import itertools
import json
from pathlib import Path

import verifiers.v1 as vf

DATA = Path(__file__).resolve().parents[1] / "data" / "questions.jsonl"
_scored = itertools.count()


class FlakyData(vf.TaskData):
    answer: str


class FlakyTask(vf.Task[FlakyData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def digits(self, task: FlakyData, trace: vf.Trace) -> float:
        if next(_scored) % 4 == 1:
            raise ValueError("the rubric's own bug")
        reply = trace.last_reply or ""
        return sum(d in reply for d in task.answer) / len(task.answer)


class FlakyTaskset(vf.Taskset[FlakyTask, vf.TasksetConfig]):
    def load(self):
        for line in DATA.read_text().splitlines():
            row = json.loads(line)
            yield FlakyTask(
                FlakyData(prompt=row["question"], answer=row["answer"]), self.config.task
            )


__all__ = ["FlakyData", "FlakyTask", "FlakyTaskset"]
