"""PyTorch counterparts of memsave-models' LLaMA-style decoder, vision transformer,
U-Net and encoder-decoder transformer.

Imported by the reference scripts: ``llama(config)`` and ``vit(config)`` take a suite's
model configuration as a dict (the keys the Rust ``LlamaConfig``/``VitConfig`` have,
missing keys taking the Rust defaults) and return an ``nn.Module`` whose training step
runs the same ATen ops in the same order as the Rust model
(crates/memsave-models/src/llama.rs, vit.rs), so both allocate the same bytes.

* ``llama``: a module of our own with tch's ``examples/llama`` parameter names
  (``transformer.wte``, ``transformer.h.{i}.rms_1``/``attn.c_attn``/..., ``lm_head``).
  Input token ids ``[batch, seq]``, output logits ``[batch, seq, vocab]``.
* ``vit``: torchvision's ``VisionTransformer`` itself for square 3-channel images; for
  other images a subclass differing only in the input check, ``conv_proj``'s input
  channels and the position embedding's length. Input images, output logits.

* ``unet``: a U-Net with the Rust ``unet.rs`` variable names (``enc{i}.conv1``,
  ``bottom.bn2``, ``dec{i}.up``, ``head``, ...). Input images, output per-pixel logits
  ``[batch, classes, height, width]``.
* ``encoder_decoder``: a pre-LN encoder-decoder transformer with the Rust
  ``encoder_decoder.rs`` variable names. Input the packed tokens ``[batch, source +
  target]`` (source first), output logits ``[batch, target, vocab]``.

These two are not chains: ``model(x, run)`` runs each named block as ``run(block,
*inputs)`` (the default calls it; ``zoo.py`` passes ``torch.utils.checkpoint`` for
``checkpoint: {every_layer: true}``), the blocks the Rust forward runs through
``memsave_checkpoint::Blocks``.

``layers(model)`` gives the model as the chain of blocks the Rust network is made of
(layer 0 the embedding, one per decoder/encoder block, the last the final norm and
head), for checkpointing with the same granularity: running them in order is the same
computation as ``model(x)``.
"""
import math

import torch
import torchvision
from torch import nn
from torch.nn import functional as F

LLAMA_DEFAULTS = dict(vocab=32000, dim=256, layers=4, heads=8, kv_heads=None, hidden=None,
                      seq=128, tied=False, norm_eps=1e-5, rope_theta=10000.0)
VIT_DEFAULTS = dict(image=[3, 224, 224], patch=16, dim=768, layers=12, heads=12, mlp=3072,
                    classes=1000)


def _with_defaults(config, defaults, kind):
    unknown = sorted(set(config) - set(defaults) - {"kind"})
    if unknown:
        raise ValueError(f"{kind}: unknown configuration keys {unknown}; known: {sorted(defaults)}")
    merged = dict(defaults)
    merged.update({k: v for k, v in config.items() if k != "kind"})
    return merged


def llama_hidden(dim):
    """LLaMA's SwiGLU width (and tch's example's): 8 * dim / 3 rounded up to a multiple of 256."""
    n = 8 * dim // 3
    return (n - 1) // 256 * 256 + 256


class RmsNorm(nn.Module):
    """tch's example's RMSNorm: mean of squares in f32, its inverse square root, the scale."""

    def __init__(self, size, eps):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        mean_square = (x * x).mean(-1, keepdim=True, dtype=torch.float32)
        normed = x * (mean_square + self.eps).rsqrt()
        return self.scale.reshape(1, 1, -1) * normed


class Rotary:
    """cos/sin of position * theta^(-2i/head_dim), [seq, 1, head_dim/2]; constants, not
    parameters or buffers (the Rust table is no variable either): they follow the input's
    dtype and device at each call."""

    def __init__(self, seq, head_dim, theta):
        i = torch.arange(head_dim // 2, dtype=torch.float64)
        inv_freq = theta ** (-(2 * i) / head_dim)
        angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos = angles.cos().float().reshape(seq, 1, head_dim // 2)
        self.sin = angles.sin().float().reshape(seq, 1, head_dim // 2)

    def _fit(self, table, x, t):
        table = table.narrow(0, 0, t)
        if table.dtype != x.dtype or table.device != x.device:
            table = table.to(device=x.device, dtype=x.dtype)
        return table

    def apply(self, x):
        """Rotates the interleaved pairs of x [batch, seq, heads, head_dim]."""
        t, head_dim = x.shape[1], x.shape[3]
        if t > self.cos.shape[0]:
            raise ValueError(f"llama: a sequence of {t} tokens is longer than the configured seq {self.cos.shape[0]}")
        cos, sin = self._fit(self.cos, x, t), self._fit(self.sin, x, t)
        pairs = x.unflatten(-1, (head_dim // 2, 2))
        re, im = pairs.select(-1, 0), pairs.select(-1, 1)
        rotated_re = re * cos - im * sin
        rotated_im = re * sin + im * cos
        return torch.stack([rotated_re, rotated_im], -1).flatten(-2, -1)


def _linear_weight(out_features, in_features):
    w = torch.empty(out_features, in_features)
    bound = 1.0 / math.sqrt(in_features)
    nn.init.uniform_(w, -bound, bound)
    return nn.Parameter(w)


class _Weight(nn.Module):
    """A bias-free linear layer holding only ``weight`` (tch's name), applied with F.linear."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = _linear_weight(out_features, in_features)

    def forward(self, x):
        return F.linear(x, self.weight)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads, rotary):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.c_attn = _Weight(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.c_proj = _Weight(heads * self.head_dim, dim)
        self.rotary = rotary

    def forward(self, x):
        b, t, _ = x.shape
        h, kv, hd = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.c_attn(x).split([h * hd, kv * hd, kv * hd], -1)
        q = self.rotary.apply(q.view(b, t, h, hd)).transpose(1, 2)
        k = self.rotary.apply(k.view(b, t, kv, hd)).transpose(1, 2)
        v = v.view(b, t, kv, hd).transpose(1, 2)
        if kv < h:
            def repeat(z):
                return z.unsqueeze(2).expand(b, kv, h // kv, t, hd).reshape(b, h, t, hd)
            k, v = repeat(k), repeat(v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, h * hd)
        return self.c_proj(y)


class Mlp(nn.Module):
    """SwiGLU: c_proj(silu(c_fc1(x)) * c_fc2(x)) (LLaMA's w2(silu(w1 x) * w3 x))."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.c_fc1 = _Weight(dim, hidden)
        self.c_fc2 = _Weight(dim, hidden)
        self.c_proj = _Weight(hidden, dim)

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc1(x)) * self.c_fc2(x))


class Block(nn.Module):
    def __init__(self, c, rotary):
        super().__init__()
        self.rms_1 = RmsNorm(c["dim"], c["norm_eps"])
        self.attn = Attention(c["dim"], c["heads"], c["kv_heads"], rotary)
        self.rms_2 = RmsNorm(c["dim"], c["norm_eps"])
        self.mlp = Mlp(c["dim"], c["hidden"])

    def forward(self, x):
        x = self.attn(self.rms_1(x)) + x
        return self.mlp(self.rms_2(x)) + x


class _LlamaEmbedding(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.wte = model.transformer.wte

    def forward(self, tokens):
        return F.embedding(tokens, self.wte.weight)


class _LlamaHead(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.ln_f = model.transformer.ln_f
        self.weight = model.transformer.wte.weight if model.tied else model.lm_head.weight

    def forward(self, x):
        return F.linear(self.ln_f(x), self.weight)


class Llama(nn.Module):
    """The LLaMA-style decoder of memsave-models, tch's example's parameter names."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.tied = c["tied"]
        rotary = Rotary(c["seq"], c["dim"] // c["heads"], c["rope_theta"])
        wte = nn.Embedding(c["vocab"], c["dim"])
        self.transformer = nn.ModuleDict(dict(
            wte=wte,
            h=nn.ModuleList([Block(c, rotary) for _ in range(c["layers"])]),
            ln_f=RmsNorm(c["dim"], c["norm_eps"]),
        ))
        if not self.tied:
            self.lm_head = _Weight(c["dim"], c["vocab"])

    def chain(self):
        """The blocks the Rust network is made of (not registered as submodules)."""
        return [_LlamaEmbedding(self), *self.transformer.h, _LlamaHead(self)]

    def forward(self, tokens):
        x = tokens
        for layer in self.chain():
            x = layer(x)
        return x


def llama(config):
    """The LLaMA-style decoder for a configuration dict (keys of the Rust LlamaConfig:
    vocab, dim, layers, heads, kv_heads (default heads), hidden (default LLaMA's rule),
    seq, tied, norm_eps, rope_theta)."""
    c = _with_defaults(config, LLAMA_DEFAULTS, "llama")
    if c["kv_heads"] is None:
        c["kv_heads"] = c["heads"]
    if c["hidden"] is None:
        c["hidden"] = llama_hidden(c["dim"])
    if c["dim"] % c["heads"] or (c["dim"] // c["heads"]) % 2 or c["heads"] % c["kv_heads"]:
        raise ValueError(f"llama: heads must divide dim into an even width and kv_heads divide heads: {c}")
    return Llama(c)


class _VisionTransformer(torchvision.models.VisionTransformer):
    """torchvision's model for [channels, height, width] images: only the input check, the
    patch convolution's input channels and the position embedding's length differ."""

    def __init__(self, channels, height, width, **kwargs):
        super().__init__(image_size=height, **kwargs)
        self.image_hw = (height, width)
        p, dim = self.patch_size, self.hidden_dim
        if channels != 3:
            self.conv_proj = nn.Conv2d(channels, dim, kernel_size=p, stride=p)
            nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / (channels * p * p)))
            nn.init.zeros_(self.conv_proj.bias)
        self.seq_length = (height // p) * (width // p) + 1
        self.encoder.pos_embedding = nn.Parameter(
            torch.empty(1, self.seq_length, dim).normal_(std=0.02))

    def _process_input(self, x):
        n, _, h, w = x.shape
        if (h, w) != self.image_hw:
            raise ValueError(f"vit: images must be {self.image_hw}, got {(h, w)}")
        p = self.patch_size
        x = self.conv_proj(x)
        x = x.reshape(n, self.hidden_dim, (h // p) * (w // p))
        return x.permute(0, 2, 1)


def vit(config):
    """The vision transformer for a configuration dict (keys of the Rust VitConfig: image
    [channels, height, width] (or one side: square, 3 channels), patch, dim, layers, heads,
    mlp, classes): torchvision's VisionTransformer."""
    c = _with_defaults(config, VIT_DEFAULTS, "vit")
    image = c["image"]
    channels, height, width = (3, image, image) if isinstance(image, int) else image
    kwargs = dict(patch_size=c["patch"], num_layers=c["layers"], num_heads=c["heads"],
                  hidden_dim=c["dim"], mlp_dim=c["mlp"], num_classes=c["classes"])
    if height % c["patch"] or width % c["patch"]:
        raise ValueError(f"vit: patch {c['patch']} must divide the image's {height}x{width}")
    if channels == 3 and height == width:
        return torchvision.models.VisionTransformer(image_size=height, **kwargs)
    return _VisionTransformer(channels, height, width, **kwargs)


class _VitEmbedding(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        m = self.model
        x = m._process_input(x)
        x = torch.cat([m.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return m.encoder.dropout(x + m.encoder.pos_embedding)


class _VitHead(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model.heads(self.model.encoder.ln(x)[:, 0])


def _call(block, *inputs):
    """``run`` of a plain forward: the block itself."""
    return block(*inputs)


UNET_DEFAULTS = dict(image=[3, 128, 128], classes=2, base=64, levels=4)


class _UNetLevel(nn.Module):
    """Two 3x3 conv (no bias) + BatchNorm + ReLU (in place); with pool, a 2x2 max pool first."""

    def __init__(self, c_in, c_out, pool):
        super().__init__()
        self.pool = pool
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)

    def forward(self, x):
        if self.pool:
            x = F.max_pool2d(x, 2, 2)
        x = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(x)), inplace=True)


class _UNetUp(_UNetLevel):
    """A decoder level: 2x2 transposed conv (stride 2) of the level below, the skip
    concatenated before it, then a level's two conv-BN-ReLU."""

    def __init__(self, c_below, c):
        super().__init__(2 * c, c, False)
        self.up = nn.ConvTranspose2d(c_below, c, 2, stride=2)

    def forward(self, below, skip):
        return super().forward(torch.cat([skip, self.up(below)], 1))


class UNet(nn.Module):
    """The U-Net of memsave-models (unet.rs): blocks enc0..enc{levels-1}, bottom,
    dec{levels-1}..dec0, head."""

    def __init__(self, c):
        super().__init__()
        self.levels = c["levels"]
        base, c_in = c["base"], c["image"][0]
        for level in range(self.levels):
            setattr(self, f"enc{level}", _UNetLevel(c_in, base << level, level > 0))
            c_in = base << level
        self.bottom = _UNetLevel(c_in, base << self.levels, True)
        for level in range(self.levels):
            setattr(self, f"dec{level}", _UNetUp(base << (level + 1), base << level))
        self.head = nn.Conv2d(base, c["classes"], 1)

    def forward(self, x, run=_call):
        skips = []
        for level in range(self.levels):
            x = run(getattr(self, f"enc{level}"), x)
            skips.append(x)
        x = run(self.bottom, x)
        for level in reversed(range(self.levels)):
            skip = skips.pop()
            x = run(getattr(self, f"dec{level}"), x, skip)
            del skip
        return run(self.head, x)


def unet(config):
    """The U-Net for a configuration dict (keys of the Rust UNetConfig: image
    [channels, height, width], classes, base, levels)."""
    c = _with_defaults(config, UNET_DEFAULTS, "unet")
    _, height, width = c["image"]
    if height % (1 << c["levels"]) or width % (1 << c["levels"]):
        raise ValueError(f"unet: 2^levels must divide the image's {height}x{width}")
    return UNet(c)


ENCODER_DECODER_DEFAULTS = dict(vocab=32000, dim=512, heads=8, encoder_layers=6,
                                decoder_layers=6, source=128, target=128)


def _attend(q, k, v, heads, causal):
    """Attention of q over k, v ([batch, len, dim] views of the projections), back to
    [batch, q's len, dim]."""
    b, t, e = q.shape

    def split(z):
        return z.view(z.shape[0], z.shape[1], heads, e // heads).transpose(1, 2)

    y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=causal)
    return y.transpose(1, 2).reshape(b, t, e)


class _SelfAttention(nn.Module):
    def __init__(self, dim, heads, causal):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.heads, self.causal = heads, causal

    def forward(self, x):
        q, k, v = self.qkv(x).split(x.shape[-1], -1)
        return self.out(_attend(q, k, v, self.heads, self.causal))


class _CrossAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x, memory):
        q = self.q(x)
        k, v = self.kv(memory).split(x.shape[-1], -1)
        return self.out(_attend(q, k, v, self.heads, False))


class _Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.self_attn = _SelfAttention(dim, heads, False)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = _Mlp(dim)

    def forward(self, x):
        x = x + self.self_attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _DecoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.self_attn = _SelfAttention(dim, heads, True)
        self.ln_2 = nn.LayerNorm(dim)
        self.cross_attn = _CrossAttention(dim, heads)
        self.ln_3 = nn.LayerNorm(dim)
        self.mlp = _Mlp(dim)

    def forward(self, x, memory):
        x = x + self.self_attn(self.ln_1(x))
        x = x + self.cross_attn(self.ln_2(x), memory)
        return x + self.mlp(self.ln_3(x))


class _Stack(nn.Module):
    """One side: token and position embeddings, the blocks, the final LayerNorm."""

    def __init__(self, c, length, layer, count):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["dim"])
        self.embed_positions = nn.Embedding(length, c["dim"])
        self.layers = nn.ModuleList([layer(c["dim"], c["heads"]) for _ in range(count)])
        self.ln = nn.LayerNorm(c["dim"])


class EncoderDecoder(nn.Module):
    """The encoder-decoder transformer of memsave-models (encoder_decoder.rs): blocks
    embed, enc{i}, enc_ln, dec{i} (reading the encoder's output), head."""

    def __init__(self, c):
        super().__init__()
        self.source, self.target = c["source"], c["target"]
        self.encoder = _Stack(c, c["source"], _EncoderLayer, c["encoder_layers"])
        self.decoder = _Stack(c, c["target"], _DecoderLayer, c["decoder_layers"])
        self.lm_head = nn.Linear(c["dim"], c["vocab"], bias=False)

    def _embed(self, packed):
        if packed.shape[1] != self.source + self.target:
            raise ValueError(f"encoder_decoder: the input packs {self.source} source and "
                             f"{self.target} target tokens, got {packed.shape[1]} columns")
        source = packed.narrow(1, 0, self.source)
        target = packed.narrow(1, self.source, self.target)
        s = F.embedding(source, self.encoder.embed_tokens.weight) + self.encoder.embed_positions.weight
        t = F.embedding(target, self.decoder.embed_tokens.weight) + self.decoder.embed_positions.weight
        return s, t

    def _head(self, x):
        return self.lm_head(self.decoder.ln(x))

    def forward(self, packed, run=_call):
        source, target = run(self._embed, packed)
        for layer in self.encoder.layers:
            source = run(layer, source)
        memory = run(self.encoder.ln, source)
        del source
        for layer in self.decoder.layers:
            target = run(layer, target, memory)
        del memory
        return run(self._head, target)


def encoder_decoder(config):
    """The encoder-decoder transformer for a configuration dict (keys of the Rust
    EncoderDecoderConfig: vocab, dim, heads, encoder_layers, decoder_layers, source,
    target)."""
    c = _with_defaults(config, ENCODER_DECODER_DEFAULTS, "encoder_decoder")
    if c["dim"] % c["heads"]:
        raise ValueError(f"encoder_decoder: heads must divide dim: {c}")
    return EncoderDecoder(c)


def layers(model):
    """The model as the Rust chain of blocks: a list of callables to run in order."""
    if isinstance(model, Llama):
        return model.chain()
    if isinstance(model, torchvision.models.VisionTransformer):
        return [_VitEmbedding(model), *model.encoder.layers, _VitHead(model)]
    raise TypeError(f"no chain of blocks for {type(model).__name__}")
