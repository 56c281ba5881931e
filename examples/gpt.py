"""A small GPT-style language model and a synthetic data source, shared by the examples,
the tests and the benchmarks.

The data is a noisy walk through a fixed random permutation of the vocabulary: each token
is followed by ``table[token]`` except that, with probability ``noise``, it is replaced by
a uniformly random token. A model that learns the table reaches the noise floor, so the
loss falls visibly from ln(vocab) within a few hundred steps.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "build_gpt", "PermutationWalk", "noise_floor"]


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head, bias):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model must be divisible by n_head, got d_model={d_model}, "
                             f"n_head={n_head}; pick n_head among the divisors of d_model")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x):
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (batch, time, channels) -> (batch, head, time, head_dim)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class Block(nn.Module):
    def __init__(self, d_model, n_head, bias):
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_head, bias)
        self.ln_mlp = nn.LayerNorm(d_model, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model, bias=bias), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model, bias=bias))

    def forward(self, x):
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx)`` maps (batch, time) token ids to logits.

    ``bias=False`` drops the biases of the linear layers and layer norms (as in nanoGPT). It
    also removes the attention's key bias, whose gradient is mathematically zero (softmax
    ignores a shift shared by every key), so that weight only ever sees rounding noise.
    """

    def __init__(self, vocab, d_model, n_layer, n_head, ctx, tie_weights=True, bias=True):
        super().__init__()
        self.ctx = ctx
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(ctx, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model, bias=bias)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tie_weights:
            # The output projection shares its weight with the token embedding.
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # Scale the residual projections down with depth (GPT-2).
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        time = idx.shape[1]
        if time > self.ctx:
            raise ValueError(f"sequence length {time} exceeds the context {self.ctx}; "
                             f"crop the input or build the model with ctx >= {time}")
        positions = torch.arange(time, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss(logits, targets):
        """Mean next-token cross-entropy over every position of the batch."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_gpt(vocab=256, d_model=128, n_layer=2, n_head=4, ctx=64, tie_weights=True,
              bias=True):
    """Returns a freshly initialised GPT (initialisation draws from torch's global RNG)."""
    return GPT(vocab, d_model, n_layer, n_head, ctx, tie_weights=tie_weights, bias=bias)


class PermutationWalk:
    """Deterministic synthetic token batches: a noisy walk through a fixed permutation.

    ``batch(step, rows)`` returns (inputs, targets), each (rows, ctx) int64, and depends
    only on (seed, step, rows), so every rank can draw the same global batch and take its
    own slice of it.
    """

    def __init__(self, vocab=256, ctx=64, noise=0.1, seed=0):
        self.vocab, self.ctx, self.noise, self.seed = vocab, ctx, noise, seed
        table_rng = torch.Generator().manual_seed(seed)
        self.table = torch.randperm(vocab, generator=table_rng)

    def batch(self, step, rows):
        rng = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        tokens = torch.empty(rows, self.ctx + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self.vocab, (rows,), generator=rng)
        random_tokens = torch.randint(self.vocab, (rows, self.ctx), generator=rng)
        replace = torch.rand(rows, self.ctx, generator=rng) < self.noise
        for t in range(self.ctx):
            following = self.table[tokens[:, t]]
            tokens[:, t + 1] = torch.where(replace[:, t], random_tokens[:, t], following)
        return tokens[:, :-1], tokens[:, 1:]


def noise_floor(vocab, noise):
    """The lowest achievable mean cross-entropy on PermutationWalk data (nats)."""
    p_follow = 1.0 - noise + noise / vocab
    p_other = noise / vocab
    return -(p_follow * math.log(p_follow) + (vocab - 1) * p_other * math.log(p_other))
