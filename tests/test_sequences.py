"""Scoring a client's sequences (orbit/train/sequences.py, what `orbit serve`'s forward_backward
runs): sequences that start alike run their prefix once, and the logprobs and the gradient are those
of running every sequence whole; positions without weight get their logprob but no gradient."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
from transformers import AutoModelForCausalLM

from orbit.train.sequences import micro_batches, prefix_groups, target_logprobs

PROMPT = list(range(3, 23))  # 20 shared tokens
ROWS = [
    PROMPT + [40, 41, 42],
    [5, 6, 7],  # alone
    PROMPT + [50],
    PROMPT[:12] + [60, 61, 62, 63],  # shares 12 with the others
    PROMPT + [70, 71, 72, 73, 74, 75],
    PROMPT,  # the prefix itself: nothing of its own
]


def _model(path: Path) -> peft.PeftModel:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])
    model = peft.get_peft_model(base, config).eval()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # B = 0 would hide a wrong prefix's gradient
    return model


def _whole(model, rows: list[list[int]], targets: list[list[int]]) -> list[torch.Tensor]:
    out = []
    for r, t in zip(rows, targets, strict=True):
        logp = torch.log_softmax(model(torch.tensor([r])).logits[0].float(), dim=-1)
        out.append(logp[torch.arange(len(r)), torch.tensor(t)])
    return out


def test_sequences_that_start_alike_are_grouped():
    groups = prefix_groups(ROWS)
    by_member = {m: g for g in groups for m in g.members}
    assert by_member[0] is by_member[2] is by_member[4] is by_member[5]
    assert by_member[0].shared == 20 and by_member[1].members == [1]
    assert by_member[1].shared == 3  # alone: runs whole
    # 12 tokens shared with a group that shares 20: cheaper alone than shrinking the group's prefix
    assert by_member[3].members == [3]
    assert sorted(m for b in micro_batches(ROWS, 40) for m in b) == list(range(len(ROWS)))
    assert all(len(b) >= 1 for b in micro_batches(ROWS, 1))


def test_a_shared_prefix_gives_the_whole_sequence_forward_and_gradient(tiny_llama: Path):
    model = _model(tiny_llama)
    targets = [r[1:] + [7] for r in ROWS]  # the next token, and any token at the end
    weighted = [[i >= 20 or len(r) < 20 for i in range(len(r))] for r in ROWS]
    params = [p for p in model.parameters() if p.requires_grad]

    def run(scores) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logps = scores()
        loss = sum(
            (lp * torch.tensor(w, dtype=lp.dtype)).sum() * (i + 1)
            for i, (lp, w) in enumerate(zip(logps, weighted, strict=True))
        )
        loss.backward()
        return [lp.detach() for lp in logps], [p.grad.clone() for p in params]

    def shared():
        logp = target_logprobs(
            model.base_model.model.model, model.get_output_embeddings(), ROWS, targets, weighted
        )
        return [logp[i, : len(r)] for i, r in enumerate(ROWS)]

    got, got_grad = run(shared)
    want, want_grad = run(lambda: _whole(model, ROWS, targets))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grad, want_grad, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
