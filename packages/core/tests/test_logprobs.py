"""`gearshift.logprobs.picked_logprobs`: the log-probabilities and entropies of the plain float32 log-softmax,
and its gradients, chunk by chunk, for rows picked once each or several times (shared prompts)."""

import pytest
import torch

from gearshift import logprobs
from gearshift.logprobs import picked_logprobs


def reference(logits, targets, positions, with_entropy):
    logp = torch.log_softmax(logits.float(), dim=-1)
    at = torch.arange(logits.shape[0]) if positions is None else positions
    picked = logp[at, targets]
    ent = -(logp.exp() * logp).sum(-1)[at] if with_entropy else None
    return picked, ent


def loss_of(picked, ent, w1, w2):
    return (picked * w1).sum() + ((ent * w2).sum() if ent is not None else 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("chunk", [1 << 24, 50])  # one chunk; chunks of 2 rows (a vocabulary of 23)
def test_values_and_gradients_are_the_plain_log_softmax(monkeypatch, dtype, shared, with_entropy, chunk):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    n, vocab = 11, 23
    base = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    if shared:  # row 2 predicts three tokens (a prompt's last token, before three answers); row 5 none
        positions = torch.tensor([0, 1, 2, 2, 2, 3, 4, 6, 7, 8, 9, 10, 10])
    else:
        positions = None
    m = n if positions is None else len(positions)
    targets = torch.randint(0, vocab, (m,), generator=g)
    w1, w2 = torch.randn(m, generator=g), torch.randn(m, generator=g)

    a = base.clone().requires_grad_()
    picked, ent = picked_logprobs(a, targets, positions, with_entropy)
    loss_of(picked, ent, w1, w2).backward()
    b = base.clone().requires_grad_()
    ref_picked, ref_ent = reference(b, targets, positions, with_entropy)
    loss_of(ref_picked, ref_ent, w1, w2).backward()

    assert picked.dtype == torch.float32
    torch.testing.assert_close(picked, ref_picked, rtol=1e-5, atol=1e-5)
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    else:
        assert ent is None
    assert a.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol)


def test_gradcheck_in_double(monkeypatch):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 14)  # chunks of 2 rows of a vocabulary of 7
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (6,), generator=g)
    positions = torch.tensor([0, 1, 1, 3, 4, 4])
    # float32 inside (as the trainers compute), so a loose check of the analytic gradient in double
    assert torch.autograd.gradcheck(lambda t: picked_logprobs(t, targets, positions, True)[0].sum()
                                    + picked_logprobs(t, targets, positions, True)[1].sum(),
                                    (x,), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_without_a_graph_nothing_is_kept_and_only_logits_are_kept_with_one():
    logits = torch.randn(64, 1000, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        picked, ent = picked_logprobs(logits, targets, with_entropy=True)
    # the bf16 logits themselves, a float per row (log-sum-exp, entropy) and the targets: no [rows, vocab] float32
    assert sum(kept) <= logits.numel() * 2 + 64 * 8 * 4
    with torch.no_grad():
        picked_logprobs(logits, targets, with_entropy=True)


def test_logits_of_the_wrong_rank_are_refused():
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        picked_logprobs(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))
