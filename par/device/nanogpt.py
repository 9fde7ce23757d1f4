"""The reference of lecture 10: GPT-2 written the way nanoGPT writes it (Karpathy, github.com/karpathy/nanoGPT,
model.py and train.py), the yardstick par's fast path is timed against.

    tokens ─▶ wte + wpe ─▶ Block × L ─▶ ln_f ─▶ lm_head (its weight is wte's: tied)
    Block(x) = x + c_proj(SDPA(c_attn(ln_1(x)))),  then  x + c_proj(gelu(c_fc(ln_2(x))))

What nanoGPT does for speed, and this file does too: one fused QKV projection, `scaled_dot_product_attention`
with is_causal (flash attention on a GPU), the vocabulary padded to a multiple of 64 (50,257 -> 50,304),
the LM head tied to the token embedding, bf16 autocast, AdamW with fused=True, `torch.compile` of the
whole model, TF32 matmuls. The widths are par's GPTConfig's, so both models do the same FLOPs.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from par.reference import fused_supported


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = nn.Linear(d, 3 * d), nn.Linear(d, d), n_head

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class NanoBlock(nn.Module):
    def __init__(self, d: int, n_head: int, ffn: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, n_head)
        self.ln_2, self.c_fc, self.c_proj = nn.LayerNorm(d), nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's GPT for a par `GPTConfig` `cfg` (its widths; the vocabulary padded to `padded_vocab`)."""

    def __init__(self, cfg, padded_vocab: int):
        super().__init__()
        d = cfg.d_model
        self.wte, self.wpe = nn.Embedding(padded_vocab, d), nn.Embedding(cfg.block_size, d)
        self.h = nn.ModuleList(NanoBlock(d, cfg.n_head, cfg.ffn) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, padded_vocab, bias=False)
        self.lm_head.weight = self.wte.weight                       # weight tying
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def optimizer(model: nn.Module, lr: float = 6e-4) -> torch.optim.AdamW:
    """AdamW as nanoGPT configures it: betas (0.9, 0.95), fused where the device has the kernel."""
    device = next(model.parameters()).device
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), fused=fused_supported(device))
