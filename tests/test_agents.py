"""The episode endpoint (orbit/agents) and agent tasks: the official `openai` client against the
endpoint, token in and token out across turns, tool calls, and agent episodes that fail without
failing the run.

Unit tests of the endpoint's pieces use a scripted generator in place of an engine (a double, for
one piece); the end-to-end tests run the real embedded engine."""

from __future__ import annotations

import json
import math
from concurrent.futures import Future
from pathlib import Path

import openai
import pytest
from agent_helpers import with_chat_template
from run_helpers import checked, recipe_dict, run_metrics
from transformers import AutoTokenizer

from orbit.agents import AgentRunner, Endpoint
from orbit.agents.chat import ChatError, Renderer, normal, parse_reply
from orbit.agents.record import trajectory
from orbit.config import RecipeError
from orbit.engine.base import Completion, SamplingParams
from orbit.rl import call_lengths
from orbit.run import RunStopped, train

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / ".cache" / "smollm2-135m-instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


@pytest.fixture(scope="module")
def chat_model(tiny_llama, tmp_path_factory) -> Path:
    return with_chat_template(tiny_llama, ROOT / ".cache" / "tiny" / "llama-s0-chat")


class Script:
    """Generates what it is told, in order, and remembers each prompt (a double of the pool for the
    endpoint's unit tests: it returns the ids a model would have sampled, chosen to show what
    re-tokenizing would change)."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies, self.prompts = list(replies), []

    def __call__(self, prompt_ids, sampling, slot, engine, meta) -> Future:
        self.prompts.append(list(prompt_ids))
        out = self.replies.pop(0)
        fut: Future = Future()
        fut.set_result(
            Completion(list(prompt_ids), out, [-0.5] * len(out), "stop", slot, 3, 3, engine=0)
        )
        return fut


def _endpoint(tokenizer, script) -> Endpoint:
    return Endpoint(tokenizer, script, model="m").start()


# ---- chat rendering ------------------------------------------------------------------------------


@pytest.mark.skipif(not SMOLLM2.exists(), reason="make smollm2")
def test_a_continued_conversation_renders_as_the_whole_one():
    """The template's rendering of a conversation equals its first part's tokens, the reply's
    generated tokens and the continuation: nothing is lost or doubled at the joins (SmolLM2's
    ChatML)."""
    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    r = Renderer(tok)
    first = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    said = tok("It is 5.", add_special_tokens=False)["input_ids"] + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]
    later = first + [
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "Wrong, again."},
    ]
    assert r.prompt(first, None) + said + r.continuation(
        later, None, 2, said, stopped=True
    ) == r.prompt(later, None)
    # cut by the length limit (no end of turn generated): the continuation closes the reply itself
    cut = tok("It is", add_special_tokens=False)["input_ids"]
    rest = r.continuation(later, None, 2, cut, stopped=False)
    assert tok.decode(rest).startswith("<|im_end|>")


def test_replies_and_messages():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    parsed = parse_reply("Let me add. " + call, "stop", tools_given=True)
    assert parsed.finish_reason == "tool_calls" and parsed.content == "Let me add."
    assert parsed.tool_calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    two = parse_reply(call + call, "stop", True)
    assert len(two.tool_calls) == 2 and two.content is None
    for bad in (
        '<tool_call>{"name": add}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        # malformed: text, with the generation's own finish reason
        '<tool_call>{"name": "add"',
    ):
        assert parse_reply(bad, "length", True) == parse_reply(bad, "length", False)
        assert parse_reply(bad, "length", True).finish_reason == "length"
    assert parse_reply(call, "stop", tools_given=False).tool_calls == []
    # a reply sent back by an SDK: null content, extra fields, arguments re-spaced: the same turn
    sent = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {
                "id": "x",
                "type": "function",
                "function": {"name": "add", "arguments": '{"b":2,"a":1}'},
            }
        ],
    }
    assert normal(sent) == normal(parsed.message() | {"content": None})


# ---- the endpoint, through the official client ---------------------------------------------------


def test_token_in_token_out(chat_model):
    """The model's tool call, written compactly, comes back from the agent re-serialised by the SDK
    (spaces, key order): rendered again, its tokens would differ from the sampled ones. The next
    call's prompt holds the sampled tokens exactly, and the trajectory is those tokens; only the
    tool result is new, rendered."""
    tok = AutoTokenizer.from_pretrained(chat_model)
    eos = tok.eos_token_id
    sampled = tok(
        '<tool_call>{"name":"add","arguments":{"b":2,"a":1}}</tool_call>', add_special_tokens=False
    )["input_ids"] + [eos]
    script = Script([sampled, tok("3", add_special_tokens=False)["input_ids"] + [eos]])
    with _endpoint(tok, script) as endpoint:
        eid = endpoint.open(0, None, SamplingParams(max_new_tokens=64))
        client = openai.OpenAI(base_url=endpoint.base_url(eid), api_key="x")
        messages = [{"role": "user", "content": "1 + 2?"}]
        first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        call = first.choices[0].message
        assert (
            first.choices[0].finish_reason == "tool_calls"
            and call.tool_calls[0].function.name == "add"
        )
        assert json.loads(call.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
        messages += [
            call.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "3"},
        ]
        client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        record = endpoint.close(eid)
    prompt = script.prompts[0]
    # exactly as generated
    assert script.prompts[1][: len(prompt) + len(sampled)] == prompt + sampled
    retokenized = Renderer(tok).prompt(messages, TOOLS)
    # what re-tokenizing would have given
    assert retokenized[: len(prompt) + len(sampled)] != prompt + sampled
    path = trajectory(record)
    assert path.prompt_ids == prompt and path.output_ids[: len(sampled)] == sampled
    tool = path.output_ids[len(sampled) : len(script.prompts[1]) - len(prompt)]
    assert "<tool_response>\n3\n</tool_response>" in tok.decode(tool)
    assert path.loss_mask == [1] * len(sampled) + [0] * len(tool) + [1] * 2 and not record.forks
    # each call measured alone against its max_new_tokens (the overlong penalty's lengths)
    assert call_lengths(path.loss_mask) == [len(sampled), 2]


def test_edited_history_forks_the_episode(chat_model):
    tok = AutoTokenizer.from_pretrained(chat_model)
    ids = tok("fine", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    script = Script([ids, ids, ids])
    with _endpoint(tok, script) as endpoint:
        eid = endpoint.open(0, None, SamplingParams(max_new_tokens=8))
        client = openai.OpenAI(base_url=endpoint.base_url(eid), api_key="x")
        first = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        edited = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "something else"},
            {"role": "user", "content": "and?"},
        ]
        client.chat.completions.create(model="m", messages=edited)
        kept = [
            {"role": "user", "content": "hi"},
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "and?"},
        ]
        client.chat.completions.create(model="m", messages=kept)
        record = endpoint.close(eid)
    assert len(record.forks) == 1 and "call 1" in record.forks[0]
    assert [t.parent for t in record.turns] == [None, None, 0]
    # the last call's chain: the first turn, then the kept history's
    assert trajectory(record).turns == 2


def test_requests_the_endpoint_refuses_or_serves(chat_model, tiny_llama):
    tok = AutoTokenizer.from_pretrained(chat_model)
    ids = tok("ok. more", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    script = Script([ids] * 8)
    with _endpoint(tok, script) as endpoint:
        eid = endpoint.open(0, None, SamplingParams(max_new_tokens=8, temperature=1.0))
        client = openai.OpenAI(base_url=endpoint.base_url(eid), api_key="x")
        hi = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError, match="stream: streaming is not supported"):
            client.chat.completions.create(model="m", messages=hi, stream=True)
        assert client.models.list().data[0].id == "m"
        both = client.chat.completions.create(
            model="m", messages=hi, n=2, logprobs=True, temperature=0.2
        )
        assert len(both.choices) == 2 and [c.logprob for c in both.choices[0].logprobs.content] == [
            -0.5
        ] * len(ids)
        # a stop of several tokens
        cut = client.chat.completions.create(model="m", messages=hi, stop=[". m"])
        assert cut.choices[0].message.content == "ok" and cut.choices[0].finish_reason == "stop"
        text = client.completions.create(model="m", prompt="Say", max_tokens=4)
        client.completions.create(model="m", prompt="Say" + text.choices[0].text + " now")
        generated = client.post(
            "/inference/v1/generate",
            cast_to=object,
            body={"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4}},
        )
        record = endpoint.close(eid)
        with pytest.raises(openai.NotFoundError, match="no open episode"):
            client.chat.completions.create(model="m", messages=hi)
    assert record.overridden == {"temperature"}  # the recipe's sampling is what the trainer scores
    # text continued
    assert script.prompts[-2][: len(script.prompts[-3]) + len(ids)] == script.prompts[-3] + ids
    choice = generated["choices"][0]
    assert choice["token_ids"] == ids and choice["logprobs"]["content"][0] == {
        "token": f"token_id:{ids[0]}",
        "logprob": -0.5,
    }
    plain = AutoTokenizer.from_pretrained(tiny_llama)  # no chat template at all
    with Endpoint(plain, Script([ids]), model="m") as endpoint:
        eid = endpoint.open(0, None, SamplingParams())
        client = openai.OpenAI(base_url=endpoint.base_url(eid), api_key="x")
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    no_tools = AutoTokenizer.from_pretrained(chat_model)
    no_tools.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatError, match="does not render tools"):
        Renderer(no_tools).prompt([{"role": "user", "content": "hi"}], TOOLS)
    # a template that refuses, as Llama's does out of turn
    strict = AutoTokenizer.from_pretrained(chat_model)
    strict.chat_template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate "
        "user/assistant') }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    with Endpoint(strict, Script([ids]), model="m") as endpoint:
        eid = endpoint.open(0, None, SamplingParams())
        client = openai.OpenAI(base_url=endpoint.base_url(eid), api_key="x", max_retries=0)
        with pytest.raises(
            openai.BadRequestError, match="chat template refused these messages: Conversation roles"
        ):
            client.chat.completions.create(
                model="m", messages=[{"role": "assistant", "content": "hi"}]
            )
        with pytest.raises(
            openai.BadRequestError, match="sampling_params.n: an integer from 1 to 64"
        ):
            client.post(
                "/inference/v1/generate",
                cast_to=object,
                body={"token_ids": [5], "sampling_params": {"n": 1000}},
            )
        with pytest.raises(openai.BadRequestError, match="ValueError: could not convert"):
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], temperature="hot"
            )


# ---- agent tasks, end to end ---------------------------------------------------------------------


def _agent_recipe(model: Path, out: Path, entry: str, **patch) -> dict:
    task = {
        "name": "agent",
        "entry": f"{ROOT}/tests/agents.py:{entry}",
        "data": str(ROOT / "tests/data/questions.jsonl"),
    }
    return recipe_dict(
        model,
        out,
        {"task": task, "rollout": {"episode_timeout_s": 3, "max_new_tokens": 8}},
        **patch,
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_agent_that_raises_hangs_or_returns_nan_loses_its_episode_not_the_run(
    chat_model, tmp_path
):
    """One episode in 9 raises, one hangs past the episode timeout, one returns NaN: each is lost,
    counted (episodes_lost), logged with its reason and traceback in run.log, and every step still
    trains."""
    out = tmp_path / "run"
    train(checked(_agent_recipe(chat_model, out, "flaky", trainer={"steps": 5})), live=False)
    rows = run_metrics(out)
    assert len(rows) == 5 and all(r["trained_tokens"] > 0 for r in rows)
    assert sum(r["episodes_lost"] for r in rows) >= 3
    log = (out / "run.log").read_text()
    assert "ValueError: the agent's own bug" in log and "Traceback (most recent call last)" in log
    assert (
        "ran past rollout.episode_timeout_s (3 s)" in log
        and "returned a non-finite reward (nan)" in log
    )
    for r in rows:  # every trained token is the engine's, scored alike by the trainer
        assert r["logprob_diff"] is not None and r["logprob_diff"] < 1e-3


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_agent_that_always_fails_stops_the_run_saved(chat_model, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(
        RunStopped,
        match="agent episodes were lost .*rollout.max_lost_frac .*the last: the agent "
        "raised RuntimeError: this agent always fails",
    ):
        train(checked(_agent_recipe(chat_model, out, "broken", trainer={"steps": 5})), live=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_orbit_eval_runs_the_agent_on_held_out_rows(chat_model, tmp_path):
    """`orbit eval RUN` on an agent run: the same agent, greedy, on the held-out rows, base and
    trained; every episode's calls through an endpoint over the engine. (That an agent learns:
    docs/agents.md, SmolLM2.)"""
    from orbit.measure.eval import resolve_target, run_eval

    out = tmp_path / "run"
    train(checked(_agent_recipe(chat_model, out, "yes", trainer={"steps": 2})), live=False)
    report = run_eval(resolve_target(out), n=4)
    for which in ("base", "trained"):
        assert report["results"][which]["n"] == 4 and report["results"][which]["avg_turns"] == 2.0
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all(
        s["id"].startswith("agent-eval-") and 0 in s["loss_mask"] for s in samples
    )


def test_bad_agent_recipes_fail_at_load(chat_model, tmp_path):
    def error(**task) -> str:
        data = _agent_recipe(chat_model, tmp_path / "r", "yes")
        data["task"] = {"name": "agent", **task}
        with pytest.raises(RecipeError) as err:
            checked(data)
        return str(err.value)

    good = {
        "entry": f"{ROOT}/tests/agents.py:yes",
        "data": str(ROOT / "tests/data/questions.jsonl"),
    }
    assert "task.entry: required for task 'agent'" in error(data=good["data"])
    assert "task.entry" in error(entry=f"{ROOT}/tests/agents.py:not_async", data=good["data"])
    assert "task.entry" in error(entry=f"{ROOT}/tests/agents.py:missing", data=good["data"])
    assert "task.data" in error(entry=good["entry"], data=str(tmp_path / "none.jsonl"))
    assert "task.path: unknown key for task 'agent'" in error(**good, path="x")


def test_a_lost_episode_is_counted_and_its_group_goes_on(chat_model):
    """Unit test of the runner: the episode's future fails with the agent's reason; a NaN reward is
    no number."""
    from orbit.agents import EpisodeFailed
    from orbit.tasks.agent import AgentTask

    tok = AutoTokenizer.from_pretrained(chat_model)
    ids = tok("yes", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    task = AgentTask(tok, f"{ROOT}/tests/agents.py:yes", str(ROOT / "tests/data/questions.jsonl"))
    with _endpoint(tok, Script([ids, ids, ids, ids])) as endpoint:
        runner = AgentRunner(endpoint, task, SamplingParams(max_new_tokens=8), timeout_s=5)
        prompt = next(task.prompts(0))
        done = runner.start(prompt, 0, None).result(10)
        assert done.score.reward == 1.0 and done.turns == 2 and done.score.info["calls"] == 2
        task.function = _nan
        with pytest.raises(EpisodeFailed, match="non-finite reward"):
            runner.start(prompt, 0, None).result(10)


async def _nan(client, model, example):
    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    return math.nan
