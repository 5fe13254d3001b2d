"""A verifiers environment, run in its own interpreter for Orbit's `verifiers` task
(orbit/tasks/verifiers.py).

It runs under the Python of the environment's virtualenv (`task.python`): verifiers 0.4 needs
openai>=2.54 and transformers 5.24 where SGLang pins openai 2.8 and transformers 5.19, so the two
cannot share one. It imports nothing of Orbit; it talks JSON lines on stdin and stdout:

- first it writes `{"tasks": [{"prompt": ..., "answer": ...}, ...]}` (the taskset, in its order), or
  `{"error": ...}`;
- then for each request `{"id", "task", "base_url", "model"}` it runs one episode of that task with
  every model
  call sent to `base_url` (Orbit's endpoint, one URL per episode, which records the tokens) and
  writes `{"id", "reward", "rewards", "errors"}`. Episodes run concurrently; it exits when stdin
  closes.

The harness is verifiers' own when the recipe names one (`task.harness`); by default `orbit_chat`,
below: one chat turn made in-process, so no harness program, `uv` or container is needed (verifiers
allows a harness that runs its loop in-process as long as every call goes through the endpoint it is
given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

KEY_VAR = "ORBIT_VERIFIERS_KEY"  # verifiers reads a client's API key from a named variable
# main() gives the protocol a stdout of its own; user code's print() goes to stderr
_protocol = sys.stdout


def _orbit_chat(vf) -> str:
    """Registers the in-process chat harness as an importable module (verifiers finds plugins by
    import)."""
    from openai import AsyncOpenAI
    from verifiers.v1.dialects.chat import message_to_wire

    class OrbitChatConfig(vf.HarnessConfig):
        pass

    class OrbitChatHarness(vf.Harness[OrbitChatConfig]):
        """One chat turn on the task's prompt, through the endpoint verifiers hands the harness."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(
            self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
        ):
            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            else:
                messages += [message_to_wire(m) for m in prompt or []]
            client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            try:
                await client.chat.completions.create(model=ctx.model, messages=messages)
            finally:
                await client.close()
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    module: Any = types.ModuleType("orbit_chat")
    module.OrbitChatHarness, module.OrbitChatConfig = OrbitChatHarness, OrbitChatConfig
    module.__all__ = ["OrbitChatHarness", "OrbitChatConfig"]
    sys.modules["orbit_chat"] = module
    return "orbit_chat"


def load_env(taskset: str, harness: str | None):
    """The environment: `taskset` an importable id, or a .py file (its directory goes on the
    path)."""
    import verifiers.v1 as vf

    if taskset.endswith(".py"):
        path = Path(taskset).resolve()
        sys.path.insert(0, str(path.parent))
        taskset = path.stem
    config = vf.SingleAgentEnvConfig(
        taskset={"id": taskset},
        # the local runtime: verifiers' default is a remote sandbox reached through a tunnel
        agent={"harness": {"id": harness or _orbit_chat(vf)}, "runtime": {"type": "subprocess"}},
    )
    return vf, vf.load_environment(config)


def _text(value) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    return json.dumps(
        [
            m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else m
            for m in value
        ]
    )


def _write(message: dict) -> None:
    _protocol.write(json.dumps(message) + "\n")
    _protocol.flush()


async def _episode(vf, env, tasks: list, request: dict) -> None:
    answer: dict = {"id": request["id"]}
    try:
        ctx = vf.ModelContext(
            model=request["model"],
            client=vf.EvalClientConfig(base_url=request["base_url"], api_key_var=KEY_VAR),
            # Orbit's endpoint samples as the recipe says
            sampling=vf.SamplingConfig(),
        )
        episode = await env.run_episode(tasks[request["task"]], ctx)
        trace = episode.traces[0]
        answer["reward"] = trace.reward
        answer["rewards"] = {
            k: (v.score if v is not None else None) for k, v in trace.rewards.items()
        }
        answer["errors"] = [f"{e.type}: {e.message}" for e in (*episode.errors, *trace.errors)]
    except Exception as err:  # noqa: BLE001 - the episode is lost, not the bridge
        answer["errors"] = [f"{type(err).__name__}: {err}"]
    _write(answer)


async def serve(taskset: str, harness: str | None) -> None:
    try:
        vf, env = load_env(taskset, harness)
        tasks = list(env.taskset)
    except Exception as err:  # noqa: BLE001 - said to Orbit, which names the recipe field
        _write({"error": f"{type(err).__name__}: {err}"})
        return
    _write(
        {
            "tasks": [
                {
                    "prompt": _text(t.data.prompt),
                    "system": t.data.system_prompt or "",
                    "answer": str(getattr(t.data, "answer", "") or ""),
                }
                for t in tasks
            ]
        }
    )
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task] = set()
    async with env.serving():
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            job = asyncio.create_task(_episode(vf, env, tasks, json.loads(line)))
            running.add(job)
            job.add_done_callback(running.discard)
        for job in list(running):
            job.cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--taskset", required=True)
    parser.add_argument("--harness", default=None)
    args = parser.parse_args()
    global _protocol
    # the JSON lines; fd 1 then becomes stderr, so a print() in a taskset
    _protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # or a library cannot break the protocol
    sys.stdout = sys.stderr
    os.environ.setdefault(KEY_VAR, "orbit")
    asyncio.run(serve(args.taskset, args.harness))


if __name__ == "__main__":
    main()
