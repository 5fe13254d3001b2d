"""`task: {name: reasoning-gym}`: reasoning-gym's generators and checkers behind a bounded worker,
splits that never overlap, what counts as correct, and the traps of reasoning-gym 0.1.25."""

from __future__ import annotations

import pytest
from run_helpers import checked, recipe_dict, run_metrics
from transformers import AutoTokenizer

import orbit.tasks.gym as gym
from orbit.config import RecipeError, TaskConfig
from orbit.tasks import make_task

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _task(tok, **options):
    return make_task(TaskConfig(name="reasoning-gym", **options), tok)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_splits_never_overlap_and_are_seeded(tok):
    task = _task(tok, dataset="chain_sum", config=CHAIN, eval_size=50)
    try:
        held = {e["question"] for e in task.held_out}
        train = [next(p) for p in [task.prompts(0)] for _ in range(300)]
        assert not held & {p.text for p in train}
        assert [p.text for p in train[:20]] == [
            p.text for p in [next(s) for s in [task.prompts(0)] for _ in range(20)]
        ]
        assert [p.text for p in train[:20]] != [
            p.text for p in [next(s) for s in [task.prompts(1)] for _ in range(20)]
        ]
        evals = task.prompts(0, "eval")
        assert [next(evals).text for _ in range(50)] == [e["question"] for e in task.held_out]
    finally:
        task.close()


def test_what_counts_as_correct(tok):
    """Correct only at a score of 1.0; the dataset's partial credit (a longer answer containing the
    right one) is no reward unless partial_credit; the answer is read from its tag, or the final
    value."""
    task = _task(tok, dataset="chain_sum", config=CHAIN)
    credit = _task(tok, dataset="chain_sum", config=CHAIN, partial_credit=True)
    final = _task(tok, dataset="chain_sum", config=CHAIN, answer="final")
    try:
        p = next(task.prompts(0))
        right = task.score(p, _ids(tok, f"so <answer>{p.answer}</answer>"))
        assert right.reward == 1.0 and right.info["correct"]
        longer = task.score(p, _ids(tok, f"<answer>{p.answer} 123</answer>"))
        assert 0 < longer.info["score"] < 1 and longer.reward == 0.0 and not longer.info["correct"]
        assert (
            credit.score(p, _ids(tok, f"<answer>{p.answer} 123</answer>")).reward
            == longer.info["score"]
        )
        assert task.score(p, _ids(tok, f"it is {p.answer}")).info["failure_mode"] == "wrong_format"
        assert final.score(p, _ids(tok, f"well, 3 and then {p.answer}")).reward == 1.0
        assert final.score(p, _ids(tok, f"{p.answer}, no, 123")).reward == 0.0
    finally:
        for t in (task, credit, final):
            t.close()


def test_a_score_that_raises_is_a_wrong_answer_with_its_reason(tok):
    task = _task(tok, dataset="prime_factorization")
    try:
        p = next(task.prompts(0))
        s = task.score(p, _ids(tok, "<answer>blah</answer>"))
        assert (
            s.reward == 0.0
            and s.info["failure_mode"] == "score_error"
            and "ValueError" in s.info["score_error"]
        )
    finally:
        task.close()


def test_composite_mixes_datasets(tok):
    config = {
        "datasets": [
            {"name": "chain_sum", "weight": 1, "config": CHAIN},
            {"name": "leg_counting", "weight": 1, "config": {"min_animals": 1, "max_animals": 2}},
        ]
    }
    task = _task(tok, dataset="composite", config=config, eval_size=40)
    try:
        prompts = [next(s) for s in [task.prompts(0)] for _ in range(30)]
        assert {p.meta["entry"]["metadata"]["source_dataset"] for p in prompts} == {
            "chain_sum",
            "leg_counting",
        }
        assert all(
            task.score(p, _ids(tok, f"<answer>{p.answer}</answer>")).reward == 1.0 for p in prompts
        )
    finally:
        task.close()


def test_traps_fail_at_load_naming_the_field(tok, monkeypatch):
    def error(**options) -> str:
        with pytest.raises(RecipeError) as err:
            _task(tok, **options).close()
        return str(err.value)

    assert "task.dataset: 'game_of_life_halting' is refused: its score_answer gives 1.0" in error(
        dataset="game_of_life_halting"
    )
    assert "task.dataset: 'nope' is not a reasoning-gym dataset" in error(dataset="nope")
    assert "task.config: reasoning-gym's chain_sum refused it: TypeError" in error(
        dataset="chain_sum", config={"bogus": 1}
    )
    assert "too few distinct problems" in error(
        dataset="chain_sum", config={**CHAIN, "max_digits": 1}, eval_size=5000
    )
    with pytest.raises(RecipeError, match="task.answer: Input should be 'tag' or 'final'"):
        from orbit.config import parse_recipe

        parse_recipe(
            {
                "model": "m",
                "task": {"name": "reasoning-gym", "dataset": "chain_sum", "answer": "math"},
            }
        )
    monkeypatch.setattr(gym, "MAKE_TIMEOUT_S", 3.0)  # base_conversion with one base never returns
    assert "did not return 200 problems within 3 s" in error(
        dataset="base_conversion", config={"min_base": 5, "max_base": 5}
    )
    with pytest.raises(RecipeError, match="task.dataset: required for task 'reasoning-gym'"):
        parse_recipe({"model": "m", "task": {"name": "reasoning-gym"}})


@pytest.mark.slow
def test_a_reasoning_gym_run(tmp_path, tiny_llama):
    out = tmp_path / "run"
    task = {"name": "reasoning-gym", "dataset": "chain_sum", "config": CHAIN, "answer": "final"}
    from orbit.run.lifecycle import train

    train(checked(recipe_dict(tiny_llama, out, task=task)), live=False)
    rows = run_metrics(out)
    assert len(rows) == 3 and all(r["logprob_diff"] < 1e-3 for r in rows)
    assert all("failure_modes" in r for r in rows)
