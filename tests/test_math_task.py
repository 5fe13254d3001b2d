"""The `math` task and math-verify answers: dataset files through `datasets` (jsonl, json, parquet,
csv, a save_to_disk directory), GSM8K's shape as it is, mapped field names, numeric equivalence, a
bounded check, and bad data named by file and row. The files are the test's own."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from orbit.config import RecipeError, TaskConfig, parse_recipe
from orbit.run.preflight import check_task
from orbit.tasks import make_task
from orbit.tasks.verify import MathChecker

GSM8K_ROWS = [  # GSM8K's own shape: reasoning, then `#### N`
    {
        "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
        "answer": "He has 3 + 4 = 7 apples.\n#### 7",
    },
    {
        "question": "A box holds 12 eggs. How many eggs are in 100 boxes?",
        "answer": "12 * 100 = 1200\n#### 1,200",
    },
    {"question": "Half of 3 over 2?", "answer": "#### 3/4"},
]


@pytest.fixture(scope="module")
def checker():
    c = MathChecker(timeout_s=10)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def _write(path: Path, rows: list[dict]) -> Path:
    """The rows in the format its suffix names."""
    import datasets

    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        datasets.Dataset.from_list(rows).to_csv(str(path))
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize(
    "answer, text, correct",
    [
        ("42", "The answer is 42.", True),
        ("42", "I think it is 42.0", True),
        ("1,234", "So we get 1234 in all.", True),
        ("1234", "#### 1,234", True),
        ("3/4", "so \\boxed{0.75}", True),
        ("0.75", "the result is \\boxed{\\frac{3}{4}}", True),
        ("42", "17 + 25 = 32 and that is it", False),  # the final number is the answer read
        # the question restated is not an answer (math-verify would evaluate it)
        ("95", "So, 38 + 57 = ", False),
        (
            "42",
            "\\boxed{41} ... no wait, 42? Final: \\boxed{41}",
            False,
        ),  # the last boxed one counts
    ],
)
def test_answers_are_read_and_compared_by_value(checker, answer, text, correct):
    verdict = checker.check(text, answer)
    assert verdict.correct is correct and verdict.given is not None and not verdict.timed_out


def test_a_completion_without_an_answer_gives_none(checker):
    verdict = checker.check("I do not know.", "7")
    assert not verdict.correct and verdict.given is None


@pytest.mark.alone  # a time bound: no other test beside it
def test_a_check_is_bounded_in_time():
    """A check that does not come back in time is cut (its process killed and started again), counts
    as wrong, and says so; the next check works."""
    checker = MathChecker(timeout_s=3)
    try:
        assert checker.check("7", "7").correct  # started
        os.kill(checker._worker._proc.pid, signal.SIGSTOP)  # stuck in a check, as sympy can get
        t0 = time.monotonic()
        verdict = checker.check("The answer is 7", "7")
        assert verdict.timed_out and not verdict.correct and time.monotonic() - t0 < 5
        assert checker.check("The answer is 7", "7").correct  # a fresh process
        t0 = time.monotonic()
        # sympy's long road: math-verify's limit
        verdict = checker.check("\\boxed{2^{2^{2^{2^{2^{10}}}}}}", "7")
        assert not verdict.correct and time.monotonic() - t0 < 5
    finally:
        checker.close()


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv", ""])
def test_gsm8k_shaped_files_load_in_every_format(tmp_path, tok, suffix):
    path = _write(tmp_path / f"gsm8k{suffix or '_dir'}", GSM8K_ROWS * 4)
    task = make_task(TaskConfig(name="math", path=str(path), holdout_every=4), tok)
    try:
        prompts = [next(task.prompts(0)) for _ in range(1)] + list(_take(task.prompts(0), 8))
        assert {p.answer for p in prompts} <= {"7", "1,200", "3/4"}
        held_out = list(_take(task.prompts(0, "eval"), 3))
        assert held_out and all(p.id.startswith("math-eval-") for p in held_out)
        right = task.score(
            prompts[0], tok.encode(f"The answer is {prompts[0].answer.replace(',', '')}.")
        )
        assert (
            right.reward == 1.0
            and right.info["correct"]
            and right.info["failure_mode"] == "success"
        )
        wrong = task.score(prompts[0], tok.encode("The answer is 99."))
        assert wrong.reward == 0.0 and wrong.info["failure_mode"] == "wrong_answer"
        none = task.score(prompts[0], tok.encode("no idea"))
        assert none.info["failure_mode"] == "wrong_format" and not none.info["format_ok"]
    finally:
        task.close()


def _take(stream, n):
    for _ in range(n):
        yield next(stream)


def test_field_names_map_and_the_format_reward(tmp_path, tok):
    rows = [{"problem": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(20)]
    path = _write(tmp_path / "mine.jsonl", rows)
    task = make_task(
        TaskConfig(
            name="math",
            path=str(path),
            question_field="problem",
            answer_field="solution",
            template="Q: {question}\nA:",
            format_reward=0.1,
        ),
        tok,
    )
    try:
        p = next(task.prompts(0))
        assert p.text.startswith("Q: What is") and p.text.endswith("A:")
        assert task.score(p, tok.encode(f"it is {p.answer}")).reward == pytest.approx(1.1)
        # an answer, wrong
        assert task.score(p, tok.encode("it is 1000")).reward == pytest.approx(0.1)
    finally:
        task.close()


def test_bad_data_is_one_line_naming_the_file_and_row(tmp_path):
    no_answer = _write(tmp_path / "no_answer.jsonl", [{"question": "1+1?", "solution": "2"}])
    bad_answer = _write(
        tmp_path / "bad_answer.jsonl",
        [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### four-ish"}],
    )
    empty = _write(
        tmp_path / "empty.jsonl",
        [{"question": "1+1?", "answer": "2"}, {"question": " ", "answer": "3"}],
    )
    cases = [
        (
            no_answer,
            f"task.path: {no_answer}: no 'answer' field (its fields: question, solution; map yours",
        ),
        (
            bad_answer,
            f"task.path: {bad_answer} row 2: the answer 'four-ish' is not a value math-verify can "
            "read",
        ),
        (empty, f"task.path: {empty} row 2: 'question' is empty"),
        (tmp_path / "missing.jsonl", f"task.path: {tmp_path / 'missing.jsonl'}: no such file"),
        (tmp_path / "x.txt", f"task.path: {tmp_path / 'x.txt'}: no such file"),
    ]
    for path, message in cases:
        recipe = parse_recipe({"model": ".", "task": {"name": "math", "path": str(path)}})
        with pytest.raises(RecipeError) as err:
            check_task(recipe.task)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_math_needs_a_path_and_a_system_prompt_needs_chat(tok, tmp_path):
    with pytest.raises(RecipeError, match="task.path: required for task 'math'"):
        parse_recipe({"model": ".", "task": {"name": "math"}})
    path = _write(tmp_path / "d.jsonl", GSM8K_ROWS)
    with pytest.raises(ValueError, match="task.system: a system prompt needs task.chat: true"):
        make_task(TaskConfig(name="math", path=str(path), system="Think step by step."), tok)


def test_arith_reads_answers_with_math_verify_when_asked(tok):
    task = make_task(TaskConfig(name="arith", answer="math"), tok)
    try:
        p = next(task.prompts(0))
        # its own words: the last number
        assert task.score(p, tok.encode(f"{p.text}{p.answer}")).info["correct"]
        assert task.stop_token_ids == ()  # no answer tag to stop at
    finally:
        task.close()
    tagged = make_task(TaskConfig(name="arith"), tok)
    # the tag reading wants the tag
    assert not tagged.score(p, tok.encode(p.answer)).info["correct"]
