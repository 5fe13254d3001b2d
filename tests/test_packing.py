"""Many adapters in one pass over the shared base (orbit/train/packing.py): each client's logprobs,
loss, gradient and adapter after its optimizer step are what a pass of its own gives, whatever
else shares the pack; LoRA of several ranks and targets, OFT of two block sizes; the service's
turns pack ready clients and bound a pack in tokens."""

from __future__ import annotations

import random
import threading
import time

import peft
import pytest
import torch

from orbit.config import AdapterConfig, TrainerConfig
from orbit.rollout.sample import Sample
from orbit.serve.clients import (
    AdamParams,
    LoraSpec,
    Request,
    TrainingClient,
    forward_backward,
    forward_backward_checked,
)
from orbit.serve.futures import Record, Refused
from orbit.serve.training import Packable, Turns
from orbit.serve.wire import Datum
from orbit.train.measure import StepResult
from orbit.train.packed import StepPacker
from orbit.train.packing import BASE, Route
from orbit.train.sequences import target_logprobs
from orbit.train.shared import SharedBase
from orbit.train.trainer import Trainer

REL = 1e-5  # fp32: a row's result in a pack against its own pass

# each client: its LoRA, its loss, its learning rate (0: must not move at all)
CLIENTS = [
    (LoraSpec(rank=2, seed=1), "cross_entropy", 1e-2),
    (LoraSpec(rank=4, seed=2, train_mlp=False, train_unembed=False), "importance_sampling", 1e-2),
    (LoraSpec(rank=8, seed=3, train_attn=False), "ppo", 1e-2),
    (LoraSpec(rank=4, seed=4), "cross_entropy", 0.0),
]


def _data(client: int, loss_fn: str) -> list[Datum]:
    """A few sequences of the client's own, two of them sharing a prompt (a group)."""
    rng = random.Random(client)
    prompt = [rng.randrange(3, 250) for _ in range(12 + 3 * client)]
    out = []
    for i in range(3):
        tokens = (prompt if i < 2 else prompt[:5]) + [rng.randrange(3, 250) for _ in range(4 + i)]
        n = len(tokens)
        targets = torch.tensor(tokens[1:] + [7])
        if loss_fn == "cross_entropy":
            inputs = {"target_tokens": targets, "weights": torch.rand(n, generator=_gen(client))}
        else:
            inputs = {
                "target_tokens": targets,
                "logprobs": -torch.rand(n, generator=_gen(client + i)) * 3,
                "advantages": torch.randn(n, generator=_gen(client - i)),
            }
        out.append(Datum(tokens, inputs))
    return out


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + 100)


def _clients(model) -> tuple[SharedBase, list[TrainingClient]]:
    base = SharedBase(model, "float32")
    clients = [TrainingClient("m", f"c{i}", base, spec) for i, (spec, _, _) in enumerate(CLIENTS)]
    torch.manual_seed(0)
    with torch.no_grad():  # B = 0 (peft's init) would hide a wrong A gradient
        for c in clients:
            for p in c.params:
                if p.abs().sum() == 0:
                    p.normal_(std=0.05)
    return base, clients


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(float(b.abs().max()), 1e-3)
    assert float((a - b).abs().max()) <= REL * scale, f"{what}: {a} against {b}"


def _same_adapter(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    """Adapters after an optimizer step, to REL of the adapter's norm. Not element by element: Adam
    divides each coordinate's step by that coordinate's own gradient scale, so where a gradient is
    near 0 a difference of 1e-6 of the largest gradient becomes a visible one of that coordinate's
    step (up to 1.5e-5 of the largest weight under AVX2, with every gradient equal to 1e-6)."""
    diff = torch.cat([(x - y).detach().flatten() for x, y in zip(a, b, strict=True)])
    norm = torch.cat([y.detach().flatten() for y in b]).norm()
    assert float(diff.norm()) <= REL * float(norm), f"{what}: {float(diff.norm()) / float(norm)}"


def test_a_packed_pass_equals_each_clients_own_pass(tiny_llama):
    alone_base, alone = _clients(tiny_llama)
    packed_base, packed = _clients(tiny_llama)
    data = [_data(i, loss_fn) for i, (_, loss_fn, _) in enumerate(CLIENTS)]
    before = [[p.detach().clone() for p in c.params] for c in packed]

    own = [
        c.forward_backward(d, loss_fn, {}, False)
        for c, d, (_, loss_fn, _) in zip(alone, data, CLIENTS, strict=True)
    ]
    requests = [
        Request(c, d, loss_fn, {}, False)
        for c, d, (_, loss_fn, _) in zip(packed, data, CLIENTS, strict=True)
    ]
    shared = forward_backward(packed_base, requests, packed=True)

    for i, (a, b) in enumerate(zip(own, shared, strict=True)):
        assert abs(a.loss - b.loss) <= REL * max(abs(a.loss), 1e-3), f"client {i}'s loss"
        for j, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
            _close(y, x, f"client {i} datum {j} logprobs")
        for p, q in zip(alone[i].params, packed[i].params, strict=True):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                _close(q.grad, p.grad, f"client {i}'s gradient")
    for (_, _, lr), a, b in zip(CLIENTS, alone, packed, strict=True):
        a.optim_step(AdamParams(learning_rate=lr))
        b.optim_step(AdamParams(learning_rate=lr))
        _same_adapter(b.params, a.params, "the adapter after its step")
    # learning rate 0: bit-identical, however many others trained in its pack
    for p, old in zip(packed[3].params, before[3], strict=True):
        assert torch.equal(p.detach(), old)


def test_a_pack_of_forwards_alone_changes_nothing(tiny_llama):
    base, clients = _clients(tiny_llama)
    data = [_data(i, loss_fn) for i, (_, loss_fn, _) in enumerate(CLIENTS)]
    own = [
        c.forward_backward(d, loss_fn, {}, True)
        for c, d, (_, loss_fn, _) in zip(clients, data, CLIENTS, strict=True)
    ]
    requests = [
        Request(c, d, loss_fn, {}, True)
        for c, d, (_, loss_fn, _) in zip(clients, data, CLIENTS, strict=True)
    ]
    shared = forward_backward(base, requests, packed=True)
    for a, b in zip(own, shared, strict=True):
        assert abs(a.loss - b.loss) <= REL * max(abs(a.loss), 1e-3)
    assert all(p.grad is None for c in clients for p in c.params)


def _oft_base(model, sizes: list[int]) -> tuple[SharedBase, list[list[torch.nn.Parameter]]]:
    base = SharedBase(model, "float32")
    params = []
    for i, size in enumerate(sizes):
        torch.manual_seed(10 + i)
        config = peft.OFTConfig(
            r=0, oft_block_size=size, target_modules=["q_proj", "v_proj", "down_proj"]
        )
        ps = base.add(f"o{i}", config)
        with torch.no_grad():  # peft's init is the identity rotation: move it
            for p in ps:
                p.normal_(std=0.05)
        params.append(ps)
    return base, params


ROWS = [list(range(3, 20)), list(range(30, 39)), list(range(3, 14)) + [99, 98]]


@pytest.mark.parametrize("kind", ["lora", "oft"])
def test_rows_of_several_adapters_and_the_base_in_one_pass(tiny_llama, kind):
    """The router itself, under the trainer's scoring: LoRA (q, v and the output projection, two
    ranks) or OFT (two block sizes), and a row of the bare base model, in one pass."""
    if kind == "oft":
        base, params = _oft_base(tiny_llama, [4, 8])
    else:
        base = SharedBase(tiny_llama, "float32")
        params = []
        for i, r in enumerate((2, 8)):
            torch.manual_seed(20 + i)
            config = peft.LoraConfig(
                r=r, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"]
            )
            ps = base.add(f"o{i}", config)
            with torch.no_grad():
                for p in ps:
                    p.normal_(std=0.05)
            params.append(ps)
    names = ["o0", "o1", BASE]
    targets = [r[1:] + [5] for r in ROWS]
    model = base.base

    def score(rows, route=None):
        return target_logprobs(
            model.model,
            model.get_output_embeddings(),
            rows,
            [targets[ROWS.index(r)] for r in rows],
            None,
            route,
        )

    own = []
    for row, name in zip(ROWS, names, strict=True):
        if name == BASE:
            with base.turn("o0"), base.model.disable_adapter():
                own.append((score([row])[0], None))
            continue
        with base.turn(name):
            logp = score([row])[0]
            logp.sum().backward()
        i = names.index(name)
        own.append((logp.detach(), [p.grad.clone() for p in params[i]]))
        for p in params[i]:
            p.grad = None
    with base.pack(["o0", "o1"]) as router:
        logp = score(ROWS, Route(router, names))
        logp.sum().backward()
    for r, (mine, grads) in enumerate(own):
        _close(logp[r, : len(ROWS[r])].detach(), mine[: len(ROWS[r])], f"row {r}'s logprobs")
        if grads is not None:
            for p, g in zip(params[r], grads, strict=True):
                _close(p.grad, g, f"adapter {names[r]}'s gradient")


def _record() -> Record:
    return Record("r", "ForwardBackward", True, "t")


def test_turns_pack_ready_clients_within_the_token_bound():
    """Four clients ready at once: a pack takes each one's next request while the tokens fit;
    the huge one runs in a pack of its own, and the one that did not fit is first in the next."""
    packs: list[list[str]] = []

    def run_pack(requests: list[str]) -> list[str]:
        packs.append(list(requests))
        return [f"done {r}" for r in requests]

    turns = Turns(pack_tokens=100, run_pack=run_pack)
    started, hold = threading.Event(), threading.Event()

    def busy() -> None:  # holds the trainer while the others queue
        started.set()
        hold.wait(10)

    try:
        for c in ("z", "a", "b", "c", "d"):
            turns.open(c)
        turns.submit("z", 1, _record(), busy)
        assert started.wait(10)
        sizes = {"a": 30, "b": 500, "c": 40, "d": 50}  # b is huge; d does not fit beside a and c
        records = {
            c: turns.submit(c, 1, _record(), Packable("fb", n, c, lambda r: r))
            for c, n in sizes.items()
        }
        hold.set()
        for r in records.values():
            r.future.result(10)
        assert packs == [["a", "c"], ["b"], ["d"]]
        assert [p.clients for p in turns.packs] == [2, 1, 1]
        assert records["c"].future.result() == "done c"
    finally:
        turns.stop()


def test_clients_in_step_share_passes():
    """Two clients, each sending forward_backward, then optim_step once it is answered, then the
    next (the SDK's way): their forward_backwards share passes rather than taking turns."""
    packs: list[int] = []

    def run_pack(requests: list[str]) -> list[str]:
        time.sleep(0.05)  # a pass
        packs.append(len(requests))
        return requests

    # a linger far above a loaded machine's thread wake-ups: the policy is under test, not 0.1 s
    turns = Turns(pack_tokens=100, run_pack=run_pack, linger_s=1.0)

    def client(name: str) -> None:
        for step in range(1, 11, 2):
            turns.submit(name, step, _record(), Packable("fb", 10, name, str)).future.result(10)
            turns.submit(name, step + 1, _record(), lambda: None).future.result(10)

    try:
        threads = [threading.Thread(target=client, args=(c,)) for c in ("a", "b")]
        for c in ("a", "b"):
            turns.open(c)
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sum(packs) == 10 and packs.count(2) >= 4, packs
    finally:
        turns.stop()


# -- a sweep's runs (orbit/train/packed.py) -----------------------------------------------------

RUNS = [  # each run: its adapter, its learning rate, its temperature, its loss (algorithm preset)
    (AdapterConfig(type="lora", r=2, alpha=4, target_modules=["q_proj", "v_proj"]), 1e-2, 1.0),
    (AdapterConfig(type="lora", r=8, alpha=16, target_modules=["q_proj", "down_proj"]), 3e-2, 0.7),
    (AdapterConfig(type="lora", r=4, alpha=8, target_modules=["q_proj", "v_proj"]), 0.0, 1.0),
]
OFT_RUNS = [
    (AdapterConfig(type="oft", oft_block_size=4, target_modules=["q_proj", "v_proj"]), 1e-2, 1.0),
    (AdapterConfig(type="oft", oft_block_size=8, target_modules=["q_proj", "v_proj"]), 2e-2, 0.8),
]


def _batch(run: int, version: int) -> list[Sample]:
    """Two groups of three samples, each run's own, of several lengths, off policy."""
    rng = random.Random(run * 10 + version)
    out = []
    for g in range(2):
        prompt = [1] + [rng.randrange(3, 250) for _ in range(3 + 2 * g + run)]
        for _ in range(3):
            n = rng.randrange(1, 7)
            out.append(
                Sample(
                    prompt_ids=prompt,
                    output_ids=[rng.randrange(3, 250) for _ in range(n)],
                    behaviour_logprobs=[-rng.uniform(0.5, 5) for _ in range(n)],
                    reward=0.0,
                    version_start=version,
                    version_end=version,
                    advantage=rng.uniform(-1, 1),
                    group_id=g,
                )
            )
    return out


def _runs(model, runs, packed: bool) -> list[Trainer]:
    base = SharedBase(model, "float32")
    if packed:
        base.packer = StepPacker(base)
    out = []
    for i, (adapter, lr, temperature) in enumerate(runs):
        cfg = TrainerConfig(lr=lr, steps=10)
        out.append(Trainer(model, adapter, cfg, temperature, seed=i, shared=base, name=f"run{i}"))
        with torch.no_grad():  # LoRA B = 0 and OFT's identity would hide a wrong gradient
            for p in out[-1].params:
                p.add_(torch.randn(p.shape, generator=_gen(i)) * 0.05)
    return out


def _together(trainers: list[Trainer], version: int) -> dict[int, object]:
    """Every run's step at once, each from its own thread (as a sweep's runs): the base held until
    all of them wait, so that they form one pack."""
    results: dict[int, object] = {}
    packer = trainers[0].shared.packer

    def step(i: int) -> None:
        try:
            results[i] = trainers[i].step(_batch(i, version))
        except Exception as err:  # noqa: BLE001 - the test reads it
            results[i] = err

    threads = [threading.Thread(target=step, args=(i,)) for i in range(len(trainers))]
    with trainers[0].shared.held():
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while packer.waiting() < len(trainers) and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(60)
    return results


@pytest.mark.parametrize("kind", ["lora", "oft"])
def test_a_sweeps_packed_steps_equal_each_runs_own(tiny_llama, kind):
    """The runs' steps at once in one pack (their threads call step together) against each one
    alone: loss, gradient norm, engine agreement and the adapter after two steps, to 1e-5."""
    runs = RUNS if kind == "lora" else OFT_RUNS
    alone, packed = _runs(tiny_llama, runs, False), _runs(tiny_llama, runs, True)
    start = [[p.detach().clone() for p in t.params] for t in packed]
    for version in range(2):
        own = [t.step(_batch(i, version)) for i, t in enumerate(alone)]
        results = _together(packed, version)
        for i, a in enumerate(own):
            b = results[i]
            assert isinstance(b, StepResult), b
            for what in ("loss", "grad_norm", "logprob_diff", "ratio_mean", "entropy"):
                x, y = getattr(a, what), getattr(b, what)
                assert abs(x - y) <= REL * max(abs(x), 1e-3), (i, what, x, y)
            assert (a.version, a.tokens) == (b.version, b.tokens)
    assert packed[0].shared.packer.packs == [len(runs)] * 2  # one pack a step
    for a, b in zip(alone, packed, strict=True):
        _same_adapter(b.params, a.params, "the adapter after two steps")
    if kind == "lora":  # learning rate 0: bit-identical, whatever shared its passes
        for p, old in zip(packed[2].params, start[2], strict=True):
            assert torch.equal(p.detach(), old)


def test_a_bad_request_in_a_pack_is_refused_alone(tiny_llama):
    """A datum no check let through at submission (here: one that changed in the queue) is
    refused by name when its pack forms; the others in the pack are computed as alone."""
    base, clients = _clients(tiny_llama)
    data = [_data(i, loss_fn) for i, (_, loss_fn, _) in enumerate(CLIENTS)]
    bad = [Datum(d.tokens, dict(d.inputs)) for d in data[1]]
    bad[2].inputs["advantages"] = torch.full((len(bad[2].tokens),), float("nan"))
    requests = [
        Request(c, d, loss_fn, {}, True)
        for c, d, (_, loss_fn, _) in zip(clients, [data[0], bad, *data[2:]], CLIENTS, strict=True)
    ]
    out = forward_backward_checked(base, requests)
    assert isinstance(out[1], Refused) and "datum 2" in str(out[1]) and "advantages" in str(out[1])
    for i in (0, 2, 3):
        own = clients[i].forward_backward(data[i], CLIENTS[i][1], {}, True)
        assert abs(out[i].loss - own.loss) <= REL * max(abs(own.loss), 1e-3)
