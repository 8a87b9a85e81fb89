"""Log-probabilities (and entropies) of chosen tokens from a model's logits, without float32 copies of them.

The plain way, `log_softmax(logits.float())` then a gather, keeps a float32 tensor the size of the logits for
backward, and with the entropy two more: over a 150k vocabulary that is 0.6 MB a token for each, more than a
small model's activations. `picked_logprobs` computes in float32 one chunk of rows at a time, keeps only the
logits themselves (in their own dtype) and a float per row, and recomputes each chunk's softmax in backward.
The values are the plain way's up to float rounding (the log-sum-exp is taken the same way), and so are the
gradients.
"""

from __future__ import annotations

import torch

#: float32 elements of one chunk's temporaries (64 MiB): large enough that a chunk is few kernel launches,
#: small enough that its temporaries are a sliver of what the whole logits in float32 would take
CHUNK_ELEMENTS = 1 << 24


def _rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


class _Picked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, positions, with_entropy):
        n, vocab = logits.shape
        rows = _rows(vocab)
        lse = logits.new_empty(n, dtype=torch.float32)
        ent = logits.new_empty(n, dtype=torch.float32) if with_entropy else None
        for a in range(0, n, rows):
            x = logits[a:a + rows].float()
            chunk = torch.logsumexp(x, dim=-1)
            lse[a:a + rows] = chunk
            if with_entropy:  # H = -sum p log p = lse - sum p x, the sum a row-by-row dot product
                p = (x - chunk[:, None]).exp_()
                ent[a:a + rows] = chunk - (p[:, None, :] @ x[:, :, None]).view(-1)
        at = torch.arange(n, device=logits.device) if positions is None else positions
        picked = logits[at, targets].float() - lse[at]
        ctx.save_for_backward(logits, targets, lse, ent, positions)
        ctx.with_entropy = with_entropy
        return picked, (ent[at] if with_entropy else picked.new_zeros(0))

    @staticmethod
    def backward(ctx, grad_picked, grad_ent):
        logits, targets, lse, ent, positions = ctx.saved_tensors
        n, vocab = logits.shape
        rows = _rows(vocab)
        f32 = dict(dtype=torch.float32, device=logits.device)
        if grad_picked is None:
            grad_picked = torch.zeros(targets.shape[0], **f32)
        grad_picked = grad_picked.float()
        use_ent = ctx.with_entropy and grad_ent is not None
        if positions is None:  # one picked token a row
            g_row, ge_row = grad_picked, (grad_ent.float() if use_ent else None)
            bounds = None
        else:  # a row picked by several (or none): sum what each asks of it
            g_row = torch.zeros(n, **f32).index_add_(0, positions, grad_picked)
            ge_row = torch.zeros(n, **f32).index_add_(0, positions, grad_ent.float()) if use_ent else None
            order = torch.argsort(positions, stable=True)
            edges = torch.arange(0, n + rows, rows, device=logits.device).clamp(max=n)
            bounds = (order, torch.searchsorted(positions[order], edges).tolist())  # one read for all chunks
        grad = torch.empty_like(logits)
        for i, a in enumerate(range(0, n, rows)):
            b = min(a + rows, n)
            logp = logits[a:b] - lse[a:b, None]  # float32, in one pass from the logits' own dtype
            if use_ent:  # d/dx of (g log p_target + ge H) = g onehot - p (g + ge (log p + H))
                p = logp.exp()
                g = p.mul_(logp.add_(ent[a:b, None]).mul_(-ge_row[a:b, None]).sub_(g_row[a:b, None]))
            else:
                g = logp.exp_().mul_(-g_row[a:b, None])
            if bounds is None:
                g[torch.arange(b - a, device=g.device), targets[a:b]] += grad_picked[a:b]
            else:
                idx = bounds[0][bounds[1][i]:bounds[1][i + 1]]
                g.index_put_((positions[idx] - a, targets[idx]), grad_picked[idx].to(g.dtype), accumulate=True)
            grad[a:b] = g
        return grad, None, None, None


def picked_logprobs(logits: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[m]) under the softmax of `logits[positions[m]]` ([N, V] logits; `positions` None: row m
    for target m), as float32, and with `with_entropy` each picked row's entropy; differentiable in `logits`."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    picked, ent = _Picked.apply(logits, targets, positions, with_entropy)
    return picked, (ent if with_entropy else None)


__all__ = ["CHUNK_ELEMENTS", "picked_logprobs"]
