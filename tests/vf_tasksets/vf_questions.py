"""A verifiers taskset for the tests: the sums of tests/data/questions.jsonl. The tiny test model
writes noise, so the reward is the share of the answer's digits in the reply: it varies, which is
all a test of the plumbing needs (that a verifiers taskset learns: docs/agents.md, SmolLM2). Its
rubric prints, as rubrics being debugged do: the bridge's protocol must not mind."""

import json
from pathlib import Path

import verifiers.v1 as vf

DATA = Path(__file__).resolve().parents[1] / "data" / "questions.jsonl"


class QuestionData(vf.TaskData):
    answer: str


class QuestionTask(vf.Task[QuestionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def digits(self, task: QuestionData, trace: vf.Trace) -> float:
        reply = trace.last_reply or ""
        print("a rubric's debugging print: it goes to the bridge's stderr, not into its protocol")
        return sum(d in reply for d in task.answer) / len(task.answer)


class QuestionTaskset(vf.Taskset[QuestionTask, vf.TasksetConfig]):
    def load(self):
        for line in DATA.read_text().splitlines():
            row = json.loads(line)
            yield QuestionTask(
                QuestionData(prompt=row["question"], answer=row["answer"]), self.config.task
            )


__all__ = ["QuestionData", "QuestionTask", "QuestionTaskset"]
