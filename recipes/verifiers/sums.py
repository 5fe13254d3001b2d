"""A verifiers taskset (verifiers 0.4, `verifiers.v1`): the sums of recipes/data/add-2digit.jsonl, each scored
1.0 when the last number of the reply is the sum. Written as any verifiers taskset is; Orbit's `verifiers` task
loads it by file (recipes/smollm2-verifiers.yaml) in the environment's own interpreter."""

import json
import re
from pathlib import Path

import verifiers.v1 as vf

DATA = Path(__file__).resolve().parents[1] / "data" / "add-2digit.jsonl"
SYSTEM = "Answer with the number only."


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for line in DATA.read_text().splitlines():
            row = json.loads(line)
            yield SumTask(SumData(prompt=row["question"], answer=row["answer"], system_prompt=SYSTEM),
                          self.config.task)


__all__ = ["SumData", "SumTask", "SumTaskset"]
