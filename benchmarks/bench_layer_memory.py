"""Two of the memory model's terms measured on CPU (``recipe/stapo/memory/model.py``, docs/memory.md).

    python -m benchmarks.bench_layer_memory layer          # a Qwen3-8B decoder layer at 1/8 width
    python -m benchmarks.bench_layer_memory layer --scale 4 --tokens 1024,2048
    python -m benchmarks.bench_layer_memory logits-grad    # the logits' gradient, 2048 x 151,936
    python -m benchmarks.bench_layer_memory fsdp-root      # FSDP1 on gloo, two processes

``layer``: the bytes per token one recomputed decoder layer's forward with grad and its backward
allocate (gradient checkpointing recomputes one layer at a time in the update). A Qwen3 layer of
the 8B's shape divided in width by ``--scale`` (heads of 128, as the real one), bfloat16, PyTorch's
SDPA attention (flash attention on CPU, as flash-attn on the GPU: no token x token matrix), one
packed sequence per token count. The peak resident memory beyond what exists before (its input,
the layer's parameters) is measured at each token count (``VmHWM``, as
benchmarks/bench_logits_memory.py); the slope over the token counts is the per-token part, which
scales with the width, so ``slope x scale`` is the 8B layer's, compared with the model's
``LAYER_BACKWARD_FACTOR x (2h + 3q + 3kv + 4I) x 2`` bytes per token.

``logits-grad``: the backward of verl's ``logprobs_from_logits`` on ``(tokens, vocab)`` bfloat16 logits
with ``inplace_backward=False`` (what verl passes when the update computes the entropy): the peak
bytes beyond the forward, against the model's ``tokens x vocab x 2`` for the logits' gradient. On CPU
verl's row-wise fallback runs (flash-attn's in-place kernel is GPU-only), so the flag changes nothing
here; the measurement is the gradient tensor the model adds.

``fsdp-root``: FSDP1 with one unit per decoder layer and the root holding the embedding and the
LM head, compute in bfloat16, on two gloo processes: after a forward without grad the decoder
layers' unsharded parameters are freed and the root's are not, until ``reshard`` (what verl's eval
context calls only when ``fsdp_size > 1``). Prints the bytes of each unit's unsharded storage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from benchmarks.bench_logits_memory import _mmap_large_allocations, peak_extra_bytes
from recipe.stapo.memory import model as mm

QWEN3_8B = mm.BUILTIN_SHAPES["qwen3-8b"]


def scaled_shape(scale: int) -> mm.ModelShape:
    """The 8B's shape at 1/``scale`` width: heads (and key-value heads) divided, head size kept."""
    s = QWEN3_8B
    return mm.ModelShape(hidden_size=s.hidden_size // scale, num_layers=1, num_heads=s.num_heads // scale,
                         num_kv_heads=max(1, s.num_kv_heads // scale), head_dim=s.head_dim,
                         intermediate_size=s.intermediate_size // scale, vocab_size=1024,
                         tie_word_embeddings=True, qk_norm=True, source=f"Qwen3-8B at 1/{scale} width")


def modelled_layer_bytes_per_token(shape: mm.ModelShape) -> float:
    _, _, layer_backward = mm._per_token_activation_bytes(shape, mm.BF16)
    return layer_backward


def measure_layer(scale: int, token_counts: list[int], seed: int = 0) -> dict:
    """Peak bytes of one layer's forward with grad and backward at each token count, the slope per
    token, and that slope scaled to the full width."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    _mmap_large_allocations()
    shape = scaled_shape(scale)
    config = Qwen3Config(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, num_hidden_layers=1, vocab_size=shape.vocab_size)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    layer = Qwen3DecoderLayer(config, layer_idx=0).to(torch.bfloat16)
    rotary = Qwen3RotaryEmbedding(config)
    peaks = {}
    for tokens in [min(token_counts)] + list(token_counts):  # the first run warms up lazy allocations
        hidden = torch.randn(1, tokens, shape.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(tokens).unsqueeze(0)
        cos, sin = rotary(hidden, positions)
        cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
        layer.zero_grad(set_to_none=True)

        def step():
            out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
            out = out[0] if isinstance(out, tuple) else out
            out.backward(torch.ones_like(out))

        # parameter gradients exist from the second call on (kept, not per token)
        step()
        layer.zero_grad(set_to_none=False)
        hidden.grad = None
        peaks[tokens] = peak_extra_bytes(step, "cpu")
        hidden.grad = None
    counts = sorted(token_counts)
    slope = (peaks[counts[-1]] - peaks[counts[0]]) / (counts[-1] - counts[0])
    full = slope * scale
    model = modelled_layer_bytes_per_token(QWEN3_8B)
    return {"scale": scale, "tokens": counts, "peak_bytes": [peaks[t] for t in counts],
            "bytes_per_token_scaled": slope, "bytes_per_token_8b": full, "model_bytes_per_token_8b": model,
            "ratio": full / model}


def measure_logits_grad(tokens: int, vocab: int, seed: int = 0) -> dict:
    """Peak bytes of the log-probs' backward beyond the forward (the logits' gradient and the
    fallback's temporaries), against the model's gradient term."""
    import verl_patches.activate  # noqa: F401  (the recipe's patches, as in every verl process)
    from verl.utils import torch_functional as verl_F

    _mmap_large_allocations()
    gen = torch.Generator().manual_seed(seed)
    logits = torch.empty(tokens, vocab, dtype=torch.bfloat16).normal_(0.0, 3.0, generator=gen).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    log_probs = verl_F.logprobs_from_logits(logits, labels, inplace_backward=False)
    measured = peak_extra_bytes(lambda: log_probs.sum().backward(), "cpu")
    model = mm.logits_bytes(tokens, vocab, mm.BF16)
    return {"tokens": tokens, "vocab": vocab, "measured_bytes": measured, "model_bytes": model,
            "ratio": measured / model, "grad_dtype": str(logits.grad.dtype)}


def _fsdp_root_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    fsdp = FSDP(_TinyLM(), auto_wrap_policy=ModuleWrapPolicy({_Layer}), device_id=torch.device("cpu"),
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))

    def unsharded(unit) -> int:
        return unit._handle._get_padded_unsharded_flat_param().untyped_storage().size()

    with torch.no_grad():
        fsdp(torch.randint(0, _TinyLM.VOCAB, (2, 8)))
    layers = [unsharded(m) for m in fsdp.modules() if isinstance(m, FSDP) and m is not fsdp]
    root = unsharded(fsdp)
    fsdp._handle.reshard(True)  # what verl's eval context does when fsdp_size > 1
    after = unsharded(fsdp)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"root_unsharded_bytes": root, "layer_unsharded_bytes": layers,
                       "root_after_reshard_bytes": after, "root_params": _TinyLM.root_params(),
                       "world_size": world}, f)
    dist.destroy_process_group()


class _Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x)


class _TinyLM(torch.nn.Module):
    """Embedding, two decoder stand-ins (each its own FSDP unit), final norm, untied LM head."""

    VOCAB, WIDTH = 1000, 64

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(self.VOCAB, self.WIDTH)
        self.layers = torch.nn.ModuleList([_Layer(self.WIDTH), _Layer(self.WIDTH)])
        self.norm = torch.nn.LayerNorm(self.WIDTH, bias=False)
        self.head = torch.nn.Linear(self.WIDTH, self.VOCAB, bias=False)

    @classmethod
    def root_params(cls) -> int:
        return 2 * cls.VOCAB * cls.WIDTH + cls.WIDTH

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def measure_fsdp_root(port: int = 29533) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "root.json")
        mp.spawn(_fsdp_root_worker, args=(2, port, out), nprocs=2)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("layer", "logits-grad", "fsdp-root"))
    p.add_argument("--scale", type=int, default=8)
    p.add_argument("--tokens", default="2048,4096")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--vocab", type=int, default=151936, help="logits-grad: the vocabulary")
    p.add_argument("--json", default=None, help="also write the result to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.what == "layer":
        result = measure_layer(args.scale, [int(t) for t in args.tokens.split(",")])
    elif args.what == "logits-grad":
        result = measure_logits_grad(int(args.tokens.split(",")[0]), args.vocab)
    else:
        result = measure_fsdp_root(args.port)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
