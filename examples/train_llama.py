"""Train a Hugging Face causal language model with an autopar plan, on 8 CPU processes.

    torchrun --nproc-per-node 8 examples/train_llama.py [--steps 10] [--layers 2] [--batch 16]

What a user does, end to end: build the model (a Llama, random-initialised, from its transformers
configuration), wrap it so that its forward returns the loss, export it with the dynamo exporter and plan the
export (rank 0 does both and the others wait), then parallelize the module with the plan and train it with an
ordinary AdamW on synthetic tokens. Each step prints the loss, the tokens per second and every rank's peak
memory. Needs ``pip install "autopar[torch]" transformers``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import autopar
from autopar.torch import parallelize


class CausalLM(torch.nn.Module):
    """The model with its loss: what is exported, planned and trained."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels, use_cache=False).loss


def build(layers: int, vocab: int, sequence: int) -> CausalLM:
    torch.manual_seed(0)  # every rank builds the same model
    config = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=vocab,
        max_position_embeddings=sequence,
    )
    config._attn_implementation = "eager"
    module = CausalLM(transformers.LlamaForCausalLM(config))
    with torch.no_grad():  # a fresh model's norms are all ones: set them apart, or the exporter merges them
        for parameter in module.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.02 * torch.randn_like(parameter))
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="sequences a step (the global batch)")
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a rank that dies ends the others in 120 s
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    module = build(args.layers, args.vocab, args.sequence)
    tokens = torch.Generator().manual_seed(1)
    batch = torch.randint(0, args.vocab, (args.batch, args.sequence + 1), generator=tokens)
    example = (batch[:, :-1], batch[:, 1:])

    folder = Path(os.environ.get("AUTOPAR_EXAMPLE_DIR") or tempfile.gettempdir()) / "autopar-example"
    model_file, plan_file = folder / "llama.onnx", folder / "llama.plan.json"
    if rank == 0:  # export and plan once; the other ranks read the files
        folder.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "exporting a model in training mode": it is trained
            program = torch.onnx.export(module, example, dynamo=True, verbose=False)
        program.save(str(model_file))
        plan = autopar.plan(str(model_file), devices=world, optimizer="adam")
        plan_file.write_text(json.dumps(plan.to_dict()))  # what `autopar plan --format json` writes
        print(f"plan: {plan.degrees}, {plan.objective * 1e3:.3f} ms a step predicted on {plan.file.cost_model}")
    dist.barrier()

    module = parallelize(module, plan_file, model_file, example)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for step in range(args.steps):
        batch = torch.randint(0, args.vocab, (args.batch, args.sequence + 1), generator=tokens)
        start = time.perf_counter()
        loss = module.train_step(batch[:, :-1], batch[:, 1:])  # forward, backward, gradients synchronised
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MB (Linux reports kB)
        peaks: list[float] = [0.0] * world
        dist.all_gather_object(peaks, peak)
        if rank == 0:
            memory = " ".join(f"{value:.0f}" for value in peaks)
            print(
                f"step {step:3d}  loss {loss.item():.4f}  {args.batch * args.sequence / seconds:9.0f} tokens/s"
                f"  peak MB per rank: {memory}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
