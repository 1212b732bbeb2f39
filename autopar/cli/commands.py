"""One function a command, from its parsed flags to what it prints or writes; `COMMANDS` names them.

Each returns the exit status; an `AutoparError` it raises is worded and counted by `autopar.cli.main`.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from autopar import progress
from autopar.cli.flags import UsageError, check_out, defaults_of
from autopar.cli.output import ProgressLine, emit, say_plan_warnings, say_warnings, write_stdout
from autopar.errors import AutoparError, AutoparWarning, FixedStrategyError
from autopar.limits import MAX_DIMENSION
from autopar.lowering.advice import plan_warnings
from autopar.options import DEFAULT_COST_MODEL, PlanOptions
from autopar.stdio import stdout_elsewhere


def _options(args: argparse.Namespace, **fields: Any) -> PlanOptions:
    """The checked options the flags ask for: --devices (default 8), or --rank-table's count and servers."""
    cost_model = getattr(args, "cost_model", DEFAULT_COST_MODEL)
    return PlanOptions.resolve(
        args.devices, cost_model, args.rank_table or None, devices_said_as="--devices ", **fields
    )


def _fixed(args: argparse.Namespace) -> dict[str, Any] | None:
    """The strategies ``--strategies FILE`` and ``--fix`` fix (``--fix`` wins for the same operator; one operator
    given two strategies by the file, or by ``--fix``, is an error)."""
    fixed: dict[str, Any] = {}
    if args.strategies:
        try:
            data = json.loads(Path(args.strategies).read_text(encoding="utf-8"), object_pairs_hook=_once_each)
        except OSError as exc:
            raise FixedStrategyError(
                f"Strategies file {args.strategies!r} cannot be read: {exc.strerror or exc}."
            ) from None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise FixedStrategyError(f"Strategies file {args.strategies!r} is not JSON.") from None
        except _NamedTwice as twice:
            raise FixedStrategyError(
                f"Strategies file {args.strategies!r} names operator {twice.name!r} twice: give it one strategy."
            ) from None
        if not isinstance(data, dict):
            raise FixedStrategyError(
                f"Strategies file {args.strategies!r} must be a JSON object {{operator: in_strategy}}."
            )
        fixed.update(data)
    given: dict[str, Any] = {}
    for name, strategy in args.fix:
        if name in given and given[name] != strategy:
            raise UsageError(f"--fix gives {name!r} two strategies, {given[name]} and {strategy}: give it one.")
        given[name] = strategy
    fixed.update(given)
    if fixed and args.mode not in ("auto_parallel", "semi_auto_parallel"):
        raise FixedStrategyError(f"--fix and --strategies need --mode semi_auto_parallel, not {args.mode}.")
    return fixed or None


class _NamedTwice(Exception):
    """A JSON object naming one key twice (`_once_each`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, where a key given twice is an error (json keeps the last, silently).

    >>> _once_each([("a", 1), ("b", 2)])
    {'a': 1, 'b': 2}
    """
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _NamedTwice(key)
        found[key] = value
    return found


def _searched_options(args: argparse.Namespace) -> PlanOptions:
    """The options of a command that searches a plan (``plan``, ``report``): the same flags, read once."""
    return _options(
        args,
        batch=args.batch,
        mode=args.mode,
        dims=dict(args.dim),
        precision=args.precision,
        search=args.search,
        frozen=args.frozen,
        trainable=args.trainable,
        overlap=args.overlap,
        micro_batches=args.micro_batches,
        pipeline_stages=args.pipeline_stages,
        stage_starts=tuple(args.stage_starts or ()),
        recompute=args.recompute,
        fixed=_fixed(args),
        optimizer=args.optimizer,
        memory_reserve=args.memory_reserve,
    )


def run_plan(args: argparse.Namespace) -> int:
    check_out(args.out, args.model, args.strategies, args.rank_table)
    import autopar
    from autopar.report import plan_table

    line = ProgressLine.for_command(args.quiet)
    with warnings.catch_warnings(record=True) as caught, progress.listening(line), line, stdout_elsewhere(True):
        warnings.simplefilter("always", AutoparWarning)  # said below as one line each, in the CLI's words
        options = _searched_options(args)
        cluster = options.cluster
        result = autopar.api.plan_with(args.model, options)
        top = None if args.all else args.top
        text = result.to_json() + "\n" if args.format == "json" else plan_table(result, top)  # lowering reports too
    if cluster is not None and args.format == "table":  # the levels the rank table implies, under the title
        title, _, rest = text.partition("\n")
        text = f"{title}\ncluster: {cluster.describe()}\n{rest}"
    say_warnings(caught, plan_says=True)
    say_plan_warnings(plan_warnings(result.file))
    emit(text, args.out)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from autopar.graph import load_model
    from autopar.report import inspect_summary, inspect_table

    line = ProgressLine.for_command(args.quiet)
    with progress.listening(line), line, stdout_elsewhere(True):  # stdout carries the summary alone
        progress.report("import", 0, 1)
        graph = load_model(args.model, batch=args.batch, dims=dict(args.dim))
        summary = inspect_summary(graph)
    text = json.dumps(summary, indent=2) + "\n" if args.format == "json" else inspect_table(summary)
    write_stdout(text)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    import autopar
    from autopar.lowering import load_plan_file
    from autopar.report import verify_table

    shaping = [
        flag
        for dest, flag in (("optimizer", "--optimizer"), ("memory_reserve", "--memory-reserve"))
        if getattr(args, dest) is not None
    ]
    if args.plan and shaping:
        raise UsageError(f"--plan verifies the plan file as it was made, so it takes no {', '.join(shaping)}.")
    plan_file = load_plan_file(args.plan) if args.plan else None
    options = _options(args)
    devices, cost_model = options.num_devices, options.cost_model
    if plan_file is not None and args.devices is None and args.rank_table is None:
        devices = plan_file.devices  # the devices the plan was made for
    if plan_file is None:  # a model exported with --to onnx carries its plan: verify that one
        from autopar.export.onnx_sharding import annotated_devices
        from autopar.graph.read import read_model

        annotated = annotated_devices(read_model(args.model))
        if annotated is not None and args.devices is None and args.rank_table is None:
            devices = annotated
        if annotated == devices:
            print(f"autopar: verifying the plan annotated in {args.model} ({annotated} devices)", file=sys.stderr)
    line = ProgressLine.for_command(args.quiet)
    # stdout carries the verdict alone, whatever the ranks or libraries print
    with progress.listening(line), line, stdout_elsewhere(True):
        report = autopar.verify(
            args.model,
            plan_file,
            devices=devices,
            batch=args.batch,
            dims=dict(args.dim),
            seed=args.seed,
            cost_model=cost_model,
            runtime=args.runtime,
            gradients=True if args.gradients or args.runtime == "torch" else None,
            port=args.port,
            timeout_s=args.timeout,
            optimizer=args.optimizer,
            memory_reserve=args.memory_reserve,
        )
    text = (
        json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"
        if args.format == "json"
        else verify_table(report)
    )
    write_stdout(text)
    if not report.ok:
        print(f"autopar: error: the plan does not verify: {report.problems[0]}", file=sys.stderr)
    return 0 if report.ok else 1


def run_export(args: argparse.Namespace) -> int:
    from autopar.export import export
    from autopar.graph import load_model
    from autopar.lowering import load_plan_file
    from autopar.lowering.program import planned_batch

    check_out(args.out, args.model, args.plan)
    plan_file = load_plan_file(args.plan)
    model = None
    line = ProgressLine.for_command(args.quiet)
    with progress.listening(line), line, stdout_elsewhere(True):
        if args.model:  # imported at the batch the plan was made for, as the plan saw it
            progress.report("import", 0, 1)
            model = load_model(args.model, batch=planned_batch(plan_file)).model
        written = export(plan_file, args.to, args.out, model)
    for path in written:
        print(f"autopar: wrote {path}", file=sys.stderr)
    return 0


def run_route(args: argparse.Namespace) -> int:
    """``route``: the model with its gathered experts written as GShard's dispatch, and one line saying what."""
    from autopar.graph.experts import route_experts
    from autopar.graph.read import read_model

    model = Path(args.model)
    out = Path(args.out) if args.out else model.with_name(f"{model.stem}_routed.onnx")
    check_out(str(out), args.model)
    line = ProgressLine.for_command(args.quiet)
    with progress.listening(line), line:
        progress.report("import", 0, 1)
        weights = _external_files(read_model(model), model.parent)
        if out.resolve() in weights:
            raise UsageError(f"--out {str(out)!r} is the file the model keeps its weights in: name another file.")
        routed = route_experts(model, args.capacity_factor, args.group_rows, dict(args.dim))
    if not routed.blocks:
        raise AutoparError(
            f"{model.name} has no gathered experts (GatherND of an expert stack, then MatMul): nothing written."
        )
    try:
        out.write_bytes(routed.model.SerializeToString())
    except OSError as exc:
        raise AutoparError(f"Cannot write {str(out)!r}: {exc.strerror or exc}.") from None
    sizes = {(block.experts, block.group_rows, block.capacity) for block in routed.blocks}
    experts, group, capacity = min(sizes)
    layers = len(routed.blocks)
    each = "each" if len(sizes) == 1 else "the first; the layers differ"
    print(
        f"autopar: wrote {out}: {layers} expert layer{'s' * (layers > 1)} dispatched ({experts} experts, {group}"
        f" routed rows a group, {capacity} slots an expert in {each}: capacity factor {args.capacity_factor:g},"
        " rows past it dropped)",
        file=sys.stderr,
    )
    if weights and out.resolve().parent != model.resolve().parent:
        print(
            f"autopar: warning: {model.name} keeps its weights in files beside it, which {out.name} names by the"
            " same relative paths: move it beside the model before running it",
            file=sys.stderr,
        )
    return 0


def _external_files(proto: Any, folder: Path) -> set[Path]:
    """The files a model's initializers keep their data in (resolved against the model's folder)."""
    files = set()
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                files.add((folder / entry.value).resolve())
    return files


def run_sweep(args: argparse.Namespace) -> int:
    check_out(args.out, args.model)
    import autopar
    from autopar.report.sweep import sweep_html

    if args.per_device_batch is not None and args.batch is not None:
        raise UsageError("--batch fixes the global batch and --per-device-batch each device's share: give one of them.")
    if args.per_device_batch is not None and args.per_device_batch * max(args.devices) > MAX_DIMENSION:
        raise UsageError(
            f"--per-device-batch {args.per_device_batch} at {max(args.devices):,} devices makes a global batch"
            f" over {MAX_DIMENSION:,}: give a smaller one."
        )
    line = ProgressLine.for_command(args.quiet)
    with warnings.catch_warnings(), progress.listening(line), line, stdout_elsewhere(True):
        warnings.simplefilter("ignore", AutoparWarning)
        points = autopar.sweep(
            args.model,
            args.devices,
            cost_model=args.cost_model,
            batch=args.batch,
            dims=dict(args.dim),
            precision=args.precision,
            optimizer=args.optimizer,
            memory_reserve=args.memory_reserve,
            per_device_batch=args.per_device_batch,
        )
    for point in points:
        say_plan_warnings(point.get("warnings", []), f"{point['devices']:,} devices: ")
    if args.out:
        emit(sweep_html(Path(args.model).stem, points, args.per_device_batch), args.out)
        print(f"autopar: wrote {args.out}", file=sys.stderr)
    text = json.dumps(points.to_list(), indent=2, allow_nan=False) + "\n" if args.format == "json" else str(points)
    write_stdout(text)
    return 0


def run_report(args: argparse.Namespace) -> int:
    check_out(args.out, args.model, args.plan, args.strategies, args.rank_table)
    import autopar
    from autopar.report.html import plan_report

    line = ProgressLine.for_command(args.quiet)
    with warnings.catch_warnings(record=True) as caught, progress.listening(line), line, stdout_elsewhere(True):
        warnings.simplefilter("always", AutoparWarning)
        if args.plan:
            plan_file = _reported_plan_file(args)
            page, said = plan_report(plan_file), plan_warnings(plan_file)
        else:
            result = autopar.api.plan_with(args.model, _searched_options(args))
            page, said = plan_report(result, autopar.api.comparison(result)), plan_warnings(result.file)
    say_warnings(caught, plan_says=True)
    say_plan_warnings(said)
    out = args.out or f"{Path(args.model).stem}.report.html"
    emit(page, out)
    print(f"autopar: wrote {out} ({len(page.encode('utf-8')):,} bytes)", file=sys.stderr)
    return 0


_SEARCH_FLAGS = {  # what --plan cannot take: each would search or cost another plan
    "rank_table": "--rank-table",
    "cost_model": "--cost-model",
    "precision": "--precision",
    "mode": "--mode",
    "fix": "--fix",
    "strategies": "--strategies",
    "search": "--search",
    "frozen": "--frozen",
    "trainable": "--trainable",
    "micro_batches": "--micro-batches",
    "pipeline_stages": "--pipeline-stages",
    "stage_starts": "--stage-starts",
    "recompute": "--recompute",
    "overlap": "--no-overlap",
    "optimizer": "--optimizer",
    "memory_reserve": "--memory-reserve",
}


def _reported_plan_file(args: argparse.Namespace) -> Any:
    """``report --plan FILE``: the plan file, checked to be made for the model (at its batch, on its devices).

    It is reported as it is: the comparisons that need its problem (stand-alone, each operator against data
    parallel) say they are not computed. Flags that would search another plan are a flag error (exit 2).
    """
    from autopar.lowering import load_plan_file
    from autopar.lowering.lower import check_context
    from autopar.lowering.program import plan_graph

    defaults = defaults_of("report")
    given = [flag for dest, flag in _SEARCH_FLAGS.items() if getattr(args, dest) != defaults[dest]]
    if given:
        raise UsageError(f"--plan reports the plan file as it was made, so it takes no {', '.join(given)}.")
    plan_file = load_plan_file(args.plan)
    graph = plan_graph(plan_file, args.model, args.batch, dict(args.dim))
    check_context(plan_file, graph, args.devices or plan_file.devices, action="be reported")
    return plan_file


def run_schema(args: argparse.Namespace) -> int:
    from autopar.lowering import json_schema

    write_stdout(json.dumps(json_schema(), indent=2) + "\n")
    return 0


def run_profiles(args: argparse.Namespace) -> int:
    """``profiles``: one line per bundled profile; ``profiles show NAME``: that profile's TOML, checked first."""
    from autopar.cost.profile import available_profiles, load_profile, profile_path

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoparWarning)  # a number without a source: said below
        if getattr(args, "name", None) is None:
            names = available_profiles()
            width = max(map(len, names))
            text = "".join(f"{name:<{width}}  {load_profile(name).description}\n" for name in names)
        else:
            load_profile(args.name)  # a malformed profile is one sentence, not a listing
            text = profile_path(args.name).read_text(encoding="utf-8")
    say_warnings(caught)
    write_stdout(text)
    return 0


COMMANDS = {
    "plan": run_plan,
    "verify": run_verify,
    "inspect": run_inspect,
    "schema": run_schema,
    "profiles": run_profiles,
    "export": run_export,
    "sweep": run_sweep,
    "report": run_report,
    "route": run_route,
}
