"""A small GPT in PyTorch, exported to ONNX by both of torch's exporters (test helper).

``python -m tests.torch_gpt`` regenerates the committed exports in ``tests/data/``: the graph
as each exporter writes it, with the weights moved to an external data file that is not kept
(autopar plans from shapes alone and verification draws random weights), so the files stay
small. Needs torch (and onnxscript for the dynamo exporter); the tests skip that part without.
"""

from __future__ import annotations

import math
from pathlib import Path

DATA = Path(__file__).parent / "data"
CONFIG = dict(vocab=128, hidden=64, heads=4, seq=16, layers=2)
BATCH = 4


def build_module():
    """The model: pre-LN blocks with a fused QKV Linear, a causal mask buffer and exact GELU."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, hidden: int, heads: int, seq: int):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc1, self.fc2, self.act = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden), nn.GELU()
            self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

        def forward(self, x):
            b, t, h = x.shape
            d = h // self.heads
            q, k, v = (y.view(b, t, self.heads, d).transpose(1, 2) for y in self.qkv(self.ln1(x)).split(h, dim=-1))
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
            probs = scores.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
            x = x + self.proj((probs @ v).transpose(1, 2).reshape(b, t, h))
            return x + self.fc2(self.act(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, vocab: int, hidden: int, heads: int, seq: int, layers: int):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
            self.blocks = nn.ModuleList(Block(hidden, heads, seq) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids, labels):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln(x))
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            return loss, logits

    torch.manual_seed(0)
    model = GPT(**CONFIG).eval()
    with torch.no_grad():  # distinct values everywhere: exporters merge identical initializers (fresh LayerNorms)
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return model


def export(path: Path, dynamo: bool) -> None:
    """Export the module with static shapes (batch 4, sequence 16)."""
    import torch

    ids = torch.randint(0, CONFIG["vocab"], (BATCH, CONFIG["seq"]))
    labels = torch.randint(0, CONFIG["vocab"], (BATCH, CONFIG["seq"]))
    torch.onnx.export(
        build_module(),
        (ids, labels),
        str(path),
        input_names=["ids", "labels"],
        output_names=["loss", "logits"],
        dynamo=dynamo,
        opset_version=18 if dynamo else 17,
    )


def main() -> None:
    import tempfile

    import onnx
    from onnx.external_data_helper import set_external_data

    FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}

    DATA.mkdir(exist_ok=True)
    for exporter in ("legacy", "dynamo"):
        with tempfile.TemporaryDirectory() as scratch:
            exported = Path(scratch) / "gpt.onnx"
            export(exported, dynamo=exporter == "dynamo")
            model = onnx.load(str(exported))
        target = DATA / f"torch_gpt_{exporter}.onnx"
        weights = f"{target.name}.weights"
        for tensor in model.graph.initializer:  # float tensors (weights) go out; int/bool constants stay
            if tensor.data_type in FLOAT_TYPES and math.prod(tensor.dims) > 1:
                set_external_data(tensor, weights)
        onnx.save(model, str(target))
        (DATA / weights).unlink()  # keep the graph, not the weights
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
