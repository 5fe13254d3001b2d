"""stable_reinforce's provenance (orbit/serve/provenance.py) alone: recorded sequences in the
database, kept a day after their last use, and a datum's claims checked against them. The SDK's
own run of it: tests/test_tinker.py::test_stable_reinforce_trains_on_the_recorded_sequences."""

from __future__ import annotations

import time

import pytest
import torch

from orbit.serve import provenance
from orbit.serve.provenance import KEEP_S, ProvenanceError, resolve
from orbit.serve.store import RecordedRow, Store
from orbit.serve.wire import Datum, Sampled, Sequence, Span

PROMPT = [1, 5, 9]
TOKENS = [20, 21, 22]
LOGPROBS = [-0.5, -1.25, -2.0]


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'serve.db'}", "host:/serve")
    sampled = Sampled([Sequence(TOKENS, LOGPROBS, stopped=True)])
    s.add_recorded(provenance.records("t1", "s1", PROMPT, ["r:0"], sampled, time.time()))
    yield s
    s.close()


def _datum(tokens=TOKENS, advantage=1.0, sid="r:0") -> Datum:
    """As the cookbook builds one: the input drops the last token, the targets the first."""
    full = PROMPT + tokens
    n = len(tokens)
    return Datum(
        full[:-1],
        {
            "target_tokens": torch.tensor(full[1:]),
            "advantages": torch.tensor([0.0] * (len(PROMPT) - 1) + [advantage] * n),
            "logprobs": torch.tensor([0.0] * (len(PROMPT) - 1) + LOGPROBS),
        },
        input_spans=[Span(False, sid, 0, len(PROMPT)), Span(True, sid, 0, n - 1)],
        target_spans=[Span(False, sid, 1, len(PROMPT) - 1), Span(True, sid, 0, n)],
    )


def test_a_datum_gets_the_recorded_logprobs_of_its_sampled_tokens(store):
    (datum,), diff = resolve([_datum()], "t1", "s1", store.recorded)
    assert datum.inputs["logprobs"].tolist() == [0.0, 0.0, *LOGPROBS]
    assert datum.inputs["sampled"].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert diff == 0.0


@pytest.mark.parametrize(
    "tenant, session, datum, said",
    [
        ("t2", "s9", _datum(), "no recorded sequence"),  # another tenant's: as if missing
        ("t1", "s2", _datum(), "provenance works within one session"),
        ("t1", "s1", _datum(sid="r:7"), "sequence_id 'r:7': no recorded sequence"),
        ("t1", "s1", _datum(tokens=[20, 99, 22]), "model_input[4] is 99"),
        ("t1", "s1", _datum(tokens=TOKENS + [23]), "it has 3"),
    ],
)
def test_a_claim_that_does_not_hold_is_refused_by_name(store, tenant, session, datum, said):
    with pytest.raises(ProvenanceError, match=said.replace("[", r"\[")):
        resolve([datum], tenant, session, store.recorded)


def test_spans_that_do_not_tile_and_a_datum_without_them_are_refused(store):
    short = _datum()
    short.target_spans = short.target_spans[:1]
    with pytest.raises(ProvenanceError, match="target_tokens cover 2 positions; it has 5"):
        resolve([short], "t1", "s1", store.recorded)
    bare = _datum()
    bare.input_spans = bare.target_spans = None
    with pytest.raises(ProvenanceError, match="datum 0: loss_fn stable_reinforce needs provenance"):
        resolve([bare], "t1", "s1", store.recorded)


def test_a_recorded_sequence_lives_a_day_after_its_last_use(store):
    with store._tx() as s:  # recorded a day and a minute ago
        s.get(RecordedRow, "r:0").used = time.time() - KEEP_S - 60
    assert store.recorded("t2", ["r:0"]) == {}  # another tenant's: not found, its day not touched
    with store._tx() as s:
        assert s.get(RecordedRow, "r:0").used < time.time() - KEEP_S
    assert store.recorded("t1", ["r:0"])  # used now: its day starts again
    assert store.purge_recorded(time.time() - KEEP_S) == 0
    with store._tx() as s:
        s.get(RecordedRow, "r:0").used = time.time() - KEEP_S - 60
    assert store.purge_recorded(time.time() - KEEP_S) == 1
    with pytest.raises(ProvenanceError, match="no recorded sequence"):
        resolve([_datum()], "t1", "s1", store.recorded)
