"""`reasoning-gym`: problems drawn from reasoning-gym's procedural generators, scored by each
dataset's own `score_answer`.

    task: {name: reasoning-gym, dataset: chain_sum, config: {min_terms: 2, max_terms: 2}, chat:
    true}

Splits that never overlap: the held-out problems are `eval_size` drawn with a fixed seed (the same
for every run); training draws with the run's seed and skips every problem whose question is held
out. A dataset whose problems are too few to leave any for training fails at load.

What counts as correct. The answer is read from the completion (`answer: tag`, reasoning-gym's own
`<answer>...</answer>`; or `answer: final`, the last `\\boxed{}`, `####` value or number, else the
last line) and scored by the dataset's `score_answer`. Some datasets give partial credit (0.25 to a
longer answer that contains the right one): an answer is correct only at a score of 1.0, and the
reward is 1 for correct and 0 otherwise, unless `partial_credit: true` makes the score itself the
reward.

Traps in reasoning-gym 0.1.25, handled. Generation and scoring run in a worker process of their own
with bounded time (`base_conversion` with min_base == max_base never returns): a generator that does
not finish fails at load, a score that raises (`prime_factorization` on a non-numeric answer) or
does not come back counts as a wrong answer, its reason in the sample (`failure_mode: score_error`).
`game_of_life_halting` is refused: its `score_answer` gives 1.0 to any non-empty answer. The
datasets without a gold answer (boxnet, graph_color, propositional_logic, rubiks_cube, rush_hour)
are scored by their own checkers, as any other. `composite` mixes datasets: `config: {datasets:
[{name, weight, config}, ...]}`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from multiprocessing.connection import Connection

from orbit.tasks.base import Prompt, Score
from orbit.tasks.common import check_chat, decode, encode_prompt
from orbit.tasks.verify import answer_text
from orbit.tasks.worker import Worker, serve_requests

REFUSED = {
    "game_of_life_halting": "its score_answer gives 1.0 to any non-empty answer, so every episode "
    "would be rewarded"
}
EVAL_SEED = 0x0E7A1  # the held-out problems: the same for every run and every `orbit eval`
CHUNK = 500  # training problems generated at a time
MAKE_TIMEOUT_S = 60.0
SCORE_TIMEOUT_S = 5.0
TAG_SYSTEM = (
    "Answer the question. Give the final answer, and only it, inside <answer></answer> tags, for "
    "example <answer>42</answer>."
)
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class GymTask:
    name = "reasoning-gym"

    def __init__(
        self,
        tokenizer,
        dataset: str,
        config: dict | None = None,
        answer: str = "tag",
        template: str = "{question}",
        chat: bool = False,
        system: str | None = None,
        eval_size: int = 200,
        partial_credit: bool = False,
    ) -> None:
        import reasoning_gym.factory

        if dataset in REFUSED:
            raise ValueError(f"task.dataset: {dataset!r} is refused: {REFUSED[dataset]}")
        if dataset not in reasoning_gym.factory.DATASETS:
            raise ValueError(
                f"task.dataset: {dataset!r} is not a reasoning-gym dataset (e.g. chain_sum, "
                "basic_arithmetic, simple_equations, leg_counting; or composite)"
            )
        if answer not in ("tag", "final"):
            raise ValueError(f"task.answer: 'tag' or 'final' for reasoning-gym, got {answer!r}")
        self.dataset, self.config = dataset, dict(config or {})
        self.tokenizer, self.answer, self.template, self.partial_credit = (
            tokenizer,
            answer,
            template,
            partial_credit,
        )
        self.chat = check_chat(tokenizer, chat)
        self.system = system if system is not None or answer != "tag" or not chat else TAG_SYSTEM
        self._worker = Worker(
            _serve, (dataset, self.config), "orbit-reasoning-gym", SCORE_TIMEOUT_S
        )
        try:
            self.held_out = self._make(EVAL_SEED, eval_size)
            self._held_questions = {e["question"] for e in self.held_out}
            if not any(e["question"] not in self._held_questions for e in self._make(1, CHUNK)):
                raise ValueError(
                    f"task.config: {dataset} with this config has too few distinct problems: "
                    f"{eval_size} held out leave none to train on (lower eval_size, or widen the "
                    "config)"
                )
        except BaseException:
            self._worker.close()  # no task holds it: nobody else would stop it
            raise

    def _make(self, seed: int, size: int) -> list[dict]:
        kind, value = self._worker.ask(("make", seed, size), timeout_s=MAKE_TIMEOUT_S)
        if kind == "timeout":
            raise ValueError(
                f"task.config: reasoning-gym's {self.dataset} generator did not return {size} "
                f"problems within {MAKE_TIMEOUT_S:g} s (a config with no valid problem, e.g. "
                "base_conversion with min_base == max_base, never returns)"
            )
        if kind == "error":
            raise ValueError(f"task.config: reasoning-gym's {self.dataset} refused it: {value}")
        return value

    def prompts(self, seed: int, split: str = "train") -> Iterator[Prompt]:
        if split == "eval":
            while True:
                for i, entry in enumerate(self.held_out):
                    yield self._prompt(entry, f"eval-{i}")
        chunk = 0
        while True:
            for i, entry in enumerate(self._make(seed * 100_003 + chunk + 1, CHUNK)):
                if entry["question"] not in self._held_questions:
                    yield self._prompt(entry, f"train-{seed}-{chunk}-{i}")
            chunk += 1

    def _prompt(self, entry: dict, key: str) -> Prompt:
        text = self.template.format(question=entry["question"])
        return Prompt(
            id=f"rg-{self.dataset}-{key}",
            text=text,
            answer=str(entry.get("answer") or ""),
            prompt_ids=encode_prompt(self.tokenizer, text, self.chat, self.system),
            meta={"entry": entry},
        )

    def read(self, text: str) -> str | None:
        """The answer the completion gives, as this task reads it."""
        if self.answer == "tag":
            found = _TAG.findall(text)
            return found[-1].strip() if found else None
        given = answer_text(text)
        if given is not None and "\\boxed" in given:
            boxed = re.findall(r"\\boxed\{([^{}]*)\}", given)
            given = boxed[-1] if boxed else None
        if given is None:
            lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
            given = lines[-1] if lines else None
        return given

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        given = self.read(decode(self.tokenizer, output_ids))
        if given is None:
            return Score(
                0.0, {"correct": False, "format_ok": False, "failure_mode": "wrong_format"}
            )
        kind, value = self._worker.ask(("score", given, prompt.meta["entry"]))
        if kind != "ok":
            why = (
                f"score_answer took longer than {SCORE_TIMEOUT_S:g} s"
                if kind == "timeout"
                else value
            )
            return Score(
                0.0,
                {
                    "correct": False,
                    "format_ok": True,
                    "failure_mode": "score_error",
                    "score_error": why,
                    "given": given[:200],
                },
            )
        correct = value >= 1.0
        reward = float(value) if self.partial_credit else float(correct)
        return Score(
            reward,
            {
                "correct": correct,
                "format_ok": True,
                "score": value,
                "failure_mode": "success" if correct else "wrong_answer",
                "given": given[:200],
            },
        )

    def close(self) -> None:
        self._worker.close()


def _serve(conn: Connection, dataset: str, config: dict) -> None:
    """The worker: reasoning-gym's generators and checkers, one request at a time."""
    import reasoning_gym

    def make(seed: int, size: int):
        if dataset == "composite":
            from reasoning_gym.composite import DatasetSpec

            specs = [
                DatasetSpec(d["name"], float(d.get("weight", 1.0)), dict(d.get("config") or {}))
                for d in config.get("datasets") or []
            ]
            return reasoning_gym.create_dataset("composite", seed=seed, size=size, datasets=specs)
        return reasoning_gym.create_dataset(dataset, seed=seed, size=size, **config)

    scorer = None

    def answer(request: tuple):
        nonlocal scorer
        try:
            if request[0] == "make":
                data = make(*request[1:])
                return "ok", [
                    {"question": e["question"], "answer": e["answer"], "metadata": e["metadata"]}
                    for e in data
                ]
            scorer = scorer or make(EVAL_SEED, 1)
            return "ok", float(scorer.score_answer(request[1], request[2]))
        except Exception as err:  # noqa: BLE001 - the dataset's own error, as a reason
            return "error", f"{type(err).__name__}: {str(err)[:300]}"

    serve_requests(conn, answer)
