"""One `orbit serve` serving two base models by name (a student and a teacher), each with its own
engines and trainer: the real `tinker` SDK trains, samples and scores on each, and a checkpoint of
one samples on its own base (orbit/serve/bases.py). What a recipe may say about them: its
`serve:` section."""

from __future__ import annotations

import pytest
from tinker_helpers import sdk, serving

from orbit.config import RecipeError, parse_recipe
from orbit.serve.command import served

pytestmark = pytest.mark.slow

ENGINE_AGREEMENT = (
    1e-4  # the embedded engine's logprobs against the trainer's (tests/test_tinker.py)
)


def _diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_a_student_and_a_teacher_each_on_its_own_base(tiny_llama, tiny_qwen2, tmp_path):
    serve = {"names": ["student"], "models": [{"model": str(tiny_qwen2), "names": ["teacher"]}]}
    with serving(tiny_llama, tmp_path / "serve", serve=serve) as (url, service):
        seen = sdk(url, "student", "two_models", arg="teacher")
        student, teacher = service.bases
        clients = list(service.live().values())
        on = {c.model_id: c.base for c in clients}
    assert seen["models"] == ["student", "teacher"]
    assert student.shared is not teacher.shared and len(clients) == 3
    assert sorted(b is teacher.shared for b in on.values()) == [False, True, True]
    # each base samples and scores with its own weights: the two disagree, each agrees with its
    # trainer
    assert _diff(seen["before"]["student"], seen["before"]["teacher"]) > 0.05
    for name in ("student", "teacher"):
        assert _diff(seen["bases"][name], seen["before"][name]) <= ENGINE_AGREEMENT, name
    # the teacher's checkpoint samples on the teacher's engines, with the step it took
    assert _diff(seen["trained"], seen["before"]["teacher"]) > 1e-3
    assert _diff(seen["checkpoint"], seen["trained"]) <= ENGINE_AGREEMENT
    assert _diff(seen["snapshot"], seen["trained"]) <= ENGINE_AGREEMENT
    # the teacher's state is not loaded into the student (whatever their shapes)
    assert "made on another base model than this client's (student)" in seen["across"]
    assert len(seen["sampled"]) == 6
    # a client made from the teacher's state is on the teacher, where it left off
    assert seen["info"] == ["student", "teacher"] and seen["from_state"] == "teacher"
    assert _diff(seen["from_state_forward"], seen["trained"]) <= 1e-6
    assert "base_model 'nobody'" in seen["nobody"] and "student" in seen["nobody"]
    assert "teacher" in seen["nobody"] and str(tiny_llama) not in seen["nobody"]


def test_what_a_recipe_says_about_the_models_it_serves(tiny_llama, tiny_qwen2, tmp_path):
    def recipe(serve: dict):
        return parse_recipe(
            {"model": str(tiny_llama), "engine": {"backend": "embedded"}, "serve": serve}
        )

    with pytest.raises(RecipeError, match=r"serve.models\[0\].names: 'a' is also in serve.names"):
        recipe({"names": ["a"], "models": [{"model": str(tiny_qwen2), "names": ["a"]}]})
    with pytest.raises(RecipeError, match=r"serve.names: an empty name"):
        recipe({"names": [" "]})
    with pytest.raises(RecipeError, match=r"serve.models\[0\].model: no such directory"):
        served(recipe({"models": [{"model": str(tmp_path / "none")}]}))
    with pytest.raises(RecipeError, match=r"serve.models\[0\].model: .* is served already"):
        served(recipe({"models": [{"model": str(tiny_llama)}]}))
    # a name --name gives the first, given to another too; or another's path
    teacher_t = recipe({"models": [{"model": str(tiny_qwen2), "names": ["t"]}]})
    with pytest.raises(RecipeError, match=r"serve.models\[0\].names: 't' is also a name of model:"):
        served(teacher_t, ["t"])
    with pytest.raises(RecipeError, match=r"serve.models\[0\].names: .*qwen2.* is also a name"):
        served(recipe({"models": [{"model": str(tiny_qwen2)}]}), [str(tiny_qwen2)])
    teacher = {
        "model": str(tiny_qwen2),
        "names": ["t"],
        "engine": {"backend": "embedded", "slots": 3},
    }
    (first, first_names), (second, second_names) = served(
        recipe({"names": ["s"], "models": [teacher]})
    )
    assert first_names == {"s", str(tiny_llama)} and first.engine.slots != 3
    assert second_names == {"t", str(tiny_qwen2)} and second.engine.slots == 3
    assert second.model == tiny_qwen2 and second.trainer == first.trainer
