"""Activation checkpointing: keep fewer of a block's activations and rebuild the rest during backward.

A block's backward needs what its forward computed. Three ways to have it, `GPTConfig(checkpoint=...)`:

    "none"       autograd keeps every tensor the backward reads        s·b·h·(16 + a/h) values a block (SDPA)
    "selective"  keep the block's input and every matmul's output       s·b·h·(11 + a/h)
                 (the linear layers and attention, MUST_SAVE), rebuild
                 the cheap rest (LayerNorm, GeLU, reshapes) from them
    "full"       keep only the block's input; rerun the whole forward  s·b·h·1
                 during backward

(s tokens, b sequences, h = d_model, a heads; with SDPA a block keeps the LayerNorms' inputs and outputs (4),
Q, K, V (3), the attention output (1), the MLP's GeLU input and output (4 + 4): 16·sbh, and one log-sum-exp per
row and head, a·s·b; 17·sbh where merging the heads copies the attention output, which a kernel that writes it
as (b, s, a, d) avoids. Selective keeps the outputs of QKV (3), attention (1 + the log-sum-exp),
the projection (1), the MLP's two layers (4 + 1) and the input (1): 11·sbh + a·s·b.) What is rebuilt costs time:
"full" one more forward of the block (about a third of a step), "selective" only the elementwise operations,
which are cheap in FLOPs. Both are `torch.utils.checkpoint.checkpoint(use_reentrant=False)`; selective adds
torch's policy API (`create_selective_checkpoint_contexts`), which asks `policy(ctx, op)` for every operation.
The outputs and gradients are the same numbers as without checkpointing: the rebuilt operations rerun on the
same inputs.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "selective", "full")

# The operations whose outputs selective checkpointing keeps: the matmuls and the fused attention kernels
# (`torch.ops.aten.<name>.default`; a name this build lacks is skipped).
SAVED_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention")


@functools.cache
def saved_ops() -> frozenset:
    """The aten overloads of SAVED_OPS that exist in this torch."""
    return frozenset(getattr(torch.ops.aten, name).default for name in SAVED_OPS if hasattr(torch.ops.aten, name))


def keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: MUST_SAVE the output of a matmul or an attention kernel, PREFER_RECOMPUTE the rest."""
    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(forward, x: torch.Tensor, mode: str) -> torch.Tensor:
    """`forward(x)` under activation checkpointing `mode` ("none", "selective" or "full")."""
    if mode == "none":
        return forward(x)
    if mode == "full":
        return checkpoint(forward, x, use_reentrant=False)
    if mode == "selective":
        return checkpoint(forward, x, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, keep_matmuls))
    raise ValueError(f"unknown checkpoint mode {mode!r}: use one of {', '.join(MODES)}")


def kept_values_per_block(mode: str, seq: int, batch: int, d_model: int, n_heads: int) -> int:
    """Values a block keeps for backward under `mode` with SDPA attention (the table above):
    none s·b·(16h + a), selective s·b·(11h + a), full s·b·h."""
    s, b, h, a = seq, batch, d_model, n_heads
    per = {"none": 16 * s * b * h + a * s * b, "selective": 11 * s * b * h + a * s * b, "full": s * b * h}
    if mode not in per:
        raise ValueError(f"unknown checkpoint mode {mode!r}: use one of {', '.join(MODES)}")
    return per[mode]


def bytes_kept(fn, *inputs, exclude=()) -> tuple[object, int]:
    """Run `fn(*inputs)`; return (its output, the bytes of the tensors its forward created that are still alive
    once it returned): what autograd and checkpointing hold for backward, the output included. Counted by
    storage, each once, with `exclude`'s storages (the parameters) left out. Unlike saved-tensor hooks, this also
    sees what checkpointing keeps in its own frames."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
    created: dict[int, tuple[StorageWeakRef, int]] = {}

    class Created(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    ref = StorageWeakRef(t.untyped_storage())
                    known = created.get(ref.cdata)
                    if ref.cdata not in skip and (known is None or known[0].expired()):   # an address reused
                        created[ref.cdata] = (ref, t.untyped_storage().nbytes())
            return out

    with Created():
        out = fn(*inputs)
    return out, sum(n for ref, n in created.values() if not ref.expired())
