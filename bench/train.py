"""Train Hugging Face families nobody here wrote with their plans: one process against the plan's ranks.

Usage: python bench/train.py [--families llama,qwen3,gpt_neox,bert,vit,resnet,moe,gemma3,phi3,roberta,falcon,gpt2,bloom,
                                        deepseek_v3,mamba2]
                             [--plans searched,sharded] [--steps 20] [--devices 8] [--gpu]
       python bench/train.py --families bert_dropout

Each family (`tests/hf_families.py`: random-initialised, 2 layers, hidden 64, batch 8) is exported by the dynamo
exporter and planned twice: ``searched`` is what ``autopar plan MODEL --devices 8 --optimizer adam`` gives on
the Ascend 910 profile; ``sharded`` plans on the tests' round-number profile with device memory set to half of
what the searched plan needs a device, so that the plan shards weights (tensor parallel, the parallel
optimizer, micro-batches). Then the module trains ``--steps`` AdamW steps (learning rate 1e-3) in one process
and, parallelized (`autopar.torch.parallelize`), on ``--devices`` gloo processes, each taking its step with
``train_step`` (which checks every step's collectives against the plan's and stops otherwise). Printed per
family and plan: the degrees, the largest relative difference of the loss over the steps, the largest relative
difference (in norm) of a parameter's gradient in the first step (AdamW's steps would hide a gradient off by a
constant factor) and of a final parameter, each over the elements that have a gradient (those that have
none in exact arithmetic, such as an attention key's bias, are listed apart: see ``ROUNDOFF``), the samples a
second and the peak resident memory of the one process and of the largest rank (forked ranks share the
interpreter's pages), and the plan's predicted step beside the measured one (the prediction is for the plan's
hardware, not this CPU).

``bert_dropout`` (`tests.hf_families.WITH_DROPOUT`: BERT at Hugging Face's default dropout, 0.1) trains so too,
the ranks' masks drawn from one seed (`autopar.torch.dropout`), against one process whose dropout draws the same
masks (`MasksAsPlanned`) over the plan's micro-batches (gradient accumulation).

With ``--gpu`` on a machine with a CUDA device: a 4-layer Llama (hidden 1024) planned on one device with the
h100 profile, its measured step (CUDA events, after warm-up) beside the prediction.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))  # this checkout's autopar and tests, however the script is run

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.cost import HardwareProfile  # noqa: E402
from autopar.runtime.launch import run_workers  # noqa: E402
from tests.conftest import simple_profile_dict  # noqa: E402
from tests.hf_families import FAMILIES, WITH_DROPOUT, export, family_named  # noqa: E402

BATCH = 8
SEED = 11  # dropout's, where a family drops (`WITH_DROPOUT`)
LEARNING_RATE = 1e-3
# An element whose gradient in one process never exceeds this fraction of the largest gradient element has no
# gradient in exact arithmetic (an attention key's bias: softmax does not see a shift of every score by one
# amount); fp32 leaves it noise, and AdamW turns the noise's sign into steps of up to the learning rate.
ROUNDOFF = 1e-6


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _one_process(name: str, batches: list[Any], micro_batches: int = 1) -> Any:
    """The module's steps in one process, over ``micro_batches`` (gradient accumulation); a family that drops
    draws the ranks' masks (`MasksAsPlanned`)."""

    def work(rank: int, world: int, device: Any) -> Any:
        from autopar.torch.dropout import MasksAsPlanned

        module = family_named(name).build(2)
        optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
        losses, seconds = [], []
        largest = {key: torch.zeros_like(value) for key, value in module.named_parameters()}
        first: dict[str, Any] = {}
        with MasksAsPlanned(SEED).drawing() if name in WITH_DROPOUT else contextlib.nullcontext():
            for batch in batches:
                start = time.perf_counter()
                loss = torch.zeros(())
                for part in zip(*(value.chunk(micro_batches) for value in batch)):
                    micro = module(*part) / micro_batches
                    micro.backward()
                    loss += micro.detach()
                for key, value in module.named_parameters():
                    if value.grad is not None:
                        torch.maximum(largest[key], value.grad.abs(), out=largest[key])
                if not first:
                    first = {
                        key: value.grad.clone() for key, value in module.named_parameters() if value.grad is not None
                    }
                optimizer.step()
                optimizer.zero_grad()
                seconds.append(time.perf_counter() - start)
                losses.append(loss.item())
        state = {key: value.detach().clone() for key, value in module.state_dict().items()}
        scale = max(value.max().item() for value in largest.values())
        roundoff = {key: value <= ROUNDOFF * scale for key, value in largest.items()}
        return losses, state, seconds, _peak_mb(), roundoff, first

    return run_workers(1, work, timeout_s=600)[0]


def _ranks(name: str, plan: str, model: str, batches: list[Any], devices: int) -> list[Any]:
    def work(rank: int, world: int, device: Any) -> Any:
        from autopar.torch import parallelize

        module = parallelize(family_named(name).build(2), plan, model, batches[0], seed=SEED)
        optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
        losses, seconds = [], []
        first: dict[str, Any] = {}
        for batch in batches:
            start = time.perf_counter()
            loss = module.train_step(*batch)
            if not first:  # (the first step's time counts in no figure: gathering them costs nothing measured)
                first = {key: p.grad.full_tensor() for key, p in module.named_parameters() if p.grad is not None}
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(time.perf_counter() - start)
            losses.append(loss.item())
        whole = {  # parameters are DTensors; buffers (running statistics) are whole on every rank
            key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for key, value in module.state_dict().items()
        }
        return losses, whole, seconds, _peak_mb(), first

    return run_workers(devices, work, timeout_s=1800)


def _difference(got: Any, want: Any, mask: Any) -> float:
    """The relative difference in norm of ``got`` from ``want`` over the elements ``mask`` selects."""
    if isinstance(mask, bool):
        mask = torch.full_like(want, mask, dtype=torch.bool)
    if not mask.any():
        return 0.0
    got, want = got.double(), want.double()  # (a step count is an integer)
    return ((got - want)[mask].norm() / want[mask].norm().clamp(min=1e-30)).item()


def _plans(model: str, devices: int, kinds: list[str], folder: Path) -> dict[str, autopar.Plan]:
    plans: dict[str, autopar.Plan] = {}
    searched = autopar.plan(model, devices=devices, optimizer="adam")
    if "searched" in kinds:
        plans["searched"] = searched
    if "sharded" in kinds:
        need = searched.file.totals.memory_per_device_bytes
        for fraction in (0.5, 0.7, 0.9):
            profile = HardwareProfile.model_validate(simple_profile_dict(need * fraction))
            try:
                plans["sharded"] = autopar.plan(model, devices=devices, cost_model=profile, optimizer="adam")
                break
            except autopar.AutoparError:
                continue
    return plans


def measure(name: str, kinds: list[str], steps: int, devices: int) -> None:
    family = family_named(name)
    batches = [family.batch(BATCH, seed) for seed in range(steps)]
    with tempfile.TemporaryDirectory() as folder:
        model = str(Path(folder) / f"{name}.onnx")
        try:
            export(family.build(2), batches[0], model, family.optimize)
            plans = _plans(model, devices, kinds, Path(folder))
        except Exception as exc:  # a family the exporter or the planner refuses: say so and go on
            print(f"{name:9s} refused: {str(exc).splitlines()[0][:150]}", flush=True)
            return
        whole_batch = None if name in WITH_DROPOUT else _one_process(name, batches)
        for kind, plan in plans.items():
            pipeline = plan.file.pipeline
            micro_batches = pipeline.micro_batches if pipeline is not None else plan.file.memory_plan.micro_batches
            # (where the family drops, one process draws the ranks' masks over the same micro-batches)
            one = whole_batch or _one_process(name, batches, micro_batches)
            losses, state, seconds, peak, roundoff, gradients = one
            single = BATCH / (sum(seconds[1:]) / max(len(seconds) - 1, 1))
            path = str(Path(folder) / f"{kind}.json")
            Path(path).write_text(plan.file.model_dump_json(by_alias=True))
            try:
                results = _ranks(name, path, model, batches, devices)
            except autopar.AutoparError as exc:
                print(f"{name:9s} {kind:9s} refused: {str(exc).splitlines()[0][:150]}", flush=True)
                continue
            whole: dict[str, Any] = {}
            held: dict[str, Any] = {}
            for result in results:
                whole.update(result[1])
                held.update(result[4])
            gradient_error = max(
                _difference(held[key], value, ~roundoff[key] if key in roundoff else True)
                for key, value in gradients.items()
            )
            loss_error = max(abs(a - b) / abs(b) for result in results for a, b in zip(result[0], losses))
            parameter_error = max(
                _difference(whole[key], value, ~roundoff[key] if key in roundoff else True)
                for key, value in state.items()
            )
            noise = {key: _difference(whole[key], state[key], mask) for key, mask in roundoff.items() if mask.any()}
            step = max(sum(result[2][1:]) / max(len(result[2]) - 1, 1) for result in results)
            rank_peak = max(result[3] for result in results)
            print(
                f"{name:9s} {kind:9s} {plan.degrees!s:34s} loss {loss_error:8.1e}  grads {gradient_error:8.1e}"
                f"  params {parameter_error:8.1e}"
                f"  samples/s 1 process {single:7.1f}, {devices} ranks {BATCH / step:7.1f}"
                f"  peak MB {peak:6.0f} / {rank_peak:6.0f}"
                f"  step predicted {plan.objective * 1e3:8.3f} ms ({plan.file.cost_model}),"
                f" measured {step * 1e3:8.1f} ms",
                flush=True,
            )
            for key, error in noise.items():
                print(f"{'':19s} {int(roundoff[key].sum())} elements of {key} have no gradient: {error:8.1e}")


def gpu_step() -> None:
    """One GPU, one process: a Llama's step measured against its one-device plan on the h100 profile."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    import transformers

    from autopar.torch import parallelize
    from tests.hf_families import VOCAB, WithLoss

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=300))
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=4096,
        vocab_size=VOCAB * 64,
        max_position_embeddings=512,
    )
    config._attn_implementation = "eager"
    module = WithLoss(transformers.LlamaForCausalLM(config), "input_ids", use_cache=False)
    ids = torch.randint(0, config.vocab_size, (4, 512))
    with tempfile.TemporaryDirectory() as folder:
        model = str(Path(folder) / "llama.onnx")
        export(module, (ids, ids), model)
        plan = autopar.plan(model, devices=1, cost_model="h100", precision="fp32", optimizer="adam")
        module = parallelize(module.cuda(), plan, model, (ids, ids))
        optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
        batch = (ids.cuda(), ids.cuda())
        times = []
        for step in range(8):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            module.train_step(*batch)
            optimizer.step()
            optimizer.zero_grad()
            end.record()
            torch.cuda.synchronize()
            if step >= 3:
                times.append(start.elapsed_time(end))
        measured = sum(times) / len(times)
        print(
            f"llama 4x1024 on one GPU: step measured {measured:.1f} ms, predicted {plan.objective * 1e3:.1f} ms (h100)"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--plans", default="searched,sharded")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--gpu", action="store_true", help="measure one GPU's step against the prediction")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.gpu:
        gpu_step()
        return
    for name in args.families.split(","):
        if name not in FAMILIES and name not in WITH_DROPOUT:
            raise SystemExit(f"unknown family {name!r}: choose from {', '.join([*FAMILIES, *WITH_DROPOUT])}")
        measure(name, args.plans.split(","), args.steps, args.devices)


if __name__ == "__main__":
    main()
