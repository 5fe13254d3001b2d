"""Tasks: scoring and failure modes, splits, multi-turn injection and masking, user tasks, errors,
the warm start."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import yaml
from engine_helpers import FakeEngine
from run_helpers import checked, recipe_dict, run_metrics
from transformers import AutoTokenizer
from typer.testing import CliRunner

from orbit.cli import app
from orbit.config import AdapterConfig, RecipeError, TaskConfig, TrainerConfig, parse_recipe
from orbit.engine.base import Completion, SamplingParams
from orbit.engine.pool import EnginePool
from orbit.rollout.pipeline import Pipeline
from orbit.rollout.producer import Producer
from orbit.rollout.sample import Sample
from orbit.run import RunStopped, train
from orbit.tasks import make_task
from orbit.tasks.base import answer_tag
from orbit.train.trainer import Trainer

USER_TASKS = Path(__file__).resolve().parent / "user_tasks.py"


@pytest.fixture(scope="module")
def tok(tiny_task_tokens):
    return AutoTokenizer.from_pretrained(tiny_task_tokens)


def _enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _take(stream, n):
    return [next(stream) for _ in range(n)]


# ---- built-in tasks: prompts, splits, scoring ----------------------------------------------------


def test_task_tokens_are_single_tokens(tok):
    for text in ("<answer>", "</answer>", "LOOKUP(", ")", "7"):
        assert len(_enc(tok, text)) == 1, text
    assert tok.decode(_enc(tok, "12+34=<answer>46</answer>")) == "12+34=<answer>46</answer>"


def test_arith_prompts_deterministic_and_splits_disjoint(tok):
    task = make_task(TaskConfig(name="arith"), tok)
    a = _take(task.prompts(3), 50)
    assert [p.text for p in a] == [p.text for p in _take(task.prompts(3), 50)]
    assert [p.text for p in a] != [p.text for p in _take(task.prompts(4), 50)]
    train_set = {p.text for p in _take(task.prompts(0, "train"), 3000)}
    eval_set = {p.text for p in _take(task.prompts(0, "eval"), 600)}
    assert train_set and eval_set and not train_set & eval_set
    for p in a:
        lhs = p.text.rstrip("=")
        assert str(eval(lhs)) == p.answer and int(p.answer) >= 0


def test_arith_scoring_and_failure_modes(tok):
    task = make_task(TaskConfig(name="arith"), tok)
    p = next(task.prompts(0))
    right, wrong = f"<answer>{p.answer}</answer>", f"<answer>{int(p.answer) + 1}</answer>"
    s = task.score(p, _enc(tok, right))
    assert s.reward == pytest.approx(1.2) and s.info["correct"] and s.info["format_ok"]
    assert s.info["failure_mode"] == "success"
    s = task.score(p, _enc(tok, wrong))
    assert (
        s.reward == pytest.approx(0.2)
        and not s.info["correct"]
        and s.info["failure_mode"] == "wrong_answer"
    )
    s = task.score(p, _enc(tok, p.answer) + [tok.eos_token_id])
    assert s.reward == 0.0 and not s.info["format_ok"] and s.info["failure_mode"] == "wrong_format"
    s = task.score(p, _enc(tok, f"<answer>{p.answer}"))  # never closed: no answer tag
    assert s.info["failure_mode"] == "wrong_format"
    # the answer tag's end stops the turn; a demonstration is a correct answer
    assert task.stop_token_ids == (_enc(tok, "</answer>")[0],)
    demo = [t for seg in task.demonstration(p) for t in seg.ids]
    assert task.score(p, demo).info["correct"]


def test_answer_tag_takes_the_last_complete_tag():
    assert answer_tag("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert answer_tag("<answer>1") is None and answer_tag("1</answer>") is None


def _zorplex_episode(task, tok, p, calls: list[str], answer: str | None) -> list[int]:
    """A transcript: each call followed by the tool's own result, then the answer."""
    out: list[int] = []
    for key in calls:
        out += _enc(tok, f"LOOKUP({key})")
        result = task.next_turn(p, out)
        assert result is not None
        out += result
    if answer is not None:
        out += _enc(tok, f"<answer>{answer}</answer>")
    return out


def test_zorplex_tool_scoring_and_failure_modes(tok):
    task = make_task(TaskConfig(name="zorplex", min_hops=3, max_hops=3), tok)
    p = next(task.prompts(0))
    chain, table = p.meta["chain"], p.meta["table"]
    assert len(chain) == 3 and p.text == f"zorplex({chain[0]})?"
    # the tool answers with the table's entry; an unknown key gets "?"
    assert tok.decode(task.next_turn(p, _enc(tok, f"LOOKUP({chain[0]})"))) == f"={table[chain[0]]};"
    assert tok.decode(task.next_turn(p, _enc(tok, "LOOKUP(zz)"))) == "=?;"
    assert task.next_turn(p, _enc(tok, "<answer>12</answer>")) is None  # not a call: done
    assert task.next_turn(p, []) is None
    # a call's end and the answer tag's end stop the model's turn
    assert set(task.stop_token_ids) == {_enc(tok, ")")[0], _enc(tok, "</answer>")[0]}

    right = task.score(p, _zorplex_episode(task, tok, p, chain, p.answer))
    # +1.0 correct, +0.2 tag, -0.1 for the third call
    assert right.reward == pytest.approx(1.1) and right.info["failure_mode"] == "success"
    assert right.info["tool_calls"] == 3
    spam = task.score(
        p,
        _zorplex_episode(
            task, tok, p, chain + [chain[0], chain[1]], "10" if p.answer != "10" else "11"
        ),
    )
    assert spam.info["failure_mode"] == "tool_spam" and spam.reward == pytest.approx(0.2 - 0.3)
    no_tag = task.score(p, _zorplex_episode(task, tok, p, chain, None) + _enc(tok, p.answer))
    assert no_tag.info["failure_mode"] == "wrong_format" and no_tag.reward == pytest.approx(-0.1)
    wrong = task.score(p, _zorplex_episode(task, tok, p, chain[:1], "5"))
    assert wrong.info["failure_mode"] == "wrong_answer" and wrong.reward == pytest.approx(0.2)

    # the demonstration is the correct episode, its tool results marked as not trained
    segs = task.demonstration(p)
    assert [s.trained for s in segs] == [True, False] * 3 + [True]
    assert task.score(p, [t for s in segs for t in s.ids]).info["correct"]


def test_zorplex_splits_disjoint(tok):
    task = make_task(TaskConfig(name="zorplex"), tok)

    def chains(split, n):
        return {tuple(p.meta["chain"]) + (p.answer,) for p in _take(task.prompts(0, split), n)}

    assert not chains("train", 2000) & chains("eval", 500)


@pytest.mark.slow
def test_chat_model_style_tool_calls(tiny_task_tokens, tmp_path):
    """The GPU recipes' shape: a chat template around the prompt, <tool_call>...</tool_call> calls
    that stop at the one-token </tool_call>, and tool responses in their own markup."""
    chat_tok = AutoTokenizer.from_pretrained(tiny_task_tokens)
    chat_tok.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)
    chat_tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if "
        "add_generation_prompt %}<|assistant|>{% endif %}"
    )
    cfg = TaskConfig(
        name="zorplex",
        chat=True,
        call_format="<tool_call>LOOKUP({key})</tool_call>",
        call_end="</tool_call>",
        result_format="\n<tool_response>{value}</tool_response>\n",
        template="What is the zorplex value of {key}?",
    )
    task = make_task(cfg, chat_tok)
    p = next(task.prompts(0))
    assert (
        chat_tok.decode(p.prompt_ids)
        == f"<|user|>What is the zorplex value of {p.meta['chain'][0]}?\n<|assistant|>"
    )
    end = chat_tok.convert_tokens_to_ids("</tool_call>")
    assert end in task.stop_token_ids
    key = p.meta["chain"][0]
    turn = _enc(chat_tok, f"<tool_call>LOOKUP({key})</tool_call>")
    assert turn[-1] == end
    assert (
        chat_tok.decode(task.next_turn(p, turn))
        == f"\n<tool_response>{p.meta['table'][key]}</tool_response>\n"
    )
    demo = task.demonstration(p)
    assert task.score(p, [t for seg in demo for t in seg.ids]).info["correct"]
    arith = make_task(
        TaskConfig(name="arith", chat=True, template="Compute {a} {op} {b}."), chat_tok
    )
    assert chat_tok.decode(next(arith.prompts(0)).prompt_ids).startswith("<|user|>Compute ")
    with pytest.raises(RecipeError, match="no chat template"):
        make_task(
            TaskConfig(name="arith", chat=True), AutoTokenizer.from_pretrained(tiny_task_tokens)
        )


def test_call_end_must_be_one_token(tok):
    with pytest.raises(RecipeError, match=r"task.call_end: '\]\]\]' is \d+ tokens"):
        make_task(TaskConfig(name="zorplex", call_end="]]]", call_format="LOOKUP({key}]]]"), tok)


# ---- multi-turn rollouts: injection and masking -------------------------------------------------


class OracleEngine(FakeEngine):
    """A scripted engine that plays zorplex perfectly: it calls LOOKUP along the chain, then
    answers. Records every request; turn i reports weights version i."""

    def __init__(self, task, tok, prompts) -> None:
        super().__init__()
        self.task, self.tok = task, tok
        self.by_ids = {tuple(p.prompt_ids): p for p in prompts}
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.lock = threading.Lock()

    def generate(self, prompt_ids, sampling, slot="active", meta=None):
        with self.lock:
            self.requests.append((list(prompt_ids), sampling))
        prompt = next(p for ids, p in self.by_ids.items() if tuple(prompt_ids[: len(ids)]) == ids)
        transcript = self.tok.decode(prompt_ids[len(prompt.prompt_ids) :])
        turn = transcript.count("LOOKUP(")
        chain = prompt.meta["chain"]
        text = (
            f"LOOKUP({chain[turn]})" if turn < len(chain) else f"<answer>{prompt.answer}</answer>"
        )
        out = _enc(self.tok, text)
        fut: Future = Future()
        fut.set_result(
            Completion(list(prompt_ids), out, [-0.5] * len(out), "stop", None, turn, turn)
        )
        return fut


def _rollout(
    engine,
    task,
    sampling: SamplingParams,
    group_size: int,
    groups: int,
    max_inflight: int,
    timeout: float,
):
    """One batch of `groups` groups from a real Producer and Pipeline over `engine`."""
    pool = EnginePool([engine], [max_inflight], monitor=False)
    pipeline = Pipeline(pool, groups, None, group_size, max_inflight)
    producer = Producer(pipeline, pool, task, sampling, seed=0)
    pipeline.grant(groups)
    producer.start()
    try:
        return pipeline.take(groups, version=0, stall_s=timeout)
    finally:
        producer.stop()


def test_multi_turn_rollout_injects_tool_results_and_masks_them(tok):
    task = make_task(TaskConfig(name="zorplex", min_hops=2, max_hops=3), tok)
    prompts = _take(task.prompts(0), 4)
    engine = OracleEngine(task, tok, prompts)
    batch = _rollout(
        engine,
        task,
        SamplingParams(max_new_tokens=8, stop_token_ids=(tok.eos_token_id,)),
        group_size=2,
        groups=2,
        max_inflight=8,
        timeout=30,
    )
    call_end, answer_end = _enc(tok, ")")[0], _enc(tok, "</answer>")[0]
    # every turn may stop at a call's end or the answer's end, besides eos
    assert all(
        {call_end, answer_end, tok.eos_token_id} <= set(s.stop_token_ids)
        for _, s in engine.requests
    )
    for group in batch.groups:
        p, hops = group.prompt, len(group.prompt.meta["chain"])
        for s in group.samples:
            expected, mask = [], []
            for i, key in enumerate(p.meta["chain"]):
                call = _enc(tok, f"LOOKUP({key})")
                result = _enc(tok, f"={p.meta['table'][key]};")
                expected += call + result
                mask += [1] * len(call) + [0] * len(result)
                assert (
                    tok.decode(result)
                    == f"={p.meta['chain'][i + 1] if i + 1 < hops else p.answer};"
                )
            answer = _enc(tok, f"<answer>{p.answer}</answer>")
            expected += answer
            mask += [1] * len(answer)
            assert s.output_ids == expected and s.loss_mask == mask
            # injected tokens carry logprob 0.0; the model's carry the engine's
            assert s.behaviour_logprobs == [-0.5 if m else 0.0 for m in mask]
            assert s.version_start == 0 and s.version_end == hops  # first turn, last turn
            assert (
                s.info["correct"] and s.info["turns"] == hops + 1 and s.info["tool_results"] == hops
            )
            assert s.reward == pytest.approx(1.2 - 0.1 * max(0, hops - 2))
    # each turn's request is the prompt plus everything so far
    contexts = [ids for ids, _ in engine.requests]
    s = batch.groups[0].samples[0]
    full = list(batch.groups[0].prompt.prompt_ids) + s.output_ids
    turn_starts = [i for i, m in enumerate(s.loss_mask) if m and (i == 0 or not s.loss_mask[i - 1])]
    for start in turn_starts:
        assert full[: len(batch.groups[0].prompt.prompt_ids) + start] in contexts


def test_trainer_excludes_injected_tokens_from_loss(tiny_task_tokens, tok):
    """The gradient comes only from the model's own tokens: the injected tokens' logprobs (and their
    recorded behaviour logprobs) never enter it; they are context only."""
    prompt = _enc(tok, "zorplex(c)?")
    parts = [
        ("LOOKUP(c)", 1),
        ("=q;", 0),
        ("LOOKUP(q)", 1),
        ("=47;", 0),
        ("<answer>47</answer>", 1),
    ]
    out = [t for text, _ in parts for t in _enc(tok, text)]
    mask = [m for text, m in parts for _ in _enc(tok, text)]
    assert 0 < sum(mask) < len(mask)

    def grads(behaviour_on_injected: float, loss_mask: list[int]) -> tuple[torch.Tensor, object]:
        cfg = TrainerConfig(lr=1.0, max_grad_norm=1e9)  # the default loss: the truncated IS weight
        trainer = Trainer(
            tiny_task_tokens, AdapterConfig(r=4, alpha=8), cfg, temperature=1.0, seed=0
        )
        trainer.optimizer = torch.optim.SGD(trainer.params, lr=1.0)  # the update is exactly -grad
        before = [p.detach().clone() for p in trainer.params]
        model_lp = trainer.logprobs([Sample(prompt, out, [0.0] * len(out), 0.0, 0, 0)])[0]
        behaviour = [
            lp if m else behaviour_on_injected for lp, m in zip(model_lp, mask, strict=True)
        ]
        samples = [
            Sample(prompt, out, behaviour, 1.0, 0, 0, loss_mask=loss_mask, advantage=1.0),
            Sample(
                prompt, out[:3], behaviour[:3], 0.0, 0, 0, loss_mask=loss_mask[:3], advantage=-1.0
            ),
        ]
        result = trainer.step(samples)
        grad = torch.cat(
            [(b - p.detach()).flatten() for b, p in zip(before, trainer.params, strict=True)]
        )
        return grad, result

    g0, r0 = grads(0.0, mask)
    g1, r1 = grads(-7.5, mask)  # whatever is recorded for injected tokens changes nothing
    assert torch.count_nonzero(g0) > 0
    assert torch.allclose(g0, g1, atol=1e-7, rtol=0)
    assert r0.tokens == sum(mask) + 3  # trained-on tokens: the model's own only
    # injected tokens are not compared either
    assert r0.logprob_diff == pytest.approx(0.0, abs=1e-5)
    g2, _ = grads(0.0, [1] * len(out))  # if they were trained on, the gradient would differ
    assert not torch.allclose(g0, g2, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_multi_turn_on_the_engine_matches_the_trainer(warm_zorplex):
    """Real episodes through the embedded engine: tool results injected between turns, masked, and
    the engine's logprobs of later turns (made with the injected context) agree with the
    trainer's."""
    from orbit.engine.embedded import start_embedded_engine

    tokenizer = AutoTokenizer.from_pretrained(warm_zorplex)
    task = make_task(TaskConfig(name="zorplex"), tokenizer)
    engine = start_embedded_engine(warm_zorplex, max_running=16, threads=1, seed=0)
    try:
        batch = _rollout(
            engine,
            task,
            SamplingParams(max_new_tokens=8, temperature=1.0),
            group_size=4,
            groups=3,
            max_inflight=16,
            timeout=120,
        )
    finally:
        engine.shutdown()
    samples = batch.samples
    injected = 0
    for group in batch.groups:
        for s in group.samples:
            i = 0
            # every run of masked tokens is the tool's answer to the call before it
            while i < len(s.output_ids):
                if s.loss_mask[i]:
                    i += 1
                    continue
                j = i
                while j < len(s.output_ids) and not s.loss_mask[j]:
                    j += 1
                assert s.output_ids[i - 1] == task.call_end_id
                assert s.output_ids[i:j] == task.next_turn(group.prompt, s.output_ids[:i])
                assert all(lp == 0.0 for lp in s.behaviour_logprobs[i:j])
                injected += 1
                i = j
    assert injected >= 6  # the warm-started model calls the tool
    trainer = Trainer(
        warm_zorplex, AdapterConfig(r=4, alpha=8), TrainerConfig(), temperature=1.0, seed=0
    )
    for s, lps in zip(samples, trainer.logprobs(samples), strict=True):
        for lp, beh, m in zip(lps, s.behaviour_logprobs, s.loss_mask, strict=True):
            if m:
                assert abs(lp - beh) < 1e-3
    result = trainer.step(samples)
    assert result.tokens == sum(sum(s.loss_mask) for s in samples)
    assert result.logprob_diff < 1e-3


# ---- user tasks, datasets, errors ----------------------------------------------------------------


def _recipe(model: Path, out: Path, task: dict, **patch) -> dict:
    return recipe_dict(
        model,
        out,
        {
            "rollout": {"max_new_tokens": 8},
            "trainer": {"save_every": 1},
            "task": task,
            "mode": "double-buffer",
        },
        **patch,
    )


@pytest.mark.slow
def test_user_task_by_import_path_trains(tmp_path, tiny_llama, monkeypatch):
    pkg = tmp_path / "mytasks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "words.py").write_text(USER_TASKS.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = checked(
        _recipe(tiny_llama, tmp_path / "run", {"name": "mytasks.words:count_word", "word": "no"})
    )
    assert recipe.recipe.task.options() == {"word": "no"}
    result = train(recipe, live=False)
    assert result.steps_done == 3
    rows = run_metrics(tmp_path / "run")
    assert len(rows) == 3 and all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    # the run's recipe.yaml keeps the task and its options
    saved = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    assert saved["task"] == {"name": "mytasks.words:count_word", "word": "no"}
    # the file form works too
    recipe = checked(
        _recipe(
            tiny_llama,
            tmp_path / "run2",
            {"name": f"{USER_TASKS}:count_word"},
            trainer={"steps": 1},
        )
    )
    assert train(recipe, live=False).steps_done == 1


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "no_such_pkg.tasks:make",
            r"task.name: cannot import 'no_such_pkg.tasks'.*No module named 'no_such_pkg'",
        ),
        (f"{USER_TASKS}:nope", r"task.name: module .* has no attribute 'nope'"),
        ("tasks/missing.py:make", r"task.name: no such file 'tasks/missing.py'"),
        (
            "just_a_name",
            r"task.name: unknown task 'just_a_name' \(built-in: pattern, arith, zorplex, jsonl",
        ),
    ],
)
def test_bad_task_path_fails_at_recipe_load(tmp_path, tiny_llama, name, message):
    with pytest.raises(RecipeError, match=message):
        checked(_recipe(tiny_llama, tmp_path / "run", {"name": name}))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "not_a_task",
            r"task.name: .*returned int, which is not a task: it lacks \['name', 'prompts', "
            r"'score'\]",
        ),
        (
            "factory_raises",
            r"task.name: .*the factory raised ValueError: this factory needs an API key",
        ),
    ],
)
@pytest.mark.slow
def test_bad_task_factory_fails_before_any_compute(tmp_path, tiny_llama, name, message):
    recipe = checked(_recipe(tiny_llama, tmp_path / "run", {"name": f"{USER_TASKS}:{name}"}))
    with pytest.raises(RecipeError, match=message):
        train(recipe, live=False)
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_builtin_task_options_are_checked():
    with pytest.raises(RecipeError, match=r"task.max_digits: unknown key for task .zorplex."):
        parse_recipe({"model": "m", "task": {"name": "zorplex", "max_digits": 3}})
    with pytest.raises(RecipeError, match=r"task.colour: unknown key for task 'arith'"):
        parse_recipe({"model": "m", "task": {"name": "arith", "colour": "red"}})
    with pytest.raises(RecipeError, match=r"task.path: required for task 'jsonl'"):
        parse_recipe({"model": "m", "task": {"name": "jsonl"}})


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"prompt": "2+2=", "answer": 4', r"line 3: not valid JSON"),
        ({"prompt": "2+2="}, r"line 3: missing 'answer'"),
        ({"answer": "4"}, r"line 3: missing 'prompt'"),
        (["2+2=", "4"], r"line 3: a row must be an object"),
        ({"prompt": "", "answer": "4"}, r"line 3: 'prompt' must be a non-empty string"),
        ({"prompt": "2+2=", "answer": None}, r"line 3: 'answer' must be a string or a number"),
    ],
)
@pytest.mark.slow
def test_bad_dataset_row_names_the_line(tmp_path, tiny_task_tokens, bad, message):
    data = _write_jsonl(
        tmp_path / "data.jsonl",
        [{"prompt": "1+1=", "answer": 2}, {"prompt": "1+2=", "answer": "3"}, bad],
    )
    with pytest.raises(RecipeError, match=r"task.path: .*data.jsonl " + message):
        checked(_recipe(tiny_task_tokens, tmp_path / "run", {"name": "jsonl", "path": str(data)}))
    runner = CliRunner()
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        yaml.safe_dump(
            _recipe(tiny_task_tokens, tmp_path / "run", {"name": "jsonl", "path": str(data)})
        )
    )
    res = runner.invoke(app, ["train", str(recipe_file)])
    assert res.exit_code == 2 and "data.jsonl line 3" in res.output
    assert not (tmp_path / "run").exists()


def test_jsonl_dataset_task(tmp_path, tok):
    rows = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(30)]
    data = _write_jsonl(tmp_path / "data.jsonl", rows + [""])  # a blank line is skipped
    task = make_task(TaskConfig(name="jsonl", path=data, holdout_every=10), tok)
    train_p = {p.text for p in _take(task.prompts(0), 60)}
    eval_p = {p.text for p in _take(task.prompts(0, "eval"), 6)}
    assert eval_p == {"9+1=", "19+1=", "29+1="} and len(train_p) == 27 and not train_p & eval_p
    p = next(task.prompts(0, "eval"))
    assert task.score(p, _enc(tok, f"<answer> {p.answer} </answer>")).info["correct"]
    assert task.score(p, _enc(tok, p.answer)).info["failure_mode"] == "wrong_format"
    # a separate held-out file
    ev = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "100+1=", "answer": "101"}])
    task = make_task(TaskConfig(name="jsonl", path=data, eval_path=ev), tok)
    assert {p.text for p in _take(task.prompts(0, "eval"), 3)} == {"100+1="}
    assert len({p.text for p in _take(task.prompts(0), 90)}) == 30


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tool_error_stops_the_run_and_keeps_its_data(tmp_path, warm_zorplex):
    run_dir = tmp_path / "run"
    recipe = checked(
        _recipe(
            warm_zorplex,
            run_dir,
            {"name": f"{USER_TASKS}:broken_zorplex", "fail_after": 60},
            trainer={"steps": 30, "save_every": 1},
        )
    )
    with pytest.raises(RunStopped) as info:
        train(recipe, live=False)
    assert info.value.end == "task-failed"
    message = str(info.value)
    assert "next_turn (the tool) failed on prompt 'zorplex-train-" in message
    assert "ConnectionError: lookup service unavailable (HTTP 503)" in message
    assert (
        f"the adapter of step {len(run_metrics(run_dir))} is saved in {run_dir / 'adapter'}"
        in message
    )
    rows = run_metrics(run_dir)  # every line whole
    assert 1 <= len(rows) < 30
    state = json.loads((run_dir / "adapter" / "trainer_state.json").read_text())
    assert state["version"] == len(rows) == rows[-1]["version"]
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["task"]["fail_after"] == 60


@pytest.mark.slow
def test_tool_error_on_the_command_line(tmp_path, warm_zorplex):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        yaml.safe_dump(
            _recipe(
                warm_zorplex,
                tmp_path / "run",
                {"name": f"{USER_TASKS}:broken_zorplex", "fail_after": 0},
                trainer={"steps": 5},
            )
        )
    )
    res = CliRunner().invoke(app, ["train", str(recipe_file), "--quiet"])
    assert res.exit_code == 1
    flat = " ".join(res.output.split())
    assert "the task failed" in flat and "lookup service unavailable" in flat
    # it failed before its first step: nothing was trained, nothing is left in the way of a re-run
    assert "nothing was trained" in flat and not (tmp_path / "run").exists()


# ---- the warm start ------------------------------------------------------------------------------


@pytest.mark.slow
def test_warm_start_is_deterministic(tmp_path):
    from orbit.models.warmstart import WarmConfig, build_warm_model

    cfg = WarmConfig(steps=12, batch=8, warmup=2)
    a = build_warm_model(tmp_path / "a", "zorplex", config=cfg)
    b = build_warm_model(tmp_path / "b", "zorplex", config=cfg)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "warmstart.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = build_warm_model(tmp_path / "c", "zorplex", seed=1, config=cfg)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_warm_start_is_cached(tmp_path, warm_arith, monkeypatch):
    import orbit.models.warmstart as ws

    info = json.loads((warm_arith / "warmstart.json").read_text())
    assert info["task"] == "arith" and info["code_version"] in warm_arith.name
    # the cached model is reused: nothing is built again
    monkeypatch.setattr(
        ws, "build_warm_model", lambda *a, **k: pytest.fail("rebuilt a cached warm start")
    )
    assert ws.warm_model("arith", root=warm_arith.parent.parent) == warm_arith
    out = tmp_path / "copy"
    res = CliRunner().invoke(
        app,
        ["model", "tiny", str(out), "--task", "arith"],
        env={"ORBIT_CACHE": str(warm_arith.parent.parent)},
    )
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").read_bytes() == (
        warm_arith / "model.safetensors"
    ).read_bytes()


def _answers_or_dies(conn) -> None:
    """A worker (spawned: module level) that answers, or exits at once on "die" as a crash in the
    code it runs."""
    from orbit.tasks.worker import serve_requests

    serve_requests(conn, lambda r: os._exit(3) if r == "die" else ("ok", r))


def test_a_worker_that_dies_is_an_error_not_a_timeout():
    from orbit.tasks.worker import Worker

    worker = Worker(_answers_or_dies, (), "test-worker", 60)
    try:
        assert worker.ask("hi") == ("ok", "hi")
        assert worker.ask("die") == ("error", "the test-worker process exited (exit code 3)")
        assert worker.ask("again") == ("ok", "again")  # a fresh process
    finally:
        worker.close()
