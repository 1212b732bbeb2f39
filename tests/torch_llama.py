"""A Llama-style decoder in plain torch.nn, exported to ONNX by both of torch's exporters (test helper).

What real exports do that `models/transformer.py` does not: RMSNorm written out, rotary embedding
from one cos/sin table that every layer reads (in Hugging Face's ``rotate_half`` form, or the
interleaved real form of the complex rotation), grouped-query attention (K and V heads repeated),
a SiLU-gated MLP and the token loss. ``python -m tests.torch_llama`` regenerates the committed
exports in ``tests/data/`` (weights moved to an external file that is not kept; the rotary tables
and the mask, which are buffers, stay stored). ``export`` writes any size for benchmarks. Needs torch
(and onnxscript for the dynamo exporter).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

DATA = Path(__file__).parent / "data"
CONFIG = dict(vocab=256, hidden=64, heads=4, kv_heads=2, ffn=160, seq=16, layers=6)
BATCH = 4
ROPES = ("half", "interleaved")


def build_module(
    vocab: int, hidden: int, heads: int, kv_heads: int, ffn: int, seq: int, layers: int, rope: str = "half"
):
    """The model (built on whatever device is current: the meta device allocates nothing)."""
    import torch
    from torch import nn

    head_dim = hidden // heads

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    def rotate(x, cos, sin):
        if rope == "half":  # sliced, not chunked: the legacy exporter's chunk computes its bounds at run time
            x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        pairs = x.reshape(*x.shape[:-1], head_dim // 2, 2)
        real, imag = pairs[..., 0], pairs[..., 1]
        c, s = cos[..., : head_dim // 2], sin[..., : head_dim // 2]
        return torch.stack((real * c - imag * s, real * s + imag * c), dim=-1).flatten(-2)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm, self.ffn_norm = RMSNorm(), RMSNorm()
            self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
            self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=False)
            self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=False)
            self.wo = nn.Linear(heads * head_dim, hidden, bias=False)
            self.w1 = nn.Linear(hidden, ffn, bias=False)
            self.w3 = nn.Linear(hidden, ffn, bias=False)
            self.w2 = nn.Linear(ffn, hidden, bias=False)

        def forward(self, x, cos, sin, mask):
            b, t, _ = x.shape
            y = self.attention_norm(x)
            q = self.wq(y).view(b, t, heads, head_dim).transpose(1, 2)
            k = self.wk(y).view(b, t, kv_heads, head_dim).transpose(1, 2)
            v = self.wv(y).view(b, t, kv_heads, head_dim).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim) + mask
            context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, heads * head_dim)
            x = x + self.wo(context)
            y = self.ffn_norm(x)
            return x + self.w2(nn.functional.silu(self.w1(y)) * self.w3(y))

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.norm = RMSNorm()
            self.output = nn.Linear(hidden, vocab, bias=False)
            inverse = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
            angles = torch.outer(torch.arange(seq).float(), inverse)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", angles.cos())
            self.register_buffer("sin", angles.sin())
            self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

        def forward(self, ids, labels):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x, self.cos, self.sin, self.mask)
            logits = self.output(self.norm(x))
            return nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), labels.reshape(-1))

    return Llama()


def export(path: Path, exporter: str, batch: int = BATCH, rope: str = "half", **sizes: int) -> None:
    """Write the model of these sizes (CONFIG's by default) as ``exporter`` ("dynamo" or "legacy") does.

    Parameters become external data that is never kept (autopar plans from shapes; verification
    draws random weights); buffers (rotary tables, mask) stay stored. A model too large for this
    machine is built on the meta device and exported by dynamo with its parameters never allocated.
    """
    import onnx
    import torch
    from onnx.external_data_helper import set_external_data

    config = CONFIG | sizes
    large = config["hidden"] * config["layers"] > 8192
    torch.manual_seed(0)
    with torch.device("meta" if large else "cpu"):
        model = build_module(**config, rope=rope)
    if not large:
        with torch.no_grad():  # distinct values everywhere: exporters merge identical initializers (fresh norms)
            for parameter in model.parameters():
                parameter.add_(0.02 * torch.randn_like(parameter))
    buffers = {name: value for name, value in model.named_buffers()}
    ids = torch.randint(0, config["vocab"], (batch, config["seq"]), device="meta" if large else "cpu")
    with tempfile.TemporaryDirectory() as scratch:
        exported = Path(scratch) / "model.onnx"
        if large:
            _export_meta(model, (ids, ids), exported, config)
        else:
            options = {"dynamo": True} if exporter == "dynamo" else {"dynamo": False, "opset_version": 17}
            torch.onnx.export(model, (ids, ids), str(exported), input_names=["ids", "labels"], **options)
        model_proto = onnx.load(str(exported), load_external_data=not large)
    weights = f"{path.name}.weights"
    for tensor in model_proto.graph.initializer:  # parameters go out; buffers and small constants stay
        stored = tensor.data_location != onnx.TensorProto.EXTERNAL
        weight = tensor.name not in buffers and tensor.data_type == onnx.TensorProto.FLOAT
        if stored and weight and math.prod(tensor.dims) > 1:
            set_external_data(tensor, weights)
    onnx.save(model_proto, str(path))
    stray = path.parent / weights
    if stray.exists():
        stray.unlink()  # keep the graph, not the weights


def _export_meta(model, args, path: Path, config: dict) -> None:
    """dynamo's export of a meta-device model: parameters as external references, buffers with values."""
    import onnx
    import onnx_ir as ir
    import torch

    with torch.device("cpu"):
        values = {name: value.numpy() for name, value in build_module(**(config | {"layers": 0})).named_buffers()}
    program = torch.onnx.export(model, args, dynamo=True, optimize=False)
    for name, value in list(program.model.graph.initializers.items()):
        if name in values:
            value.const_value = ir.tensor(values[name], name=name)
        else:
            tensor = value.const_value
            nbytes = math.prod(int(d) for d in tensor.shape) * tensor.dtype.itemsize
            value.const_value = ir.ExternalTensor(
                "never-written", 0, nbytes, tensor.dtype, shape=tensor.shape, name=name, base_dir=str(path.parent)
            )
    program.optimize()
    onnx.save(ir.serde.serialize_model(program.model), str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description="regenerate tests/data/torch_llama_*.onnx")
    parser.parse_args()
    DATA.mkdir(exist_ok=True)
    for exporter in ("legacy", "dynamo"):
        target = DATA / f"torch_llama_{exporter}.onnx"
        export(target, exporter)
        print(f"wrote {target}")
    target = DATA / "torch_llama_interleaved_dynamo.onnx"
    export(target, "dynamo", rope="interleaved")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
