"""Plan full-size Hugging Face models the search once refused for the size of its tables.

Usage: python bench/large_exports.py [--kinds llama3_8b,albert,deepseek_v3,mamba2] [--devices 64]
                                     [--layers 2] [--batch 8] [--seq 512] [--route] [--out FOLDER]

Each model is built from its transformers configuration at its published width (Llama-3-8B: hidden 4,096,
32 heads, 8 key-value heads, MLP 14,336, vocabulary 128,256; Mixtral 8x7B (``--kinds mixtral``: 8 experts of
that MLP, top 2); ALBERT-xxlarge; DeepSeek-V3's latent attention and routed experts, fewer of them (``--kinds
deepseek_v3_64``: 64 routed experts of MLP 2,048 and a shared one, top 8 of 8 groups, 4 kept, as V3 routes its
256; the stacks of 256 would be allocated before they reach the meta device, 30 GB a layer);
Mamba2-2.7B) with a few layers, its parameters on torch's meta device so
that no weight is ever allocated, given its training loss and exported by torch's dynamo exporter
(``optimize=False``: the optimiser folds constants, which meta tensors do not have). The file keeps each
parameter's shape and points its data at a file that is not written, as ``bench/hf_exports.py`` does;
buffers (rotary frequencies, position ids) are stored. Then ``autopar plan FILE --devices N --cost-model h100
--optimizer adam --quiet`` runs in a fresh process: printed are its wall time, CPU time, peak memory, the
predicted step, the degrees and what the search proved (exact, or the gap to its lower bound). ``--route``
writes the gathered experts of the mixture-of-experts kinds as GShard's dispatch first (`autopar route`, its
default capacity factor), so that a plan can split them.

Needs torch, onnxscript and transformers (the test extra).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hf_exports import autopar, keep_layer_names, measure

# bench/transformers.py would shadow Hugging Face's package of that name
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def configuration(kind: str, layers: int, seq: int):
    import transformers as hf

    if kind == "llama3_8b":
        return hf.LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        )
    if kind == "llama2_7b":  # NeMo's long-sequence runs: 32 heads, no grouped-query attention
        return hf.LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=32,
            intermediate_size=11008,
            vocab_size=32000,
            max_position_embeddings=max(seq, 4096),
        )
    if kind == "mixtral":  # Mixtral 8x7B: 8 experts, top 2, grouped-query attention
        return hf.MixtralConfig(
            num_hidden_layers=layers,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            max_position_embeddings=32768,
            rope_theta=1e6,
        )
    if kind == "albert":
        return hf.AlbertConfig(
            num_hidden_layers=layers,
            hidden_size=4096,
            num_attention_heads=64,
            intermediate_size=16384,
            embedding_size=128,
            vocab_size=30000,
            max_position_embeddings=seq,
        )
    if kind in ("deepseek_v3", "deepseek_v3_64"):  # the _64: V3's routing with 64 experts, top 8, 4 of 8 groups
        routing = (16, 4, 4, 2) if kind == "deepseek_v3" else (64, 8, 8, 4)
        experts, top_k, groups, kept = routing
        return hf.DeepseekV3Config(
            num_hidden_layers=layers,
            first_k_dense_replace=1,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=experts,
            n_shared_experts=1,
            num_experts_per_tok=top_k,
            n_group=groups,
            topk_group=kept,
            vocab_size=129280,
        )
    if kind == "mamba2":
        return hf.Mamba2Config(
            num_hidden_layers=layers,
            hidden_size=2560,
            state_size=128,
            num_heads=80,
            head_dim=64,
            n_groups=1,
            expand=2,
            chunk_size=256,
            vocab_size=50288,
        )
    raise SystemExit(
        f"unknown kind {kind!r}: choose llama3_8b, llama2_7b, mixtral, albert, deepseek_v3, deepseek_v3_64 or mamba2"
    )


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers lands on the meta device (shape and type, no storage); buffers
    are computed as usual."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, parameter: torch.nn.Parameter | None) -> None:
        register(module, name, parameter)
        if parameter is not None:
            moved = module._parameters[name].to("meta")  # type: ignore[union-attr]
            module._parameters[name] = type(parameter)(moved, requires_grad=parameter.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def export(kind: str, layers: int, batch: int, seq: int, path: Path, config=None, dynamic_batch: bool = False) -> None:
    """Export ``kind`` (its `configuration`, or ``config`` where given) with its loss to ``path``;
    ``dynamic_batch``: the batch a symbol, so that the file can be planned at other batches (micro-batches),
    where an export at a fixed batch writes it into constants (the causal mask's ranges) no import can find."""
    import onnx
    import torch
    import transformers as hf
    from onnx import numpy_helper

    config = configuration(kind, layers, seq) if config is None else config
    config._attn_implementation = "eager"
    # each routed token's expert weights gathered from the stacks: the default grouped_mm calls operators
    # (histc) the ONNX exporter cannot translate
    config._experts_implementation = "batched_mm"
    masked = kind == "albert"
    with parameters_on_meta():
        model = (hf.AutoModelForMaskedLM if masked else hf.AutoModelForCausalLM).from_config(config)

    class WithLoss(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            options = {} if masked else {"use_cache": False}
            return self.model(input_ids=ids, labels=labels, **options).loss

    module = WithLoss(model)
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    module = module.to("meta")
    ids = torch.zeros((batch, seq), dtype=torch.int64, device="meta")
    shapes = None
    if dynamic_batch:
        samples = torch.export.Dim("batch", min=1, max=1 << 16)
        shapes = ({0: samples}, {0: samples})
    program = torch.export.export(module, (ids, ids), dynamic_shapes=shapes)
    program = torch.onnx.export(program, dynamo=True, optimize=False)
    stored = {name: ([int(d) for d in v.shape], int(v.dtype)) for name, v in program.model.graph.initializers.items()}
    program.save(str(path), include_initializers=False)
    proto = onnx.load(str(path), load_external_data=False)
    for name, (dims, dtype) in stored.items():
        if name in buffers:
            tensor = numpy_helper.from_array(buffers[name].numpy(), name)
        else:  # its shape and type; its data in a file that is never written
            tensor = onnx.TensorProto(name=name, data_type=dtype, dims=dims, data_location=onnx.TensorProto.EXTERNAL)
            tensor.external_data.add(key="location", value=path.name + ".weights")
        proto.graph.initializer.append(tensor)
    keep_layer_names(proto)
    onnx.save(proto, str(path))


def plan(path: Path, devices: int) -> str:
    done = measure(autopar("plan", str(path), "--devices", str(devices), "--cost-model", "h100", "--optimizer", "adam"))
    head = f"{done.wall:.1f} s ({done.cpu:.1f} s CPU) | {done.rss / 2**20:,.0f} MiB"
    if done.code:
        return f"{head} | refused: {done.refusal[:200]} | | |"
    lines = done.out.splitlines()
    step = next((line for line in lines if line.startswith("step time:")), "").split(":", 1)[-1].strip()
    degrees = next((line for line in lines if line.startswith("degrees:")), "").split(":", 1)[-1].strip()
    search = next((line for line in lines if line.startswith("search:")), "").split(":", 1)[-1].strip()
    return f"{head} | {step.split('(')[0].strip()} | {degrees} | {search} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="llama3_8b,albert,deepseek_v3,mamba2")
    parser.add_argument("--devices", default="64")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--route", action="store_true", help="write gathered experts as GShard's dispatch first")
    parser.add_argument("--out", type=Path, help="keep the exports in this folder (as KIND.onnx)")
    args = parser.parse_args()
    print("| model | devices | autopar plan wall (CPU) | peak memory | predicted step | degrees | search |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.kinds.split(","):
            path = (args.out or Path(folder)) / f"{kind}.onnx"
            try:
                export(kind, args.layers, args.batch, args.seq, path)
            except Exception as error:  # an export torch cannot write is a row, not the end of the table
                print(f"| {kind} | | export failed: {type(error).__name__}: {str(error)[:150]} | | | | |", flush=True)
                continue
            if args.route:
                routed = path.with_name(f"{kind}_routed.onnx")
                done = measure(autopar("route", str(path), "-o", str(routed), "--quiet"))
                path = routed if done.code == 0 else path  # a kind without gathered experts is planned as it is
            for devices in (int(d) for d in args.devices.split(",")):
                routed_label = ", routed" if path.stem.endswith("_routed") else ""
                label = f"{kind} ({args.layers} layers, batch {args.batch}, sequence {args.seq}{routed_label})"
                print(f"| {label} | {devices} | {plan(path, devices)}", flush=True)


if __name__ == "__main__":
    main()
