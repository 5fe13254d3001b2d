"""One `orbit serve` serving two base models by name (a student and a teacher), each with its own
engines and trainer: the real `tinker` SDK trains, samples and scores on each, and a checkpoint of
one samples on its own base (orbit/serve/bases.py); tinker-cookbook's runs that need a second
base (on-policy distillation from a teacher on it, twenty_questions' answerer). What a recipe may
say about them: its `serve:` section."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tinker_helpers import cookbook_script, metric_rows, sdk, serving

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
    ranks = parse_recipe({"model": str(tiny_llama), "trainer": {"devices": ["cpu", "cpu"]}})
    with pytest.raises(RecipeError, match=r"trainer.devices: \['cpu', 'cpu'\]; orbit serve trains"):
        served(ranks)
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


def test_on_policy_distillation_from_a_teacher_on_another_base(tiny_llama, tiny_qwen2, tmp_path):
    """The cookbook's on-policy distillation (on one base: tests/test_cookbook.py) with the teacher
    on a second base model of the service (a qwen2 beside the student's llama, by the name the
    recipe gives it): its client trains and saves there, and its checkpoint scores the student's
    samples on its own engines (where a checkpoint samples: the test above)."""
    serve = {"models": [{"model": str(tiny_qwen2), "names": ["teacher"]}]}
    with serving(tiny_llama, tmp_path / "serve", serve=serve) as (url, service):
        printed = cookbook_script(
            "cookbook_distill.py", url, tiny_llama, tmp_path / "distill", "teacher"
        )
        on = {row.id: row.base_model for row in service.store.clients()}
    path = printed.split("TEACHER ", 1)[1].split()[0]
    assert on[path.removeprefix("tinker://").split("/")[0]] == "teacher"
    assert sorted(on.values()) == sorted(["teacher", str(tiny_llama.resolve())])
    rows = metric_rows(tmp_path / "distill", "teacher_kl")
    print(f"\nteacher_kl per step (a teacher on another base): {[r['teacher_kl'] for r in rows]}")
    assert len(rows) == 2 and all(r["teacher_kl"] == r["teacher_kl"] for r in rows)  # not NaN


ANSWERER = "Qwen/Qwen3.5-9B"  # twenty_questions' answerer (its env.py), as the recipe ships


def _chat_tokens(model: Path, out: Path) -> Path:
    """`model` with the chat markup Qwen's renderers need as single tokens (the answerer's renderer,
    qwen3_5_disable_thinking, asserts it), its embeddings grown to match."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)  # the new tokens' embeddings are drawn
    tokenizer = AutoTokenizer.from_pretrained(model)
    markup = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tokenizer.add_special_tokens({"additional_special_tokens": markup})
    grown = AutoModelForCausalLM.from_pretrained(model)
    grown.resize_token_embeddings(len(tokenizer))
    grown.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.timeout(600)
def test_twenty_questions_with_its_answerer_on_a_second_base(tiny_llama, tiny_qwen2, tmp_path):
    """`multiplayer_rl.twenty_questions` as it ships: the student plays, and the answerer is the
    model the recipe names, served as a second base (a tiny qwen2 with Qwen's chat markup), its
    tokenizer registered locally under that name (the recipe would fetch it from the hub;
    tests/tinker/cookbook_twenty.py)."""
    answerer = _chat_tokens(tiny_qwen2, tmp_path / "answerer")
    serve = {"models": [{"model": str(answerer), "names": [ANSWERER]}]}
    engine = {"max_context": 4096}  # a game's whole conversation is the player's prompt
    with serving(tiny_llama, tmp_path / "serve", serve=serve, engine=engine) as (url, service):
        printed = cookbook_script(
            "cookbook_twenty.py", url, tiny_llama, tmp_path / "twenty", str(answerer)
        )
        sessions = [row for row in service.store.samplers() if row.base_model == ANSWERER]
    assert f"ANSWERER {ANSWERER}" in printed
    assert sessions, "the answerer sampled on the second base"
    rows = metric_rows(tmp_path / "twenty", "env/all/reward/total")
    turns = [r["env/all/ac_tokens_per_turn"] for r in rows if "env/all/ac_tokens_per_turn" in r]
    print(f"\ntwenty_questions: steps {[r['step'] for r in rows]}, tokens a turn {turns}")
    assert [r["step"] for r in rows] == [0, 1]
