"""Training a Hugging Face model nobody here wrote with its plan (`autopar.torch`), on torch.distributed processes.

Each case trains the module from `tests.hf_families` both ways, one process with torch's own AdamW and the
plan's ranks (gloo, forked by `autopar.runtime.launch.run_workers`) with the same AdamW, and compares: the loss
at every step (relative 1e-5), the first step's gradients (relative 1e-4 in norm: AdamW's steps would hide one
off by a constant factor), the final parameters (relative, in norm: Adam divides by the root of a running
square, so a last-digit difference in a gradient near zero moves a weight by up to the learning rate, which
elementwise comparison would call a mismatch), every parameter's local storage against the plan's layout, and
the collectives of every step against the plan's (`train_step` checks them and raises otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

import torch.distributed as dist  # noqa: E402

import autopar  # noqa: E402
from autopar.cost import HardwareProfile  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402
from autopar.graph import load_model  # noqa: E402
from autopar.lowering import load_plan_file  # noqa: E402
from autopar.runtime.launch import RuntimeFailure, run_workers  # noqa: E402
from tests.conftest import simple_profile_dict  # noqa: E402
from tests.hf_families import FAMILIES, WITH_DROPOUT, export, family_named  # noqa: E402

LEARNING_RATE = 1e-3
STEPS = 3


def _profile(capacity: float) -> HardwareProfile:
    return HardwareProfile.model_validate(simple_profile_dict(capacity))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The Llama family's export at batch 8 and at batch 16, with the plans the cases train."""
    folder = tmp_path_factory.mktemp("llama")
    family = FAMILIES["llama"]
    found: dict[str, Any] = {"folder": folder}
    for batch in (8, 16):
        path = folder / f"llama{batch}.onnx"
        export(family.build(2), family.batch(batch, 0), str(path), family.optimize)
        found[f"model{batch}"] = str(path)

    def keep(name: str, plan: autopar.Plan) -> None:
        target = folder / f"{name}.json"
        target.write_text(json.dumps(plan.to_dict()))
        found[name] = str(target)

    keep("searched", autopar.plan(found["model8"], devices=8, optimizer="adam"))
    keep("sharded", autopar.plan(found["model8"], devices=8, cost_model=_profile(3e5), optimizer="adam"))
    keep(
        "pipelined",
        autopar.plan(
            found["model16"], devices=8, cost_model=_profile(3e5), optimizer="adam", pipeline_stages=2, micro_batches=4
        ),
    )
    keep("data4", autopar.plan(found["model8"], devices=4, mode="data_parallel", optimizer="adam"))
    keep("one", autopar.plan(found["model8"], devices=1, optimizer="adam"))
    return found


@dataclass(frozen=True)
class _Trained:
    """A run of AdamW steps: the loss at every step, the final state (whole) and the first step's gradients (whole:
    AdamW's steps hardly change when a gradient is off by a constant factor, so they are compared themselves)."""

    losses: list[float]
    state: dict[str, Any]
    gradients: dict[str, Any]


def _reference(name: str, batches: list[tuple[Any, ...]], micro_batches: int = 1, seed: int | None = None) -> _Trained:
    """One process: a step per batch, over ``micro_batches`` (gradient accumulation); with a ``seed``, dropout
    drawing the masks the ranks draw (`MasksAsPlanned`)."""
    from autopar.torch.dropout import MasksAsPlanned

    module = family_named(name).build(2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
    losses: list[float] = []
    gradients: dict[str, Any] = {}
    with MasksAsPlanned(seed).drawing() if seed is not None else contextlib.nullcontext():
        for batch in batches:
            loss = 0.0
            for part in zip(*(value.chunk(micro_batches) for value in batch)):
                micro = module(*part) / micro_batches
                micro.backward()
                loss += micro.item()
            if not losses:
                gradients = {k: value.grad.clone() for k, value in module.named_parameters() if value.grad is not None}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss)
    return _Trained(losses, {key: value.detach().clone() for key, value in module.state_dict().items()}, gradients)


def _train(name: str, plan: str, model: str, batches: list[tuple[Any, ...]], seed: int | None = None) -> Any:
    """What each rank runs: parallelize (dropout's masks drawn from ``seed``), then AdamW steps; its run (the
    gradients and state it holds, whole) and its parameters' local storage."""

    def work(rank: int, world: int, device: Any) -> Any:
        from torch.distributed.tensor import DTensor

        from autopar.torch import parallelize

        module = parallelize(family_named(name).build(2), plan, model, batches[0], seed=seed)
        optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
        losses: list[float] = []
        gradients: dict[str, Any] = {}
        for batch in batches:
            losses.append(module.train_step(*batch).item())
            if not gradients:  # (one order on every rank: each gathers its stage's)
                gradients = {key: p.grad.full_tensor() for key, p in module.named_parameters() if p.grad is not None}
            optimizer.step()
            optimizer.zero_grad()
        trainer = module.autopar
        storage = {}
        for key, parameter in module.named_parameters():
            assert isinstance(parameter, DTensor), key
            layout = trainer.stored.get(key)
            if layout is not None:
                storage[key] = (tuple(parameter.to_local().shape), layout.local_shape(tuple(parameter.shape)))
        whole = {  # parameters are DTensors; buffers (running statistics) are whole on every rank
            key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for key, value in module.state_dict().items()
        }
        return _Trained(losses, whole, gradients), storage

    return work


def _check(name: str, results: list[Any], reference: _Trained) -> None:
    whole: dict[str, Any] = {}
    gradients: dict[str, Any] = {}
    for trained, storage in results:
        assert max(abs(a - b) / abs(b) for a, b in zip(trained.losses, reference.losses)) <= 1e-5
        for key, (held, planned) in storage.items():
            assert held == planned, f"{key}: the rank stores {held}, the plan says {planned}"
        whole.update(trained.state)
        gradients.update(trained.gradients)
    assert set(whole) == set(reference.state)
    for key, value in reference.state.items():
        got, want = whole[key].double(), value.double()  # (a BatchNorm's step count is an integer)
        error = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
        assert error <= 1e-4, f"{key}: relative error {error:.2e}"
    _gradients_close(gradients, reference.gradients)


@pytest.mark.parametrize("plan", ["searched", "sharded"])
def test_trains_as_one_process(llama: dict[str, Any], plan: str) -> None:
    batches = [FAMILIES["llama"].batch(8, seed) for seed in range(STEPS)]
    results = run_workers(8, _train("llama", llama[plan], llama["model8"], batches), timeout_s=240)
    _check("llama", results, _reference("llama", batches))
    if plan == "sharded":  # the plan shards weights: tensor parallel and the parallel optimizer
        file = load_plan_file(llama[plan])
        assert file.memory_plan.parallel_optimizer
        assert any(len(bits) for op in file.ops if op.op_type == "MatMul" for bits in op.inputs[1].layout.dims)


@pytest.mark.parametrize(
    "name", ["bert", "moe", "resnet", "gemma3", "phi3", "roberta", "falcon", "gpt2", "deepseek_v3", "mamba2"]
)
def test_other_families_train_as_one_process(name: str, tmp_path: Path) -> None:
    """BERT: a weight the exporter folded from parameters (the token type embedding at constant indices), lookups
    in split tables; OLMoE: eight experts run as batched_mm, a value the exporter computed once for two nodes;
    ResNet: BatchNorms in training (batch statistics whole, channels split; running statistics written back, as
    the one process writes them); Gemma 3 and RoBERTa: ``type_as`` (its second argument read for its type alone),
    Gemma's output matrix its embedding (tied), RoBERTa's positions plus a zero the exporter folds away; Phi-3: an
    empty slice the exporter drops; Falcon:
    lookups by a list of positions whose values the file holds only transposed; GPT-2: two reshapes written as
    one, and (its plan pipelined) a position table folded into the weights the first stage alone reads;
    DeepSeek-V3: key states scattered into a buffer in another order, a sum plus 1e-20 the exporter folds away, a
    routing mask scattered from a table of ones; Mamba2: a state-space scan in chunks. Each on a plan with half the
    memory the searched plan needs (it shards weights)."""
    family = FAMILIES[name]
    batches = [family.batch(8, seed) for seed in range(2)]
    model = str(tmp_path / f"{name}.onnx")
    export(family.build(2), batches[0], model, family.optimize)
    need = autopar.plan(model, devices=8, optimizer="adam").file.totals.memory_per_device_bytes
    # (DeepSeek-V3's would accumulate 4 micro-batches, replicated: one micro-batch, so that it shards)
    whole = {"micro_batches": 1} if name == "deepseek_v3" else {}
    plan = autopar.plan(model, devices=8, cost_model=_profile(need * 0.5), optimizer="adam", **whole)
    assert plan.degrees.data * plan.degrees.tensor * plan.degrees.sequence > 1 or plan.file.pipeline is not None
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    results = run_workers(8, _train(name, str(path), model, batches), timeout_s=240)
    _check(name, results, _reference(name, batches))


def test_deepseek_v3_trains_pipelined_over_micro_batches(tmp_path: Path) -> None:
    """DeepSeek-V3's export at a micro-batch's size: its key-state buffer and routing tables filled at the
    batch and its tokens, the router's scores reshaped per token and back (it refused every micro-batch count
    but one: 'Incompatible dimensions'). 2 stages over 4 micro-batches on 8 ranks, as one process accumulates."""
    family = FAMILIES["deepseek_v3"]
    batches = [family.batch(8, seed) for seed in range(2)]
    model = str(tmp_path / "deepseek_v3.onnx")
    export(family.build(2), batches[0], model, family.optimize)
    plan = autopar.plan(model, devices=8, optimizer="adam", pipeline_stages=2, micro_batches=4)
    assert plan.file.pipeline is not None and plan.file.pipeline.micro_batches == 4
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    results = run_workers(8, _train("deepseek_v3", str(path), model, batches), timeout_s=240)
    _check("deepseek_v3", results, _reference("deepseek_v3", batches, micro_batches=4))


@pytest.mark.parametrize(
    ("capacity", "stages", "seed", "degrees"),
    [(0.5, 1, 11, (2, 1, 1)), (0.3, 1, None, (2, 4, 1)), (None, 2, 11, (4, 1, 2))],
    ids=["replicated", "heads split", "two stages"],
)
def test_dropout_drops_each_element_alike_on_every_rank_as_one_process_draws_it(
    capacity: float | None, stages: int, seed: int | None, degrees: tuple[int, int, int], tmp_path: Path
) -> None:
    """BERT at Hugging Face's default dropout (0.1), over 2 micro-batches, on a plan that repeats its work over 4
    devices (data 2: replicas that torch's per-process generator would drop apart), on one that splits its
    attention heads 4 ways (each with a fraction of the memory the searched plan needs) and on two pipeline
    stages (the Ascend 910's): every rank draws each element's mask from where the element is in the whole tensor
    (`autopar.torch.dropout`), so the ranks' steps are those of one process whose dropout draws the same masks,
    over the same micro-batches. The seed is the one given, or rank 0's ``torch.initial_seed()`` (0: the family
    seeds torch before it builds the module)."""
    name = "bert_dropout"
    family = WITH_DROPOUT[name]
    batches = [family.batch(8, seed) for seed in range(2)]
    model = str(tmp_path / f"{name}.onnx")
    export(family.build(2), batches[0], model, family.optimize)
    need = autopar.plan(model, devices=8, optimizer="adam").file.totals.memory_per_device_bytes
    cost = _profile(need * capacity) if capacity is not None else "ascend910"
    plan = autopar.plan(model, devices=8, cost_model=cost, optimizer="adam", pipeline_stages=stages, micro_batches=2)
    assert (plan.degrees.data, plan.degrees.tensor, plan.degrees.pipeline) == degrees, plan.degrees
    dropouts = [op for op in plan.file.ops if op.op_type == "Dropout"]
    assert len(dropouts) == 8  # embeddings, 2 x (attention probabilities, 2 residuals), classifier
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    results = run_workers(8, _train(name, str(path), model, batches, seed=seed), timeout_s=240)
    _check(name, results, _reference(name, batches, micro_batches=2, seed=0 if seed is None else seed))
    undropped = _reference("bert", batches, micro_batches=2)  # the same module at dropout 0: it does drop
    assert min(abs(a - b) for a, b in zip(undropped.losses, results[0][0].losses)) > 1e-4


def test_a_pipelined_step_gives_one_process_gradients_folded_weights_too(tmp_path: Path) -> None:
    """The gradients themselves, not AdamW's steps (which a gradient off by a constant factor leaves nearly as
    they are): BERT on two stages over two micro-batches, its token type embedding folded into a weight the
    first stage reads (its gradient was summed over the micro-batches, not averaged)."""
    family = FAMILIES["bert"]
    batch = family.batch(8, 0)
    model, plan = str(tmp_path / "bert.onnx"), tmp_path / "plan.json"
    export(family.build(2), batch, model)
    plan.write_text(json.dumps(autopar.plan(model, devices=8, pipeline_stages=2, micro_batches=2).to_dict()))
    held = _one_step_gradients("bert", str(plan), model, batch)
    assert "model.bert.embeddings.token_type_embeddings.weight" in held
    _gradients_match("bert", held, batch)


def test_a_tied_embedding_trains_as_one_parameter_read_in_two_layouts(tmp_path: Path) -> None:
    """Gemma 3 as Hugging Face builds it: its output matrix is its token embedding, which the exporter stores
    twice (the second transposed) and the import reads as one weight (`autopar.graph.tied`). Here the lookup
    stores it split by its features and the output product reads it split by the vocabulary: the plan moves it
    between the two, and the gradient back. One step's gradients against one process's (the two reads' sum),
    and the module keeps its tie: one parameter under both names."""
    family = FAMILIES["gemma3"]
    batch = family.batch(8, 0)
    model, plan = str(tmp_path / "gemma3.onnx"), tmp_path / "plan.json"
    export(family.build(2), batch, model)
    graph = load_model(model)
    head = next(op for op in graph.ops if op.op_type == "Transpose" and graph.tensor(op.inputs[0]).kind == "parameter")
    lookup = next(op for op in graph.ops if op.op_type == "Gather" and op.inputs[0] == head.inputs[0])
    fixed = {lookup.name: ((1, 8), (1, 1)), head.name: ((8, 1),)}
    planned = autopar.plan(model, devices=8, fixed=fixed)
    assert any(entry.tensor == head.inputs[0] and entry.steps for entry in planned.file.redistributions)
    plan.write_text(json.dumps(planned.to_dict()))

    def tied(module: torch.nn.Module) -> bool:
        return module.get_parameter("model.lm_head.weight") is module.get_parameter("model.model.embed_tokens.weight")

    assert tied(family.build(2))
    held = _one_step_gradients("gemma3", str(plan), model, batch, tied)
    _gradients_match("gemma3", held, batch)


class _ShiftedRight(torch.nn.Module):
    """T5's labels shifted right: the start token filled in for the whole batch (``select_scatter`` of a ``fill`` the
    module computes whole and the exporter stores, batch-sized), the rest the labels moved one place, looked up and
    scored."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(32, 16)
        self.out = torch.nn.Linear(16, 32)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        shifted = labels.new_zeros(labels.shape)
        shifted[..., 1:] = labels[..., :-1].clone()
        shifted[..., 0] = 3
        return torch.nn.functional.cross_entropy(self.out(self.table(shifted)).flatten(0, 1), labels.flatten())


def test_a_value_the_module_fills_in_for_the_whole_batch_is_split_as_planned(tmp_path: Path) -> None:
    """Data parallel over 8 ranks: each rank's rows get the start token from its rows of the stored constant (the
    node runs as its operators), where the call put the whole batch's into one rank's rows and failed."""
    torch.manual_seed(0)
    module, model, plan = _ShiftedRight(), str(tmp_path / "model.onnx"), tmp_path / "plan.json"
    batch = (torch.randint(0, 32, (8, 6)),)
    export(module, batch, model)
    plan.write_text(json.dumps(autopar.plan(model, devices=8, mode="data_parallel").to_dict()))

    def work(rank: int, world: int, device: Any) -> dict[str, torch.Tensor]:
        from autopar.torch import parallelize

        torch.manual_seed(0)
        parallel = parallelize(_ShiftedRight(), str(plan), model, batch)
        parallel.train_step(*batch)
        return {key: value.grad.full_tensor() for key, value in parallel.named_parameters()}

    held: dict[str, torch.Tensor] = {}
    for grads in run_workers(8, work, timeout_s=240):
        held.update(grads)
    module(*batch).backward()  # (after the ranks: a backward's threads are not forked into them)
    _gradients_close(held, {key: value.grad for key, value in module.named_parameters()})


def _one_step_gradients(
    name: str, plan: str, model: str, batch: tuple[Any, ...], check: Any = None
) -> dict[str, torch.Tensor]:
    """Each parameter's whole gradient after one `train_step` on 8 ranks (``check``: what each rank's module must
    satisfy after it)."""

    def work(rank: int, world: int, device: Any) -> dict[str, torch.Tensor]:
        from autopar.torch import parallelize

        module = parallelize(FAMILIES[name].build(2), plan, model, batch)
        module.train_step(*batch)
        assert check is None or check(module)
        return {key: value.grad.full_tensor() for key, value in module.named_parameters() if value.grad is not None}

    held: dict[str, torch.Tensor] = {}
    for grads in run_workers(8, work, timeout_s=240):
        held.update(grads)
    return held


def _gradients_match(name: str, held: dict[str, torch.Tensor], batch: tuple[Any, ...]) -> None:
    """``held`` are one process's gradients of the batch's loss (`_gradients_close`)."""
    reference = FAMILIES[name].build(2)
    reference(*batch).backward()
    _gradients_close(held, {key: value.grad for key, value in reference.named_parameters() if value.grad is not None})


def _gradients_close(held: dict[str, Any], wanted: dict[str, Any]) -> None:
    """Each gradient held is the one wanted within 1e-4 in norm, over the elements that have one (an attention
    key's bias has no gradient but roundoff, about 1e-9 of the others')."""
    assert set(held) == set(wanted)
    largest = max(float(want.abs().max()) for want in wanted.values())
    for key, want in wanted.items():
        kept = want.abs() > 1e-6 * largest
        got, want = held[key].double()[kept], want.double()[kept]
        error = ((got - want).norm() / want.norm()).item() if kept.any() else 0.0
        assert error <= 1e-4, f"{key}: the gradient's relative error is {error:.2e}"


def test_pipelined_plan_trains_as_one_process(llama: dict[str, Any]) -> None:
    file = load_plan_file(llama["pipelined"])
    assert file.pipeline is not None and len(file.pipeline.stages) == 2 and file.pipeline.micro_batches == 4
    # each stage splits its batch 4 ways (its loss too, the labels read whole: `autopar.ops.loss`)
    degrees = autopar.plan(llama["model16"], devices=8, cost_model=_profile(3e5), optimizer="adam",
                           pipeline_stages=2, micro_batches=4).degrees  # fmt: skip
    assert degrees.pipeline == 2 and degrees.data == 4
    batches = [FAMILIES["llama"].batch(16, seed) for seed in range(STEPS)]
    results = run_workers(8, _train("llama", llama["pipelined"], llama["model16"], batches), timeout_s=240)
    _check("llama", results, _reference("llama", batches))


def test_checkpoint_loads_under_another_plan_and_unsharded(llama: dict[str, Any], tmp_path: Path) -> None:
    """Saved under the sharded plan on 8 ranks after two steps, resumed under data parallel on 4: the losses are
    those of not stopping; and the plain module reads the same checkpoint in one process."""
    from autopar.torch import load_unsharded

    family = FAMILIES["llama"]
    batches = [family.batch(8, seed) for seed in range(4)]
    folder = str(tmp_path / "checkpoint")

    def first(rank: int, world: int, device: Any) -> list[float]:
        from autopar.torch import parallelize, save

        module = parallelize(family.build(2), llama["sharded"], llama["model8"], batches[0])
        optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
        losses = []
        for batch in batches[:2]:
            losses.append(module.train_step(*batch).item())
            optimizer.step()
            optimizer.zero_grad()
        save(module, optimizer, folder)
        return losses

    def second(rank: int, world: int, device: Any) -> list[float]:
        from autopar.torch import load, parallelize

        module = parallelize(family.build(2), llama["data4"], llama["model8"], batches[0])
        optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
        load(module, optimizer, folder)
        losses = []
        for batch in batches[2:]:
            losses.append(module.train_step(*batch).item())
            optimizer.step()
            optimizer.zero_grad()
        return losses

    expected = _reference("llama", batches).losses
    resumed = run_workers(8, first, timeout_s=240)[0] + run_workers(4, second, timeout_s=240)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, expected)) <= 1e-5
    plain = family.build(2)
    load_unsharded(plain, folder)
    assert abs(plain(*batches[2]).item() - expected[2]) <= 1e-5 * abs(expected[2])


def test_a_run_that_drops_resumes_drawing_the_masks_of_not_stopping(tmp_path: Path) -> None:
    """BERT at Hugging Face's default dropout, saved after two steps on 8 ranks (data 2, replicated 4) and resumed
    on 4 under data parallel, both over 2 micro-batches: the checkpoint keeps dropout's seed and the passes drawn,
    so the resumed steps draw the masks of not stopping (the second job is given no seed of its own)."""
    from autopar.torch import load_unsharded

    name = "bert_dropout"
    family = WITH_DROPOUT[name]
    batches = [family.batch(8, seed) for seed in range(4)]
    model, folder = str(tmp_path / f"{name}.onnx"), str(tmp_path / "checkpoint")
    export(family.build(2), batches[0], model, family.optimize)
    need = autopar.plan(model, devices=8, optimizer="adam").file.totals.memory_per_device_bytes
    plans = {}
    for devices, options in ((8, {"cost_model": _profile(need * 0.5)}), (4, {"mode": "data_parallel"})):
        plan = autopar.plan(model, devices=devices, optimizer="adam", pipeline_stages=1, micro_batches=2, **options)
        plans[devices] = str(tmp_path / f"plan{devices}.json")
        Path(plans[devices]).write_text(json.dumps(plan.to_dict()))

    def steps(devices: int, seed: int | None, taken: list[Any], saves: bool) -> Any:
        def work(rank: int, world: int, device: Any) -> list[float]:
            from autopar.torch import load, parallelize, save

            module = parallelize(family.build(2), plans[devices], model, batches[0], seed=seed)
            optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
            if not saves:
                load(module, optimizer, folder)
            losses = []
            for batch in taken:
                losses.append(module.train_step(*batch).item())
                optimizer.step()
                optimizer.zero_grad()
            if saves:
                save(module, optimizer, folder)
            return losses

        return work

    first = run_workers(8, steps(8, 11, batches[:2], saves=True), timeout_s=240)[0]
    resumed = first + run_workers(4, steps(4, None, batches[2:], saves=False), timeout_s=240)[0]
    expected = _reference(name, batches, micro_batches=2, seed=11).losses
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, expected)) <= 1e-5
    plain, fresh = family.build(2), family.build(2)
    load_unsharded(plain, folder)  # the plain module reads its weights, the dropout state aside
    assert not torch.equal(plain.model.classifier.weight, fresh.model.classifier.weight)  # (two steps' worth)


@pytest.fixture
def one_process() -> Any:
    """A torch.distributed job of this one process (for one-device plans)."""
    from autopar.runtime.launch import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    yield
    dist.destroy_process_group()


def test_one_device_plan_trains_in_this_process(llama: dict[str, Any], one_process: Any) -> None:
    from autopar.torch import parallelize

    batches = [FAMILIES["llama"].batch(8, seed) for seed in range(2)]
    module = parallelize(FAMILIES["llama"].build(2), llama["one"], llama["model8"], batches[0])
    assert isinstance(module, type(FAMILIES["llama"].build(1)))  # the user's class, still
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
    losses = []
    for batch in batches:
        loss = module(*batch)  # the user's own loop: forward, backward, step
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    expected = _reference("llama", batches).losses
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, expected)) <= 1e-5
    # a weight the exporter stored transposed (linear's val_N) is traced back to its parameter
    uses = module.autopar.mapping.parameters
    assert any(use.parameter.endswith("q_proj.weight") and use.permutation == (1, 0) for use in uses.values())


class _Folded(torch.nn.Module):
    """What Whisper's and BART's decoders compute on the way in, which the exporter's optimiser folds away: labels
    shifted right (``new_zeros``, a slice copied in, the first column filled), scores times a scale of 1 and a
    position plus a zero."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(32, 16)
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = 3
        hidden = self.linear(self.embedding(ids) + self.embedding(shifted)) * 1.0
        return (hidden + torch.scalar_tensor(0.0)).square().mean()


class _ListIndexed(torch.nn.Module):
    """Falcon's multi-query split: lookups by a list of positions (``x[..., [-2], :]``), which the exporter writes
    as one Transpose the two GatherNDs share, each node's operators reading its fork."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        fused = self.linear(x).view(8, 4, 3, 16)
        query, key, value = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        return ((query * key + value).sum(2) - y).square().mean()


class _MergedTranspose(_ListIndexed):
    """Falcon's lookups read through ``transpose(1, 2)``: the exporter merges the Transpose that ends each lookup's
    operators into its reader's, so the file holds the lookup's value only in another order."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        fused = self.linear(x).view(8, 4, 3, 16)
        query, key, value = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        scores = query.transpose(1, 2) * key.transpose(1, 2) + value.transpose(1, 2)
        return (scores.sum(1) - y).square().mean()


class _ReshapedTwice(torch.nn.Module):
    """GPT-2's heads joined (a reshape), then flattened for its Conv1D's ``addmm`` (a view): the exporter writes the
    two reshapes as one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.weight = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        heads = self.linear(x).view(8, 4, 4, 4).transpose(1, 2) * 2.0
        joined = heads.transpose(1, 2).reshape(8, 4, 16)
        return ((joined.view(-1, 16) @ self.weight).view(8, 4, 16) - y).square().mean()


class _SubtractedTwice(torch.nn.Module):
    """Cohere's norm writes ``h - mean`` twice; the exporter computes it once."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        return ((h - mean) * torch.rsqrt(variance + 1e-5) - y).square().mean()


class _BatchedThroughReshapes(torch.nn.Module):
    """BLOOM's attention: heads folded into the batch for each bmm and back (``reshape``, ``bmm``, ``view``), which
    the exporter's optimiser writes as one 4-D MatMul recorded under the last view: the reshapes and the bmm have
    no operators of their own, and the view's operators read what they read."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        fused = self.linear(x).view(8, 4, 3, 2, 8)
        query, key, value = (fused[:, :, part].transpose(1, 2).reshape(16, 4, 8) for part in range(3))
        probabilities = torch.softmax(torch.bmm(query, key.transpose(1, 2)), -1).view(8, 2, 4, 4)
        out = torch.bmm(probabilities.view(16, 4, 4), value).view(8, 2, 4, 8)
        return (out.transpose(1, 2).reshape(8, 4, 16) - y).square().mean()


class _ScatteredIntoBuffers(torch.nn.Module):
    """DeepSeek-V3's latent attention and router: key states written into ``new_empty`` by two slice assignments
    (the exporter scatters into a transposed copy and transposes back only after the second), routing weights over
    their sum plus 1e-20 (which the exporter's optimiser folds away), a routing mask scattered into ``zeros_like``
    with a value of 1 (a table of ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        keys = x.new_empty(8, 4, 24)
        keys[..., :16].copy_(self.linear(x))
        keys[..., 16:].copy_(x[..., :8])
        weights = torch.sigmoid(keys.sum(-1))
        top, index = weights.topk(2, dim=-1)
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
        routed = torch.zeros_like(weights).scatter(1, index, 1)
        return (keys[..., :16] * (routed * weights).unsqueeze(-1) - y).square().mean() + top.mean()


class _ScatteredIntoSquareBuffers(torch.nn.Module):
    """`_ScatteredIntoBuffers`' key states where the transposed copy has the value's shape: the buffer's last
    dimension, which the exporter brings first to scatter along it, has the batch's size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = x.new_empty(8, 4, 8)
        keys[..., :4].copy_(x[..., :4])
        keys[..., 4:].copy_(x[..., 4:8] * 2)
        return keys.square().mean()


def test_a_value_scattered_in_another_order_is_paired_so_whatever_its_sizes(tmp_path: Path) -> None:
    """The exporter scatters the key states into a transposed copy of the buffer (dimensions 0 and 2 swapped), both
    of size 8: the shapes alike, the node's value is its plan tensor permuted all the same (a plan that split the
    tensor's first dimension would split the value's last)."""
    from autopar.graph import read_model
    from autopar.lowering import program_from_file
    from autopar.lowering.program import plan_graph
    from autopar.options import PlanOptions
    from autopar.torch.capture import exported_program
    from autopar.torch.mapping import NodeUnit, map_module

    module, batch, model = _ScatteredIntoSquareBuffers(), (torch.randn(8, 4, 16),), str(tmp_path / "model.onnx")
    export(module, batch, model)
    file = autopar.plan(model, devices=1).file
    program = program_from_file(plan_graph(file, read_model(model)), file, 1, PlanOptions(1).costs())
    units = {unit.node: unit for unit in map_module(program, exported_program(module, batch)).units}
    first = units["slice_scatter"]
    assert isinstance(first, NodeUnit) and first.permutation == (2, 1, 0)


@pytest.mark.parametrize(
    "kind",
    [
        _Folded,
        _ListIndexed,
        _MergedTranspose,
        _ReshapedTwice,
        _SubtractedTwice,
        _BatchedThroughReshapes,
        _ScatteredIntoBuffers,
    ],
)
def test_nodes_the_exporter_folds_or_shares_are_paired(kind: type, tmp_path: Path, one_process: Any) -> None:
    from autopar.torch import parallelize

    torch.manual_seed(0)
    shapes = [(8, 6), (8, 6)] if kind is _Folded else [(8, 4, 16), (8, 4, 16)]
    batch = tuple(torch.randint(0, 32, shape) if kind is _Folded else torch.randn(shape) for shape in shapes)
    module, model = kind(), str(tmp_path / "model.onnx")
    export(module, batch, model)
    expected = module(*batch)
    expected.backward()
    wanted = {key: value.grad.clone() for key, value in module.named_parameters()}
    module.zero_grad()
    parallel = parallelize(module, autopar.plan(model, devices=1), model, batch)
    loss = parallel(*batch)
    assert torch.allclose(loss, expected, rtol=1e-6)
    loss.backward()
    for key, value in parallel.named_parameters():
        assert torch.allclose(value.grad.full_tensor(), wanted[key], rtol=1e-5, atol=1e-7), key


# --- bad input: one sentence, nothing runs ---------------------------------------------------------------


class _Dropping(torch.nn.Module):
    """A product, a dropout and a product: the smallest module that drops."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.second(self.dropout(self.first(x))) - y).square().mean()


def test_a_module_that_drops_draws_only_in_training(tmp_path: Path, one_process: Any) -> None:
    """In ``eval()`` mode it drops nothing and counts no pass; back in training, its next pass draws the masks one
    process draws for the first (`MasksAsPlanned`)."""
    from autopar.torch import parallelize
    from autopar.torch.dropout import MasksAsPlanned

    torch.manual_seed(0)
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    module, model = _Dropping(), str(tmp_path / "model.onnx")
    export(module, batch, model)
    plain = _Dropping()
    plain.load_state_dict(module.state_dict())
    parallel = parallelize(module, autopar.plan(model, devices=1), model, batch, seed=3)
    parallel.eval()
    plain.eval()
    assert torch.allclose(parallel(*batch), plain(*batch), rtol=1e-6)
    assert parallel.autopar.passes == 0
    parallel.train()
    plain.train()
    with MasksAsPlanned(3).drawing():
        expected = plain(*batch)
    assert torch.allclose(parallel(*batch), expected, rtol=1e-6)
    assert parallel.autopar.passes == 1


def test_a_module_parallelized_in_eval_mode_is_refused_training(tmp_path: Path, one_process: Any) -> None:
    from autopar.torch import TrainingError, parallelize

    torch.manual_seed(0)
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    module, model = _Dropping().eval(), str(tmp_path / "model.onnx")
    export(module, batch, model)
    parallel = parallelize(module, autopar.plan(model, devices=1), model, batch)
    parallel(*batch)  # evaluating is what it was captured for
    parallel.train()
    with pytest.raises(TrainingError, match=re.escape("call module.train() before parallelize")):
        parallel(*batch)


def test_a_module_that_normalises_by_its_batch_is_refused_evaluation(tmp_path: Path, one_process: Any) -> None:
    """Captured in training, its BatchNorm normalises with the batch's statistics: in eval() mode the module would
    use its running ones, so evaluating the parallelized module is one sentence, not another computation."""
    from autopar.torch import TrainingError, parallelize

    torch.manual_seed(0)
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    model = str(tmp_path / "model.onnx")
    wrapped = _Normalised(module)
    export(wrapped, batch, model, optimize=False)
    parallel = parallelize(wrapped, autopar.plan(model, devices=1), model, batch)
    parallel(*batch)  # training: batch statistics, as captured
    parallel.eval()
    with pytest.raises(TrainingError, match="normalises with its batch's statistics"):
        parallel(*batch)


class _Normalised(torch.nn.Module):
    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.body(x) - y).square().mean()


class _Activated(torch.nn.Module):
    """Two products; `_ActivatedMore` computes one more activation between them than the plan has."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.second(torch.relu(self.first(x))) - y).square().mean()


class _ActivatedMore(_Activated):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.second(torch.tanh(torch.relu(self.first(x))) * 3.0) - y).square().mean()


def test_a_module_with_an_operation_the_plan_lacks_is_refused(tmp_path: Path, one_process: Any) -> None:
    """Nodes without operators merge into their readers' only where the exporter merges them (reshapes, copies,
    a batched product): an activation more is another module."""
    from autopar.torch import parallelize

    torch.manual_seed(0)
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    model = str(tmp_path / "model.onnx")
    export(_Activated(), batch, model)
    with pytest.raises(AutoparError, match=r"'tanh' .* the plan has no operator for it"):
        parallelize(_ActivatedMore(), autopar.plan(model, devices=1), model, batch)


def test_a_plan_for_another_device_count_is_refused(llama: dict[str, Any], one_process: Any) -> None:
    from autopar.torch import TrainingError, parallelize

    with pytest.raises(TrainingError, match="for 8 devices; this job has 1 processes"):
        parallelize(FAMILIES["llama"].build(2), llama["searched"], llama["model8"], FAMILIES["llama"].batch(8, 0))


def test_another_module_is_refused(llama: dict[str, Any], one_process: Any) -> None:
    from autopar.errors import AutoparError
    from autopar.torch import parallelize

    family = FAMILIES["qwen3"]
    with pytest.raises(AutoparError, match="another module"):
        parallelize(family.build(2), llama["one"], llama["model8"], family.batch(8, 0))


def test_a_reshaped_parameter_is_refused(llama: dict[str, Any], one_process: Any) -> None:
    from autopar.errors import AutoparError
    from autopar.torch import parallelize

    module = FAMILIES["llama"].build(2)
    table = module.model.model.embed_tokens
    table.weight = torch.nn.Parameter(torch.zeros(table.weight.shape[0], table.weight.shape[1] * 2))
    with pytest.raises(AutoparError, match=re.escape("'model.model.embed_tokens.weight' has shape [128, 128]")):
        parallelize(module, llama["one"], llama["model8"], FAMILIES["llama"].batch(8, 0))


def test_a_model_file_without_node_records_is_refused(one_process: Any) -> None:
    from autopar.torch import parallelize
    from autopar.torch.mapping import MappingError

    legacy = Path(__file__).parent / "data" / "torch_llama_legacy.onnx"
    plan = autopar.plan(str(legacy), devices=1)
    with pytest.raises(MappingError, match=re.escape("export the module with torch.onnx.export")):
        parallelize(FAMILIES["llama"].build(2), plan, str(legacy), FAMILIES["llama"].batch(8, 0))


def test_a_weight_planned_in_two_layouts_is_refused_saying_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama with its output matrix tied to the embedding, imported without reading the exporter's transposed copy
    as the embedding's Transpose (`autopar.graph.tied`, turned off here): the plan holds the one parameter as two
    weights, which a plan that shards weights lays out apart (the ranks, forked, import alike)."""
    monkeypatch.setattr("autopar.graph.build.tie_transposed_copies", lambda proto: frozenset())

    def tied(layers: int) -> torch.nn.Module:
        module = FAMILIES["llama"].build(layers)
        module.model.lm_head.weight = module.model.model.embed_tokens.weight
        return module

    batches = [FAMILIES["llama"].batch(8, seed) for seed in range(2)]
    model = str(tmp_path / "tied.onnx")
    export(tied(2), batches[0], model)
    need = autopar.plan(model, devices=8, optimizer="adam").file.totals.memory_per_device_bytes
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps(autopar.plan(model, devices=8, cost_model=_profile(need * 0.5), optimizer="adam").to_dict())
    )

    def work(rank: int, world: int, device: Any) -> None:
        from autopar.torch import parallelize

        parallelize(tied(2), str(plan), model, batches[0])

    with pytest.raises(RuntimeFailure, match=r"'model.lm_head.weight' is planned in 2 layouts: it is read as .*--fix"):
        run_workers(8, work, timeout_s=240)


class _SharedNorm(torch.nn.Module):
    """One LayerNorm every layer applies (ALBERT shares a whole layer so): the import gives each reader its own copy
    of its vectors (``norm.bias.1``), as it must for the identical norms exporters merge."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = self.norm(linear(x))
        return (x - y).square().mean()


def test_a_weight_the_layers_share_read_on_two_stages_is_refused(tmp_path: Path) -> None:
    """Each stage would update a copy of its own with its part of the gradient: refused, in one sentence. The cut
    falls between two module nodes, never inside one (a biased linear's MatMul and Add)."""
    torch.manual_seed(0)
    batch = (torch.randn(8, 4, 16), torch.randn(8, 4, 16))
    model, plan = str(tmp_path / "shared.onnx"), tmp_path / "plan.json"
    export(_SharedNorm(), batch, model)
    plan.write_text(json.dumps(autopar.plan(model, devices=8, pipeline_stages=2, micro_batches=2).to_dict()))

    def work(rank: int, world: int, device: Any) -> None:
        from autopar.torch import parallelize

        parallelize(_SharedNorm(), str(plan), model, batch)

    said = r"'norm.bias' is read as norm.bias on stage 0 and as norm.bias.\d on stage 1"
    with pytest.raises(RuntimeFailure, match=said):
        run_workers(8, work, timeout_s=240)


def test_a_training_batch_norm_folded_into_its_conv_is_refused(tmp_path: Path, one_process: Any) -> None:
    """The exporter's optimiser folds a training BatchNorm into its Conv as if it ran on running statistics: the
    file is of another model, and the sentence says how to export it."""
    from autopar.torch import parallelize
    from autopar.torch.mapping import MappingError

    family = FAMILIES["resnet"]
    model = str(tmp_path / "resnet.onnx")
    export(family.build(2), family.batch(8, 0), model, optimize=True)
    plan = autopar.plan(model, devices=1)
    with pytest.raises(MappingError, match=re.escape("optimize=False")):
        parallelize(family.build(2), plan, model, family.batch(8, 0))


def test_a_rank_that_dies_ends_the_others(llama: dict[str, Any]) -> None:
    batch = FAMILIES["llama"].batch(8, 0)

    def work(rank: int, world: int, device: Any) -> None:
        from autopar.torch import parallelize

        module = parallelize(FAMILIES["llama"].build(2), llama["sharded"], llama["model8"], batch)
        if rank == 3:
            raise RuntimeError("rank 3 stops here")
        module.train_step(*batch)

    with pytest.raises(RuntimeFailure, match="Rank 3 of the torch runtime died: RuntimeError: rank 3 stops here"):
        run_workers(8, work, timeout_s=60)
