"""Plan small language models that Hugging Face's transformers builds and torch's dynamo exporter writes.

Usage: python bench/hf_exports.py [--kinds qwen3,phi3,gpt_neox,bloom] [--devices 64,256] [--layers 2]
                                  [--hidden 256] [--batch 128] [--seq 128] [--out FOLDER]

tests/data/hf_{qwen3,bloom,gpt_neox}_dynamo.onnx were written by
``python bench/hf_exports.py --kinds qwen3,bloom,gpt_neox --hidden 64 --batch 4 --seq 32 --devices 8 --out tests/data``
(Qwen3's and BLOOM's before node metadata was trimmed).

Needs torch, onnxscript and transformers (not autopar's dependencies: install them in a scratch
environment). Each model is built from a random-initialised configuration of its family (grouped-
query attention for Qwen3, rotary in Qwen3, Phi-3 and GPT-NeoX, ALiBi in BLOOM, attention and MLP in
parallel in GPT-NeoX), given its token loss, exported by ``torch.onnx.export(dynamo=True)`` with its
parameters moved out to a file that is not kept (buffers and folded tables stay stored, as a user's
export has them; of each node's metadata only its layer names stay), then planned by the real command
line in a fresh process. Printed per model and device count: wall time and peak memory of
``autopar plan``, the predicted step time, or the refusal.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# bench/transformers.py would shadow Hugging Face's package of that name
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def configuration(kind: str, layers: int, hidden: int, seq: int, vocab: int = 1024):
    import transformers as hf

    common = dict(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        vocab_size=vocab,
        max_position_embeddings=seq,
        intermediate_size=4 * hidden,
    )
    if kind == "qwen3":
        return hf.Qwen3Config(**common, num_key_value_heads=2, head_dim=hidden // 4)
    if kind == "phi3":
        return hf.Phi3Config(**common, num_key_value_heads=4, pad_token_id=0)
    if kind == "gpt_neox":
        return hf.GPTNeoXConfig(**common)
    if kind == "bloom":
        return hf.BloomConfig(n_layer=layers, hidden_size=hidden, n_head=4, vocab_size=vocab)
    raise SystemExit(f"unknown kind {kind!r}: choose qwen3, phi3, gpt_neox or bloom")


def export(kind: str, layers: int, hidden: int, batch: int, seq: int, path: Path) -> None:
    import onnx
    import torch
    import transformers as hf
    from onnx.external_data_helper import set_external_data

    class WithLoss(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, labels=labels, use_cache=False).loss

    torch.manual_seed(0)
    config = configuration(kind, layers, hidden, seq)
    config._attn_implementation = "eager"
    model = WithLoss(hf.AutoModelForCausalLM.from_config(config)).eval()
    if getattr(config, "use_parallel_residual", False):
        # GPT-NeoX's attention and MLP norms read the same input: with a fresh model's identical scales
        # and biases the exporter merges the two operators into one, which no importer can split again
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.ndim == 1:
                    parameter.normal_()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    torch.onnx.export(model, (ids, ids), str(path), dynamo=True, input_names=["ids", "labels"])
    proto = onnx.load(str(path))
    keep_layer_names(proto)
    buffers = {name for name, _ in model.named_buffers()}
    for tensor in proto.graph.initializer:
        if tensor.name not in buffers and tensor.data_type == onnx.TensorProto.FLOAT and math.prod(tensor.dims) > 1:
            set_external_data(tensor, path.name + ".weights")
    onnx.save(proto, str(path))
    for stray in (path.parent / (path.name + ".weights"), path.parent / (path.name + ".data")):
        stray.unlink(missing_ok=True)


def keep_layer_names(proto) -> None:
    """Of each node's metadata only its layer names stay (a plan shows them); the exporter's stack traces go."""
    for node in proto.graph.node:
        kept = [(p.key, p.value) for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"]
        del node.metadata_props[:]
        for key, value in kept:
            node.metadata_props.add(key=key, value=value)


@dataclass(frozen=True)
class Measured:
    """One command run in a fresh process: wall and CPU seconds, its peak resident memory, what it said."""

    wall: float
    cpu: float  # user and system seconds, its children's included: what a busy machine's wall time hides
    rss: int  # bytes: the largest of the command's process and those it forks (not their sum)
    code: int
    out: str
    err: str

    @property
    def refusal(self) -> str:
        lines = self.err.strip().splitlines()
        return lines[-1] if lines else f"exit {self.code}"


# Linux keeps a process's peak memory across exec, so a command started from this process (which
# holds torch and transformers) would report this process's size as its own: it starts from a small
# Python that reports what its one child used
_PEAK = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(sys.argv[1], "w") as out:
    out.write(f"{usage.ru_maxrss} {usage.ru_utime + usage.ru_stime}")
sys.exit(code)
"""


def measure(argv: list[str]) -> Measured:
    """Run ``argv`` and measure it: wall time here, CPU time and peak memory as its parent saw them."""
    with tempfile.TemporaryDirectory() as folder:
        said = Path(folder) / "usage"
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-S", "-c", _PEAK, str(said), *argv], capture_output=True, text=True)
        wall = time.perf_counter() - start
        peak, cpu = said.read_text().split()
    return Measured(wall, float(cpu), int(peak) * 1024, done.returncode, done.stdout, done.stderr)


def autopar(*args: str) -> list[str]:
    """The command line a user types, run by this interpreter."""
    return [sys.executable, "-m", "autopar.cli", *args]


def plan(path: Path, devices: int) -> str:
    done = measure(autopar("plan", str(path), "--devices", str(devices), "--quiet"))
    head = f"{done.wall:.1f} s ({done.cpu:.1f} s CPU) | {done.rss / 2**20:,.0f} MiB"
    if done.code:
        return f"{head} | refused: {done.refusal[:150]}"
    step = next((line for line in done.out.splitlines() if line.startswith("step time:")), "").strip()
    return f"{head} | {step[:80]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="qwen3,phi3,gpt_neox,bloom")
    parser.add_argument("--devices", default="64,256")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", type=Path, help="keep the exports in this folder (as hf_KIND_dynamo.onnx)")
    args = parser.parse_args()
    print("| model | devices | autopar plan wall (CPU) | peak memory | predicted step |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.kinds.split(","):
            path = (args.out or Path(folder)) / f"hf_{kind}_dynamo.onnx"
            export(kind, args.layers, args.hidden, args.batch, args.seq, path)
            for devices in (int(d) for d in args.devices.split(",")):
                print(
                    f"| {kind} ({args.layers} layers, hidden {args.hidden}, batch {args.batch}) | {devices} | "
                    f"{plan(path, devices)} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
