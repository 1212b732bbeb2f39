"""`parallelize`: the user's module, sharded as planned, trained with their own optimizer, loop and data.

On every rank of a ``torchrun`` job (gloo on CPU, NCCL on GPUs), ``parallelize(module, plan, model,
example_inputs)`` changes the module in place and returns it:

- every parameter the rank's part of the plan reads becomes a DTensor on the plan's logical mesh
  (`autopar.lowering.axes`, cut per tensor as `autopar.export.logical` cuts it) with the plan's placements,
  the rank keeping only its shard. A parameter the parallel optimizer splits is stored split (its gradient
  and optimizer state follow) and gathered once a step before its first use. Under pipeline stages a rank
  holds its stage's parameters only (the others are set to None);
- its ``forward`` runs the plan's program on the rank's shards (`autopar.torch.step`): the module's own ATen
  calls, the plan's collectives between them and, through autograd, the plan's gradient paths and
  synchronisation. It takes the batch the plan was made for (the same on every rank: each rank takes its
  shards) and returns what the module returns, whole on every rank;
- ``train_step(*batch)`` runs a whole step on the global batch, over the plan's micro-batches (a pipelined
  plan's stages under torch's ``Schedule1F1B``, `autopar.torch.pipeline`), synchronises the gradients as
  planned, checks the collectives the step ran against the plan's (`Trainer.check`) and returns the loss.

The module's class is swapped for a subclass (as ``fully_shard`` does), so ``isinstance`` still holds and its
``state_dict`` keeps its keys: ``torch.distributed.checkpoint`` saves and loads it (`autopar.torch.checkpoint`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.export.logical import tensor_groups
from autopar.graph import Graph, freeze, read_model
from autopar.graph.proto import data_inputs
from autopar.layout import Layout
from autopar.lowering import Plan, PlanFile, PlanProgram, load_plan_file, program_from_file
from autopar.lowering.axes import LogicalAxis, logical_axes
from autopar.lowering.planfile import GradientPath, GradientSync, Redistribution
from autopar.lowering.program import plan_graph
from autopar.lowering.staged import StagedProgram, staged_program
from autopar.options import PlanOptions, Precision
from autopar.redistribute import Collective, Step, redistribute
from autopar.runtime.collectives import DistributedCollectives
from autopar.runtime.program import Schedule
from autopar.spmd.compare import Tally, collectives_differ
from autopar.torch.capture import exported_program
from autopar.torch.mapping import ModuleMap, inverse, map_module
from autopar.torch.moves import Mover
from autopar.torch.pipeline import PlannedStage, StageModule, send_label
from autopar.torch.step import RankProgram, folded_keys, folded_nodes


class TrainingError(AutoparError):
    """The module, the plan and the job do not fit together, or a step did not run as planned."""


PlanLike = Plan | PlanFile | str | Path
ModelLike = str | Path | onnx.ModelProto


def permuted_layout(layout: Layout, permutation: tuple[int, ...] | None) -> Layout:
    """The layout of ``x.permute(permutation)`` for ``x`` in ``layout``.

    >>> permuted_layout(Layout(((1,), ())), (1, 0)).describe()
    '[-,b1]'
    """
    if permutation is None:
        return layout
    return Layout(tuple(layout.dims[d] for d in permutation), layout.partial, layout.partial_op)


def _placement(layout: Layout, bits: tuple[int, ...]) -> Placement:
    for dim, dim_bits in enumerate(layout.dims):
        if bits and bits[0] in dim_bits:
            return Shard(dim)
    if bits and bits[0] in layout.partial:
        return Partial(str(layout.partial_op))
    return Replicate()


class Meshes:
    """The DeviceMeshes a plan's tensors live on: the logical axes, cut per tensor, each built once (every
    rank builds the same ones in the same order: each creates process groups). A pipelined plan's tensors
    live on their stage's part of it (the mesh without the ``pipeline`` axis)."""

    def __init__(self, axes: Sequence[LogicalAxis], world: int, device_type: str, stage_bits: Sequence[int]) -> None:
        self.axes, self.world, self.device_type = tuple(axes), world, device_type
        self.stage_bits = frozenset(stage_bits)
        self.built: dict[tuple[tuple[str, tuple[int, ...]], ...], Any] = {}

    def placements(self, layout: Layout) -> tuple[Any, tuple[Placement, ...]]:
        """The mesh (this rank's stage of it) and the placements of a tensor of ``layout``."""
        from torch.distributed.device_mesh import DeviceMesh

        groups = tensor_groups(layout, self.axes, ordered=True)
        if groups not in self.built:
            grid = torch.arange(self.world)
            bits = [bit for _, group_bits in groups for bit in group_bits]
            if bits:  # dimension i of the (2, ..., 2) grid is bit len - 1 - i: row-major, highest bit first
                grid = grid.reshape([2] * len(bits)).permute([len(bits) - 1 - bit for bit in bits])
            grid = grid.reshape([1 << len(group_bits) for _, group_bits in groups])
            self.built[groups] = DeviceMesh(self.device_type, grid, mesh_dim_names=tuple(name for name, _ in groups))
        mesh = self.built[groups]
        kept = [(name, bits) for name, bits in groups if not set(bits) & self.stage_bits]
        if len(kept) != len(groups):
            mesh = mesh[tuple(name for name, _ in kept)]
        return mesh, tuple(_placement(layout, bits) for _, bits in kept)


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Trainer:
    """The plan's view of one rank of the module (see the module docstring); ``module.autopar``."""

    def __init__(
        self,
        module: torch.nn.Module,
        plan: PlanFile,
        graph: Graph,
        program: PlanProgram,
        mapping: ModuleMap,
        exported: torch.export.ExportedProgram,
        staged: StagedProgram | None,
        seed: int | None = None,
    ) -> None:
        self.plan, self.graph, self.program, self.mapping = plan, graph, program, mapping
        self.exported, self.staged = exported, staged
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = _device()
        self.micro_batches = plan.memory_plan.micro_batches
        per = staged.stage_devices if staged is not None else self.world
        self.stage = self.rank // per
        self.stage_ops = frozenset(staged.stages[self.stage]) if staged is not None else None
        self.redistributions, self.gradients, self.syncs = self._listed()
        self.schedule = Schedule.of(self.redistributions, self.gradients, self.syncs)
        self.tally = Tally()
        self.derived_tally = Tally()  # folded weights' gradient reductions (`ModuleMap.derived`), not in the plan
        self.buffer_tally = Tally()  # buffers the forward writes, gathered where the plan splits them: not in it
        self._writes: Any = None  # the last forward's pass, whose buffer writes train_step keeps for the step's end
        self.steps_run = 0
        self.passes = 0  # forward passes that dropped elements: each draws its masks anew (`autopar.torch.dropout`)
        self.captured_training = module.training  # the mode its program was captured in (`_draw`)
        self.batch_statistics = next(  # a BatchNorm of the program that normalises with its batch's statistics
            (
                node.name
                for node in exported.graph.nodes
                if node.target == torch.ops.aten._native_batch_norm_legit_functional.default and node.args[5]
            ),
            None,
        )
        collectives = DistributedCollectives(self.rank, self.world, self._bit_sets(), self.device)
        self.rank_program = RankProgram(
            program,
            self.schedule,
            mapping,
            exported.graph_module,
            Mover(collectives, self.tally, self.rank),
            stage_ops=self.stage_ops,
            derived_mover=Mover(collectives, self.derived_tally, self.rank),
        )
        if self.rank_program.draws:
            self.rank_program.seed = self._common_seed(seed)
        self.buffer_mover = Mover(collectives, self.buffer_tally, self.rank)
        stage_bits = plan.pipeline.bits if plan.pipeline is not None else ()
        self.meshes = Meshes(logical_axes(plan), self.world, self.device.type, stage_bits)
        self.stored: dict[str, Layout] = {}  # state_dict key -> its layout as stored on this rank
        self._shard_parameters(module)
        self.pipeline: Any = None
        if staged is not None:
            self.pipeline = self._pipeline(module, staged)

    def _common_seed(self, seed: int | None) -> int:
        """Dropout's seed, rank 0's on every rank, so that every rank draws alike: the one given, else its
        ``torch.initial_seed()``, modulo 2**63 (a checkpoint keeps it as an int64)."""
        mine = torch.initial_seed() if seed is None else seed
        value = torch.tensor([mine % (1 << 63)], dtype=torch.int64, device=self.device)
        dist.broadcast(value, src=0)
        return int(value.item())

    def dropout_state(self) -> torch.Tensor:
        """Dropout's seed and the passes drawn so far (`autopar.torch.checkpoint` keeps them)."""
        return torch.tensor([self.rank_program.seed, self.passes], dtype=torch.int64)

    def restore_dropout(self, state: torch.Tensor) -> None:
        """Draw on from a checkpoint's `dropout_state`, as the run it was saved from would have."""
        self.rank_program.seed, self.passes = (int(value) for value in state.tolist())

    def _draw(self, module: torch.nn.Module, ahead: int = 0) -> int | None:
        """The number of the pass ``ahead`` passes from the next, where the module trains (its dropouts draw).
        A module captured in ``eval()`` mode has no dropout in its program (nor batch statistics): it is refused
        training, where it would train without them."""
        if module.training and not self.captured_training:
            raise TrainingError(
                "The module was parallelized in eval() mode, whose program has no dropout and normalises with"
                " running statistics; call module.train() before parallelize to train it."
            )
        if not module.training and self.batch_statistics:
            raise TrainingError(
                f"Module node {self.batch_statistics!r} normalises with its batch's statistics, as the module was"
                " captured in training; in eval() mode the module would use its running statistics: evaluate the"
                " plain module (load_unsharded), or one parallelized in eval() mode."
            )
        return self.passes + ahead if module.training and self.rank_program.draws else None

    def _mine(self, op: str) -> bool:
        return self.stage_ops is None or self.graph.position[op] in self.stage_ops

    def _listed(self) -> tuple[list[Redistribution], list[GradientPath], list[GradientSync]]:
        """The plan's collectives this rank runs: its stage's, less those of tables the module does not train
        (`ModuleMap.untrained`) and of the gradients that then no longer flow."""
        program, untrained, needs = self.program, self.mapping.untrained, self.program.requires_grad
        moves = [
            entry
            for entry in program.redistributions
            if entry.tensor not in untrained
            and self._mine(entry.consumer if entry.consumer in self.graph.position else entry.producer)
        ]
        paths = [entry for entry in program.gradients if needs.get(entry.tensor, False) and self._mine(entry.consumer)]
        syncs = [
            entry
            for entry in program.gradient_sync
            if entry.parameter not in untrained and self._mine(program.ops[program.owner[entry.parameter][0]].name)
        ]
        return moves, paths, syncs

    def _bit_sets(self) -> list[tuple[int, ...]]:
        """Every set of mesh bits any rank's collectives use (every rank creates every group, in one order)."""
        program = self.program
        steps = [s.step() for entry in program.redistributions for s in entry.steps]
        steps += [s.step() for entry in program.gradients for s in entry.steps]
        steps += [step for step in (entry.step() for entry in program.gradient_sync) if step is not None]
        syncs = {entry.parameter: entry.step() for entry in program.gradient_sync}
        for name in self.mapping.derived:  # a folded weight's gradient is summed over the bits it is stored split by
            node, slot = program.owner[name]
            split = set(program.ops[node].input_layout(slot).split_bits)
            sync = syncs.get(name)
            if sync is not None and sync.kind == Collective.REDUCE_SCATTER:
                split |= set(sync.bits)
            if split:
                steps.append(Step(Collective.ALL_REDUCE, tuple(sorted(split, reverse=True)), 0))
        for tensor, _ in self.mapping.mutated.values():  # a buffer the forward writes, gathered whole
            if tensor:
                written = program.op(program.graph.producer[tensor])
                layout = written.outputs[written.rule.op.outputs.index(tensor)]
                shape = program.graph.tensor(tensor).shape
                if layout is not None:
                    steps += list(redistribute(layout, Layout(tuple(() for _ in shape)), shape, 4))
        if self.staged is not None:
            for crossing in self.staged.crossings:
                shape = program.graph.tensor(crossing.tensor).shape
                steps += list(redistribute(crossing.written, Layout(crossing.written.dims), shape, crossing.itemsize))
                if crossing.gradient is not None:
                    steps += list(redistribute(crossing.gradient, Layout(crossing.gradient.dims), shape, 4))
        return sorted({step.bits for step in steps})

    # --- parameters -----------------------------------------------------------------------------

    def _check_one_stage(self, uses: Mapping[str, list[tuple[str, tuple[int, ...] | None]]]) -> None:
        """Refuse a module parameter the plan reads as tensors owned on two pipeline stages: a weight the layers share
        (ALBERT's one layer, read by all), whose shared vectors the import gives each reader a copy of (``bias.1``,
        as it must for the identical norms exporters merge). Each stage would update its own copy with its part of
        the gradient; the trainer keeps each parameter on one stage."""
        if self.staged is None:
            return
        program, stages = self.program, self.staged.stages
        for key in sorted(uses):
            where = {t: next(i for i, nodes in enumerate(stages) if program.owner[t][0] in nodes) for t, _ in uses[key]}
            if len(set(where.values())) > 1:
                read = sorted(where.items(), key=lambda item: (item[1], item[0]))
                (first, a), (second, b) = read[0], next(item for item in read if item[1] != read[0][1])
                raise TrainingError(
                    f"Module parameter {key!r} is read as {first} on stage {a} and as {second} on stage {b} (a weight"
                    " the layers share); autopar's trainer keeps each parameter on one stage: plan it with"
                    " --pipeline-stages 1, or with --stage-starts where no shared weight is read on both sides."
                )

    def _shard_parameters(self, module: torch.nn.Module) -> None:
        uses: dict[str, list[tuple[str, tuple[int, ...] | None]]] = {}
        program = self.program
        for tensor, use in self.mapping.parameters.items():
            uses.setdefault(use.parameter, []).append((tensor, use.permutation))
        named = dict(module.named_parameters(remove_duplicate=False))
        self._check_one_stage(uses)
        layouts: dict[str, Layout] = {}
        for key in sorted(uses):
            found = {
                permuted_layout(self.rank_program.stored_layout(t), inverse(p) if p else None) for t, p in uses[key]
            }
            if len(found) != 1:
                read = " and as ".join(t for t, _ in uses[key])
                raise TrainingError(
                    f"Module parameter {key!r} is planned in {len(found)} layouts: it is read as {read} (a weight"
                    " read in several places: an embedding read again as the output matrix, or one layer's weights"
                    " that the others share), and autopar's trainer keeps one"
                    " copy of each parameter; fix its readers to one layout (--fix), or untie it"
                    " (tie_word_embeddings=False) before exporting."
                )
            tensor, permutation = uses[key][0]
            expected = tuple(self.graph.tensor(tensor).shape)
            shape = tuple(named[key].shape)
            if (tuple(shape[d] for d in permutation) if permutation else shape) != expected:
                raise TrainingError(
                    f"Module parameter {key!r} has shape {list(shape)}, where the plan's {tensor!r} has"
                    f" {list(expected)}: the plan was made for another module."
                )
            layouts[key] = found.pop()
        for key in sorted(named):  # one order on every rank: a mesh's first use creates its process groups
            self.meshes.placements(layouts.get(key, Layout.replicated(named[key].dim())))
        for key in sorted(uses):
            owners = {program.ops[program.owner[t][0]].name for t, _ in uses[key]}
            if not any(self._mine(owner) for owner in owners):
                self._replace(module, key, None)  # another stage's
                continue
            self.stored[key] = layouts[key]
            self._replace(module, key, self._distribute(named[key], layouts[key]))
        folded = self._folded_elsewhere(named)
        # a name the module ties to a parameter the plan reads (an embedding that is the output matrix too) names the
        # parameter as it now is: one value under both names, as the module had it
        planned = {id(named[key]): key for key in uses}
        tied = {key: planned[id(value)] for key, value in named.items() if key not in uses and id(value) in planned}
        for key, parameter in named.items():
            if key in tied:
                self._replace(module, key, self._registered(module, tied[key]))
            elif key in folded:
                self._replace(module, key, None)  # folded into weights another stage reads: that stage's
            elif key not in uses and not isinstance(parameter, DTensor):  # one the plan never reads: replicated
                self._replace(module, key, self._distribute(parameter, Layout.replicated(parameter.dim())))

    def _folded_elsewhere(self, named: Mapping[str, torch.Tensor]) -> frozenset[str]:
        """The module's parameters the plan reads only through weights folded from them (GPT-2's and OPT's position
        tables, looked up at the positions the exporter folded in) that this rank's stage does not read: another
        stage computes and trains them (each rank held a copy of its own, never updated, that a checkpoint could
        have taken)."""
        if self.staged is None or not self.mapping.derived:
            return frozenset()
        every = folded_keys(self.mapping, folded_nodes(self.mapping, self.program, self.rank_program.nodes, None))
        read = {use.parameter for use in self.mapping.parameters.values()}
        return (every - self.rank_program.folded_parameters - read) & set(named)

    def _distribute(self, parameter: torch.Tensor, layout: Layout) -> torch.nn.Parameter:
        mesh, placements = self.meshes.placements(layout)
        full = parameter.detach().to(self.device)
        local = full[layout.local_slices(self.rank, tuple(full.shape))].contiguous()
        value = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
        return torch.nn.Parameter(value, requires_grad=parameter.requires_grad)

    @staticmethod
    def _replace(module: torch.nn.Module, key: str, value: torch.nn.Parameter | None) -> None:
        owner, name = _owner(module, key)
        owner.register_parameter(name, value)

    @staticmethod
    def _registered(module: torch.nn.Module, key: str) -> torch.nn.Parameter | None:
        """The parameter registered under ``key`` (None: none, another stage's)."""
        owner, name = _owner(module, key)
        return getattr(owner, name)

    def _parameters(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's shard of each parameter it holds (a parameter no operator reads, only folded weights
        computed from it, is whole)."""
        named: dict[str, Any] = dict(module.named_parameters(remove_duplicate=False))
        return {key: value.to_local() for key, value in named.items()}

    def _constants(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        buffers = dict(module.named_buffers(remove_duplicate=False))
        constants = dict(self.exported.constants)
        out = {}
        for placeholder, key in self.mapping.buffers.items():
            value = buffers.get(key, constants.get(key))
            if value is None:
                raise TrainingError(f"The module has no buffer {key!r}, which the plan's program reads.")
            out[placeholder] = torch.as_tensor(value).to(self.device)
        return out

    # --- running --------------------------------------------------------------------------------

    def _inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The plan's data inputs (plan name -> tensor) from a call of the module's forward."""
        flat, _ = pytree.tree_flatten((args, kwargs))
        names = list(self.exported.graph_signature.user_inputs)
        if len(flat) != len(names):
            raise TrainingError(f"The module was planned with {len(names)} input(s); this call passes {len(flat)}.")
        given = {name: value for name, value in zip(names, flat) if isinstance(value, torch.Tensor)}
        out = {}
        for name, placeholder in self.mapping.inputs.items():
            value = given[placeholder].to(self.device)
            want = tuple(self.graph.tensor(name).shape)
            if tuple(value.shape) != want:
                raise TrainingError(
                    f"Input {name!r} has shape {list(value.shape)}; the plan runs {list(want)} a micro-batch"
                    + (" (call train_step with the whole batch)" if self.micro_batches > 1 else "")
                    + "."
                )
            out[name] = value
        return out

    def forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One micro-batch's forward (the plan's whole batch where it has one micro-batch), outputs whole."""
        if self.staged is not None:
            raise TrainingError("A pipelined plan runs whole steps: call train_step(*batch).")
        inputs = self._inputs(args, kwargs)
        if not self.rank_program.defer_sync:
            self.rank_program.gathered.clear()
        draw = self._draw(module)
        run = self.rank_program.forward(inputs, self._parameters(module), self._constants(module), draw=draw)
        self.passes += draw is not None
        outputs = [run.output(name) for name in self.graph.outputs]
        if self._writes is None:
            self._write_buffers(module, run)
        else:
            self._writes = run  # within a step: the buffers are written once, at its end (`train_step`)
        return pytree.tree_unflatten(outputs, self.exported.call_spec.out_spec)

    def _write_buffers(self, module: torch.nn.Module, run: Any) -> None:
        """Write the buffers the module's forward writes (`ModuleMap.mutated`) with the values of ``run``, each
        whole on the ranks whose stage computes it."""
        if not self.mapping.mutated:
            return
        buffers = dict(module.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for key, source in sorted(self.mapping.mutated.items()):
                value = run.buffer_value(source, self.buffer_mover)
                if value is None:
                    continue
                owner, name = _owner(module, key)
                # a new tensor, not written in place: the step's backward may still hold the old one
                owner._buffers[name] = value.reshape(buffers[key].shape).to(buffers[key].dtype).clone()

    def train_step(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """See `ParallelModule.train_step`."""
        count = self.micro_batches
        program = self.rank_program
        program.gathered.clear()
        program.defer_sync = count > 1
        self._writes = False  # a micro-batch's forward leaves its pass here; the last one's writes the buffers
        try:
            if self.staged is not None:
                loss = self._pipelined_step(module, args, kwargs)
            else:
                losses = []
                for micro in _micro_batches(args, kwargs, count):
                    out = self.forward(module, *micro)
                    if not isinstance(out, torch.Tensor) or out.numel() != 1:
                        raise TrainingError("train_step needs a module whose forward returns the loss alone.")
                    (out / count).backward()
                    losses.append(out.detach())
                loss = torch.stack(losses).mean()
                if count > 1:
                    self._add_gradients(module, program.synchronise(), 1.0)
            if self._writes is not False:
                self._write_buffers(module, self._writes)
        finally:
            program.defer_sync = False
            program.gathered.clear()
            self._writes = None
        self.steps_run += 1
        self.check()
        return loss

    def _add_gradients(self, module: torch.nn.Module, gradients: Mapping[str, torch.Tensor], scale: float) -> None:
        """Add each plan tensor's synchronised gradient, times ``scale``, to its parameter's."""
        named: dict[str, Any] = dict(module.named_parameters(remove_duplicate=False))
        derived = {tensor: grad for tensor, grad in gradients.items() if tensor in self.mapping.derived}
        if derived:  # back through the parameters the folded weights come from, computed again
            values = self.rank_program.derived_values(self._parameters(module), self._constants(module), list(derived))
            torch.autograd.backward([values[t] for t in derived], [grad * scale for grad in derived.values()])
        with torch.no_grad():
            for tensor, grad in gradients.items():
                if tensor in derived:
                    continue
                use = self.mapping.parameters[tensor]
                parameter = named[use.parameter]
                local = (grad.permute(inverse(use.permutation)) if use.permutation else grad) * scale
                if parameter.grad is None:
                    parameter.grad = DTensor.from_local(
                        local.contiguous(),
                        parameter.device_mesh,
                        parameter.placements,
                        run_check=False,
                        shape=parameter.shape,
                        stride=parameter.stride(),
                    )
                else:
                    parameter.grad.to_local().add_(local)

    # --- pipeline stages --------------------------------------------------------------------------

    def _pipeline(self, module: torch.nn.Module, staged: StagedProgram) -> Any:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        per, stages = staged.stage_devices, len(staged.stages)
        group = None
        for local in range(per):  # every rank creates every stage-to-stage group, in one order
            members = [stage * per + local for stage in range(stages)]
            created = dist.new_group(members)
            if self.rank in members:
                group = created
        last = self.stage == stages - 1
        outs = [c for c in staged.crossings if c.from_stage == self.stage]
        skipping = [c for c in staged.crossings if c.to_stage != c.from_stage + 1]
        if skipping:
            c = skipping[0]
            raise TrainingError(
                f"The plan sends {c.tensor!r} from stage {c.from_stage} to stage {c.to_stage}, past the stages between;"
                " torch's pipelining passes each stage's outputs to the next stage only."
            )
        elsewhere = [name for name in self.graph.outputs if not last or not self._mine(self.graph.producer[name])]
        if elsewhere and last:
            raise TrainingError(f"The module's output {elsewhere[0]!r} is computed before the last pipeline stage.")
        self.micro_inputs: list[dict[str, torch.Tensor]] = []

        def run(micro_batch: int, received: Sequence[torch.Tensor]) -> Any:
            into = [c for c in staged.crossings if c.to_stage == self.stage]
            arrived = {(c.tensor, c.consumer, c.slot): value for c, value in zip(into, received)}
            result = self.rank_program.forward(
                self.micro_inputs[micro_batch],
                self._parameters(module),
                self._constants(module),
                arrived,
                self._draw(module, micro_batch),
            )
            self._writes = result
            if last:
                return result.output(self.graph.outputs[0])
            return tuple(result.leaving(c.tensor, c.producer) for c in outs)

        self.stage_module = StageModule(run)

        def dtype_of(tensor: str) -> torch.dtype:
            return torch.from_numpy(np.zeros(0, dtype=self.graph.tensor(tensor).dtype)).dtype

        stage = PlannedStage(self.stage_module, staged, self.rank, self.device, group, self.tally, dtype_of)
        # torch's 1F1B wants a micro-batch a stage at least; with fewer, 1F1B's order is GPipe's (forwards, then
        # backwards), which torch runs as ScheduleGPipe
        schedule = Schedule1F1B if staged.micro_batches >= stages else ScheduleGPipe
        return schedule(stage, staged.micro_batches, loss_fn=lambda output, target: output, scale_grads=False)

    def _pipelined_step(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        assert self.staged is not None  # a pipelined plan
        count = self.staged.micro_batches
        self.micro_inputs = [self._inputs(*micro) for micro in _micro_batches(args, kwargs, count)]
        self.stage_module.micro_batch = 0
        losses: list[torch.Tensor] = []
        self.pipeline.step(
            target=torch.zeros(count), losses=losses, return_outputs=False
        )  # the loss is the output itself
        self.passes += count if self._draw(module) is not None else 0
        self._add_gradients(module, self.rank_program.synchronise(), 1.0)
        named = dict(module.named_parameters(remove_duplicate=False))
        with torch.no_grad():  # the micro-batches' mean, as the whole batch's loss is (a folded weight's too)
            for key in sorted((self.stored.keys() | self.rank_program.folded_parameters) & named.keys()):
                grad = named[key].grad
                if grad is not None:
                    grad.to_local().div_(count)  # type: ignore[attr-defined]
        loss = torch.stack([value.detach().reshape(()) for value in losses]).mean() if losses else torch.zeros(())
        dist.broadcast(loss, src=self.world - 1)  # every rank reports the loss the last stage computed
        return loss

    # --- executed against planned ---------------------------------------------------------------------

    def planned(self, steps: int = 1) -> Tally:
        """The collectives and messages ``steps`` steps of the plan run on this rank: forward and backward per
        micro-batch, the gradient synchronisation (and the parallel optimizer's AllGather) once a step."""
        tally = Tally()
        count = self.micro_batches
        for _ in range(steps):
            for entry in self.redistributions:
                for _ in range(count):
                    for s in entry.steps:
                        tally.add("forward", s.step(), s.bytes)
            for path in self.gradients:
                for _ in range(count):
                    for c in path.steps:
                        tally.add("backward", c.step(), c.bytes)
            for sync in self.syncs:
                step = sync.step()
                if step is not None:
                    tally.add("sync", step, step.nbytes)
                gather = self.rank_program.gather_step(sync.parameter)
                if gather is not None:
                    tally.add("sync", gather, gather.nbytes)
            if self.staged is not None:
                self._planned_crossings(tally, self.staged)
        return tally

    def _planned_crossings(self, tally: Tally, staged: StagedProgram) -> None:
        count, per = staged.micro_batches, staged.stage_devices
        for crossing in staged.crossings:
            shape = staged.program.graph.tensor(crossing.tensor).shape
            if crossing.from_stage == self.stage:
                for step in redistribute(crossing.written, Layout(crossing.written.dims), shape, crossing.itemsize):
                    for _ in range(count):
                        tally.add("forward", step, step.nbytes)
            if crossing.to_stage == self.stage and crossing.gradient is not None:
                for step in redistribute(crossing.gradient, Layout(crossing.gradient.dims), shape, crossing.itemsize):
                    for _ in range(count):
                        tally.add("backward", step, step.nbytes)
        for transfer in staged.planned_transfers():
            if transfer.sender == self.rank:
                sender, receiver = transfer.sender // per, transfer.receiver // per
                tally.add_send(send_label(transfer.direction, sender, receiver), transfer.nbytes)

    def check(self) -> None:
        """Raise TrainingError naming the first collective the steps since the last check ran otherwise than the
        plan lists (kind, group size, count, bytes); then count afresh."""
        executed, planned = self.tally.as_dict(), self.planned(max(self.steps_run, 1)).as_dict()
        self.tally.count.clear()
        self.tally.nbytes.clear()
        steps, self.steps_run = self.steps_run, 0
        if executed != planned:
            raise TrainingError(
                f"Rank {self.rank}: {collectives_differ(executed, planned)} (over {max(steps, 1)} step(s))."
            )


def _owner(module: torch.nn.Module, key: str) -> tuple[torch.nn.Module, str]:
    """The submodule a ``state_dict`` key names a tensor of, and the tensor's name there."""
    path, _, name = key.rpartition(".")
    return (module.get_submodule(path) if path else module), name


def _micro_batches(
    args: tuple[Any, ...], kwargs: dict[str, Any], count: int
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The call's tensors split into ``count`` micro-batches along their first dimension."""
    if count == 1:
        return [(args, kwargs)]
    flat, spec = pytree.tree_flatten((args, kwargs))
    for value in flat:
        if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] % count):
            raise TrainingError(
                f"An input of shape {list(value.shape)} does not split into the plan's {count} micro-batches."
            )
    pieces = [value.chunk(count) if isinstance(value, torch.Tensor) else [value] * count for value in flat]
    return [pytree.tree_unflatten([piece[m] for piece in pieces], spec) for m in range(count)]


class ParallelModule:
    """Mixed into the user's module class by `parallelize`: ``forward`` runs the plan (`Trainer`)."""

    autopar: Trainer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.autopar.forward(self, args, kwargs)  # type: ignore[arg-type]

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of one step on the global batch, over the plan's micro-batches (and pipeline
        stages), gradients synchronised as planned and the step's collectives checked against the plan's
        (`Trainer.check`); the loss (the module's one output), averaged over the micro-batches."""
        return self.autopar.train_step(self, args, kwargs)  # type: ignore[arg-type]


def _plan_file(plan: PlanLike) -> PlanFile:
    if isinstance(plan, Plan):
        return plan.file
    if isinstance(plan, PlanFile):
        return plan
    return load_plan_file(plan)


def _as_exported(inputs: Sequence[Any], model: onnx.ModelProto) -> tuple[Any, ...]:
    """The example inputs cut to the batch the model file was exported at (their first samples): captured at that
    batch, the module's program has the nodes the file's records name (the plan may run smaller micro-batches
    through it: a shape a node writes is made the plan's, `autopar.torch.local`)."""
    sizes = [
        info.type.tensor_type.shape.dim[0].dim_value
        for info in data_inputs(model)
        if info.type.HasField("tensor_type") and info.type.tensor_type.shape.dim
    ]
    batch = min((size for size in sizes if size > 0), default=None)
    return tuple(
        value[:batch] if isinstance(value, torch.Tensor) and batch and value.dim() and value.shape[0] > batch else value
        for value in inputs
    )


def _check_parameters(module: torch.nn.Module, graph: Graph) -> None:
    """The module's parameters that the plan's model stores under their own names have the model's shapes."""
    shapes = {key: tuple(value.shape) for key, value in module.named_parameters(remove_duplicate=False)}
    for info in graph.parameters:
        if info.name in shapes and shapes[info.name] != tuple(info.shape):
            raise TrainingError(
                f"Module parameter {info.name!r} has shape {list(shapes[info.name])}, where the plan's model has"
                f" {list(info.shape)}: the plan was made for another module."
            )


def parallelize(
    module: torch.nn.Module,
    plan: PlanLike,
    model: ModelLike,
    example_inputs: Sequence[Any],
    seed: int | None = None,
) -> torch.nn.Module:
    """The module, parallelized as ``plan`` says, on this rank of the running torch.distributed job.

    ``model`` is the file the plan was made from (``torch.onnx.export(module, example_inputs, dynamo=True)``),
    whose node metadata pairs the plan's operators with the module's nodes; ``example_inputs`` are what the
    module's forward takes (a batch the plan was made for, or more samples of the same shapes). Dropout draws its
    masks from rank 0's ``seed`` (default: its ``torch.initial_seed()``), each element's from its place in the
    whole tensor, alike on every rank (`autopar.torch.dropout`). Parallelize the module in ``train()`` mode to
    train it: the program captured in ``eval()`` mode has no dropout.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise TrainingError("parallelize needs a running torch.distributed job (torchrun, init_process_group).")
    file = _plan_file(plan)
    world = dist.get_world_size()
    if world != file.devices:
        raise TrainingError(f"The plan is for {file.devices} devices; this job has {world} processes.")
    proto = model if isinstance(model, onnx.ModelProto) else read_model(model)
    graph = plan_graph(file, proto)
    costs = PlanOptions(file.devices, precision=Precision(file.precision).element_sizes).costs()  # element sizes alone
    staged = staged_program(graph, file, costs) if file.pipeline is not None else None
    program = staged.program if staged is not None else program_from_file(graph, file, file.devices, costs)
    _check_parameters(module, graph)
    exported = exported_program(module, _as_exported(example_inputs, proto))
    mapping = map_module(program, exported)
    if mapping.derived:
        names = ", ".join(f"{tensor} ({node})" for tensor, node in sorted(mapping.derived.items()))
        warnings.warn(
            f"The exporter folded module nodes computed from parameters into the stored weights {names}: autopar"
            " keeps those parameters whole on every rank and sums their gradients over the devices the plan splits"
            " the weights over, one AllReduce each a step that the plan does not list (Trainer.derived_tally).",
            stacklevel=2,
        )
    trained = sorted(name for name in mapping.untrained if graph.tensor(name).trainable)  # (not running statistics)
    if trained:  # not trained: nor is what the plan computes from them alone
        names = ", ".join(trained)
        warnings.warn(
            f"The plan trains {names}, which the module computes from its buffers and constants: autopar reads them"
            " as the constants they are, without the collectives the plan lists for them.",
            stacklevel=2,
        )
        graph = freeze(graph, trained)
        staged = staged_program(graph, file, costs) if file.pipeline is not None else None
        program = staged.program if staged is not None else program_from_file(graph, file, file.devices, costs)
    module.autopar = Trainer(module, file, graph, program, mapping, exported, staged, seed)  # type: ignore[assignment]
    cls = module.__class__
    module.__class__ = type(f"Parallel{cls.__name__}", (ParallelModule, cls), {})
    return module


__all__ = ["ParallelModule", "Trainer", "TrainingError", "parallelize"]
