"""The training loss: next-token cross-entropy, fused with the unembedding on the float32 path.

:func:`model_loss` is what a training step minimises. It computes the same number as
:func:`qkov.model.ops.next_token_loss` on the model's logits (tested, with its gradients),
without ever holding a ``[tokens, d_vocab]`` logits tensor.
"""

from __future__ import annotations

import torch

from ..model.transformer import Transformer

__all__ = ["LossModule", "model_loss"]


class _CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``logits [n, v]`` against ``target [n]`` with a one-pass backward.

    The forward keeps the softmax it computes anyway; the backward is then
    ``(softmax - onehot) / n`` in one pass, with no zero-filled intermediate (on a CPU,
    large fresh zero buffers cost as much as the softmax itself).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        top = logits.amax(dim=-1, keepdim=True)
        probs = (logits - top).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        probs.div_(total)
        lse = total.log_().add_(top)[:, 0]
        picked = logits.gather(-1, target[:, None])[:, 0]
        ctx.save_for_backward(probs, target)
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        probs, target = ctx.saved_tensors
        n = probs.shape[0]
        g = probs * (grad / n)
        g.scatter_add_(-1, target[:, None], torch.full((n, 1), -1.0, dtype=g.dtype, device=g.device) * (grad / n))
        return g, None


class _UnembedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``x @ W (+ b)`` against ``target``, fused and chunked (float32 path).

    ``x [n, d_model]``, ``W [d_model, d_vocab]``. Rows are processed ``chunk`` at a time and,
    since the loss is a scalar, the gradients are formed in the forward pass (backward only
    rescales them): no ``[n, d_vocab]`` logits tensor is ever held, and each chunk's logits
    stay in cache while they become probabilities and then gradients (measured ~4% faster
    per CPU step than unembed + one-pass cross-entropy, and less memory).
    """

    @staticmethod
    def forward(ctx, x, W, b, target, chunk):  # type: ignore[override]
        n = x.shape[0]
        dx = torch.empty_like(x)
        dW = torch.zeros_like(W)
        db = torch.zeros_like(b) if b is not None else None
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for lo in range(0, n, chunk):
            xc, tc = x[lo : lo + chunk], target[lo : lo + chunk]
            lg = xc @ W
            if b is not None:
                lg += b
            lg.sub_(lg.amax(-1, keepdim=True))  # l - max
            picked = lg.gather(-1, tc[:, None])  # the target's, before exp: its exp underflows 100 nats below the max
            total_c = lg.exp_().sum(-1, keepdim=True)
            total += (total_c.log() - picked).sum(dtype=torch.float64)  # -log softmax at the target
            lg.div_(total_c)  # softmax
            lg.scatter_add_(-1, tc[:, None], torch.full_like(picked, -1.0)).div_(n)  # d loss / d logits
            torch.matmul(lg, W.T, out=dx[lo : lo + chunk])
            dW.addmm_(xc.T, lg)
            if db is not None:
                db += lg.sum(0)
        ctx.save_for_backward(dx, dW, db if db is not None else torch.empty(0))
        ctx.has_b = b is not None
        return (total / n).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dx, dW, db = ctx.saved_tensors
        return dx * grad, dW * grad, (db * grad if ctx.has_b else None), None, None


def model_loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Training loss of ``model`` on ``tokens [b, t]``: logits only where a next token exists.

    float32: the fused, chunked unembedding + cross-entropy; under bf16 autocast: unembed
    (bf16 matrix product) then a float32 one-pass cross-entropy.
    """
    resid = model.stream(tokens)
    target = tokens[:, 1:].reshape(-1)
    if torch.is_autocast_enabled(tokens.device.type):
        logits = model.unembed(resid[:, :-1])
        return _CrossEntropy.apply(logits.reshape(-1, logits.shape[-1]).float(), target)
    x = resid[:, :-1]
    if model.ln_final is not None:
        x = model.ln_final(x)
    return _UnembedCrossEntropy.apply(x.reshape(-1, x.shape[-1]), model.W_U, model.b_U, target, 1024)


class LossModule(torch.nn.Module):
    """The training loss as a module's forward, so DistributedDataParallel can hook it."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return model_loss(self.model, tokens)
