"""The `autopar` command line: plan, verify, inspect, schema, profiles (reads the core; the core never prints)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopar import progress
from autopar.errors import (
    AutoparError,
    AutoparWarning,
    FixedStrategyError,
    UnknownDimensionError,
    UnknownSymbolError,
)
from autopar.limits import MAX_DEVICES, MAX_DIMENSION, MAX_MICRO_BATCHES, MAX_SEED
from autopar.options import DEFAULT_COST_MODEL, Mode, PlanOptions, Precision, Runtime, SearchAlgorithm


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one sentence instead of a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"autopar: error: {message} (see '{self.prog} --help').\n")


def _integer(flag: str, text: str, low: int, high: int) -> int:
    """An integer flag within [low, high], or one sentence saying what is wrong (exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{flag} must be from {low:,} to {high:,}, got {value}")
    return value


def _dim_binding(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--dim expects name=value, got {text!r}")
    return name, _integer(f"--dim {name}", value, 1, MAX_DIMENSION)


def _devices(text: str) -> int:
    value = _integer("--devices", text, -(1 << 62), 1 << 62)
    if not 1 <= value <= MAX_DEVICES or value & (value - 1):
        raise argparse.ArgumentTypeError(
            f"--devices must be a power of two from 1 to {MAX_DEVICES:,} (1, 2, 4, 8, ...), got {value}"
        )
    return value


def _device_list(text: str) -> list[int]:
    """``1,8,64``: device counts, each a power of two (exit 2 otherwise)."""
    counts = [_devices(part.strip()) for part in text.split(",") if part.strip()]
    if not counts:
        raise argparse.ArgumentTypeError(f"--devices expects device counts such as 1,8,64, got {text!r}")
    return counts


def _batch(text: str) -> int:
    return _integer("--batch", text, 1, MAX_DIMENSION)


def _top(text: str) -> int:
    return _integer("--top", text, 1, MAX_DIMENSION)


def _micro_batches(text: str) -> int:
    return _integer("--micro-batches", text, 1, MAX_MICRO_BATCHES)


def _fixed_strategy(text: str) -> tuple[str, Any]:
    """``OP=((2,4,1,1),(1,4,1,1))``: an operator and the in_strategy it must keep (exit 2 when malformed)."""
    name, sep, value = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            f"--fix expects OP=STRATEGY such as 'conv1=((8,1,1,1),(1,1,1,1))', got {text!r}"
        )
    try:
        strategy = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise argparse.ArgumentTypeError(
            f"--fix {name}: the strategy must be a tuple of integer tuples such as ((8,1,1,1),(1,1,1,1)), got {value!r}"
        ) from None
    return name, strategy


def _seed(text: str) -> int:
    return _integer("--seed", text, 0, MAX_SEED)


def _port(text: str) -> int:
    return _integer("--port", text, 1024, 65535)


def _timeout(text: str) -> float:
    return float(_integer("--timeout", text, 1, 24 * 3600))


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="ONNX model file")
    parser.add_argument("--batch", type=_batch, help="override the leading dimension of the data inputs")
    parser.add_argument(
        "--dim",
        type=_dim_binding,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="bind a symbolic input dimension (repeatable)",
    )


DEVICES_HELP = "number of devices, a power of two (default 8, or the rank table's count)"
RANK_TABLE_HELP = "MindSpore's rank_table.json: the device count and the servers that set the link levels"


def _options(args: argparse.Namespace, **fields: Any) -> PlanOptions:
    """The checked options the flags ask for: --devices (default 8), or --rank-table's count and servers."""
    cost_model = getattr(args, "cost_model", DEFAULT_COST_MODEL)
    return PlanOptions.resolve(
        args.devices, cost_model, args.rank_table or None, devices_said_as="--devices ", **fields
    )


def _names(kind: type[Mode] | type[Precision] | type[SearchAlgorithm] | type[Runtime]) -> list[str]:
    """A flag's choices: the enum's names, as argparse lists them in its one-sentence error."""
    return [member.value for member in kind]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description="Auto-parallel strategy search for ONNX models.")
    parser.add_argument("--version", action="version", version=f"autopar {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    plan = commands.add_parser("plan", help="search a sharding plan")
    _add_model_arguments(plan)
    plan.add_argument("--devices", type=_devices, help=DEVICES_HELP)
    plan.add_argument("--rank-table", metavar="FILE", help=RANK_TABLE_HELP)
    plan.add_argument("--cost-model", default="ascend910", help="bundled profile name or a .toml file")
    plan.add_argument("--mode", choices=_names(Mode), default=Mode.AUTO_PARALLEL.value)
    plan.add_argument("--precision", choices=_names(Precision), default=Precision.MIXED.value)
    plan.add_argument(
        "--fix",
        type=_fixed_strategy,
        action="append",
        default=[],
        metavar="OP=STRATEGY",
        help="keep this operator's in_strategy, search the rest (semi_auto_parallel; repeatable)",
    )
    plan.add_argument(
        "--strategies", metavar="FILE.json", help="fixed strategies as a JSON object {operator: in_strategy}"
    )
    plan.add_argument(
        "--search",
        choices=_names(SearchAlgorithm),
        default=SearchAlgorithm.DP.value,
        help="dp (elimination DP, default) or ilp (exact ILP cross-check, needs autopar[ilp])",
    )
    plan.add_argument(
        "--frozen",
        action="append",
        default=[],
        metavar="NAME",
        help="a parameter not to train (a name or a shell glob such as 'embed.*'; repeatable)",
    )
    plan.add_argument(
        "--micro-batches",
        type=_micro_batches,
        help="accumulate gradients over this many micro-batches of the batch (default: 1, or the fewest of"
        " 2, 4, ... that fit when nothing fits in one)",
    )
    plan.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="add every gradient synchronisation to the step (default: it overlaps the backward pass)",
    )
    plan.add_argument("--format", choices=("table", "json"), default="table")
    plan.add_argument(
        "--top", type=_top, default=20, metavar="N", help="the table lists the N costliest operators (default 20)"
    )
    plan.add_argument("--all", action="store_true", help="the table lists every operator, in graph order")
    plan.add_argument("--out", help="write the output to this file instead of stdout")
    plan.add_argument("--quiet", action="store_true", help="no progress line on stderr")

    verify = commands.add_parser("verify", help="run a plan on virtual devices and compare with one device")
    _add_model_arguments(verify)
    verify.add_argument("--devices", type=_devices, help=DEVICES_HELP)
    verify.add_argument("--rank-table", metavar="FILE", help=RANK_TABLE_HELP)
    verify.add_argument(
        "--plan",
        help="a plan JSON file (from 'autopar plan --format json'); default: the model's sharding annotations"
        " (from 'autopar export --to onnx'), else search one",
    )
    verify.add_argument("--seed", type=_seed, default=0, help="seed for random weights and inputs")
    verify.add_argument(
        "--gradients",
        action="store_true",
        help="run the backward pass and the gradient synchronisation too, and check every parameter's gradient",
    )
    verify.add_argument(
        "--runtime",
        choices=_names(Runtime),
        default=Runtime.VIRTUAL.value,
        help="virtual: every rank in this process (default); torch: one torch.distributed process per rank"
        " (gloo on CPU, NCCL on GPUs), gradients always checked",
    )
    verify.add_argument("--port", type=_port, help="the torch runtime's TCP port on localhost (default: a free one)")
    verify.add_argument(
        "--timeout", type=_timeout, default=300.0, metavar="SECONDS", help="the torch runtime's limit per collective"
    )
    verify.add_argument("--format", choices=("table", "json"), default="table")

    sweep = commands.add_parser("sweep", help="plan at several device counts: throughput, scaling, MFU, memory")
    _add_model_arguments(sweep)
    sweep.add_argument(
        "--devices", type=_device_list, default=[1, 8, 64, 512], help="device counts, e.g. 1,8,64,512 (the default)"
    )
    sweep.add_argument("--cost-model", default="ascend910", help="bundled profile name or a .toml file")
    sweep.add_argument("--precision", choices=_names(Precision), default=Precision.MIXED.value)
    sweep.add_argument("--format", choices=("table", "json"), default="table")
    sweep.add_argument("-o", "--out", help="write a self-contained HTML page with the charts to this file")
    sweep.add_argument("--quiet", action="store_true", help="no progress line on stderr")

    report = commands.add_parser("report", help="plan, then write the plan's report as one self-contained HTML page")
    _add_model_arguments(report)
    report.add_argument("--devices", type=_devices, help=DEVICES_HELP)
    report.add_argument("--rank-table", metavar="FILE", help=RANK_TABLE_HELP)
    report.add_argument("--cost-model", default="ascend910", help="bundled profile name or a .toml file")
    report.add_argument("--precision", choices=_names(Precision), default=Precision.MIXED.value)
    report.add_argument("-o", "--out", help="the page to write (default: MODEL.report.html in this folder)")
    report.add_argument("--quiet", action="store_true", help="no progress line on stderr")

    inspect = commands.add_parser("inspect", help="summarise a model: operators, parameters, FLOPs")
    _add_model_arguments(inspect)
    inspect.add_argument("--format", choices=("table", "json"), default="table")

    export = commands.add_parser(
        "export", help="write a plan in a framework's own form (onnx, mindspore, dtensor, jax)"
    )
    export.add_argument("plan", help="a plan JSON file (from 'autopar plan --format json')")
    export.add_argument("--to", required=True, choices=("onnx", "mindspore", "dtensor", "jax"), help="the format")
    export.add_argument("-o", "--out", help="the file to write (default: named after the model, here)")
    export.add_argument("--model", help="the ONNX model the plan was made for (needed by --to onnx)")

    commands.add_parser("schema", help="print the JSON Schema of plan files")

    profiles = commands.add_parser("profiles", help="list the bundled hardware profiles ('profiles show NAME': one)")
    shown = profiles.add_subparsers(dest="profiles_command", metavar="show", parser_class=_Parser)
    show = shown.add_parser("show", help="check a profile and print it (its TOML, every number with its source)")
    show.add_argument("name", metavar="NAME", help="a bundled profile (see 'autopar profiles') or a .toml file")
    return parser


def _version() -> str:
    from autopar import __version__

    return __version__


def _emit(text: str, out: str | None) -> None:
    """Write to ``out``, or to stdout.

    A regular file (or a new one) is replaced atomically: a temporary file beside it, then a
    rename, so an interrupted run never leaves half a plan. Anything else (a symlink, a FIFO,
    /dev/stdout) is written through, as an ordinary write would.
    """
    if not out:
        sys.stdout.write(text)
        return
    target = Path(out)
    try:
        if target.is_symlink() or (target.exists() and not target.is_file()):
            with target.open("w", encoding="utf-8") as handle:
                handle.write(text)
            return
        _replace_atomically(target, text)
    except OSError as exc:
        raise AutoparError(f"Cannot write {out!r}: {exc.strerror or exc}.") from None


def _replace_atomically(target: Path, text: str) -> None:
    folder = target.parent if str(target.parent) else Path(".")
    try:
        handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed below, before the rename)
            "w", encoding="utf-8", dir=folder, prefix=f".{target.name}.", suffix=".tmp", delete=False
        )
    except PermissionError:  # a writable file in a folder we may not add to: write it in place
        target.write_text(text, encoding="utf-8")
        return
    temporary = Path(handle.name)
    try:
        with handle:
            handle.write(text)
        if target.exists():
            shutil.copymode(target, temporary)  # keep the file's own permissions
        else:
            umask = os.umask(0)
            os.umask(umask)
            temporary.chmod(0o666 & ~umask)  # as an ordinary write would leave it, not tempfile's 0600
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def _fixed(args: argparse.Namespace) -> dict[str, Any] | None:
    """The strategies ``--strategies FILE`` and ``--fix`` fix (``--fix`` wins for the same operator)."""
    fixed: dict[str, Any] = {}
    if args.strategies:
        try:
            data = json.loads(Path(args.strategies).read_text(encoding="utf-8"))
        except OSError as exc:
            raise FixedStrategyError(
                f"Strategies file {args.strategies!r} cannot be read: {exc.strerror or exc}."
            ) from None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise FixedStrategyError(f"Strategies file {args.strategies!r} is not JSON.") from None
        if not isinstance(data, dict):
            raise FixedStrategyError(
                f"Strategies file {args.strategies!r} must be a JSON object {{operator: in_strategy}}."
            )
        fixed.update(data)
    fixed.update(dict(args.fix))
    if fixed and args.mode not in ("auto_parallel", "semi_auto_parallel"):
        raise FixedStrategyError(f"--fix and --strategies need --mode semi_auto_parallel, not {args.mode}.")
    return fixed or None


def _run_plan(args: argparse.Namespace) -> int:
    import autopar
    from autopar.report import plan_table

    line = _ProgressLine(enabled=not args.quiet and sys.stderr.isatty())
    with warnings.catch_warnings(record=True) as caught, progress.listening(line), line:
        warnings.simplefilter("always", AutoparWarning)  # said below as one line each, in the CLI's words
        options = _options(
            args,
            batch=args.batch,
            mode=args.mode,
            dims=dict(args.dim),
            precision=args.precision,
            search=args.search,
            frozen=args.frozen,
            overlap=args.overlap,
            micro_batches=args.micro_batches,
            fixed=_fixed(args),
        )
        cluster = options.cluster
        result = autopar.api.plan_with(args.model, options)
        top = None if args.all else args.top
        text = result.to_json() + "\n" if args.format == "json" else plan_table(result, top)  # lowering reports too
    if cluster is not None and args.format == "table":  # the levels the rank table implies, under the title
        title, _, rest = text.partition("\n")
        text = f"{title}\ncluster: {cluster.describe()}\n{rest}"
    for warning in caught:
        if issubclass(warning.category, AutoparWarning):
            print(f"autopar: warning: {warning.message}", file=sys.stderr)
    _emit(text, args.out)
    return 0


class _ProgressLine:
    """One progress line on stderr (tqdm), shown once a run has taken about two seconds.

    Quiet with ``--quiet`` or when stderr is not a terminal; the line is erased at the end.
    """

    DELAY_S = 2.0

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.started = time.monotonic()
        self.phase: str | None = None
        self.bar: Any = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if phase != self.phase or self.bar is None or done < self.bar.n:
            self.close()
            from tqdm import tqdm

            delay = max(0.0, self.DELAY_S - (time.monotonic() - self.started))
            self.bar = tqdm(
                total=total, desc=f"autopar: {phase}", delay=delay, leave=False, file=sys.stderr, unit="", ncols=80
            )
            self.phase = phase
        self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "_ProgressLine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_inspect(args: argparse.Namespace) -> int:
    from autopar.graph import load_model
    from autopar.report import inspect_summary, inspect_table

    graph = load_model(args.model, batch=args.batch, dims=dict(args.dim))
    summary = inspect_summary(graph)
    text = json.dumps(summary, indent=2) + "\n" if args.format == "json" else inspect_table(summary)
    sys.stdout.write(text)
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    import autopar
    from autopar.lowering import load_plan_file
    from autopar.report import verify_table

    plan_file = load_plan_file(args.plan) if args.plan else None
    options = _options(args)
    devices, cost_model = options.num_devices, options.cost_model
    if plan_file is None:  # a model exported with --to onnx carries its plan: verify that one
        from autopar.export.onnx_sharding import annotated_devices
        from autopar.graph.read import read_model

        annotated = annotated_devices(read_model(args.model))
        if annotated is not None and args.devices is None and args.rank_table is None:
            devices = annotated
        if annotated == devices:
            print(f"autopar: verifying the plan annotated in {args.model} ({annotated} devices)", file=sys.stderr)
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
    )
    text = (
        json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"
        if args.format == "json"
        else verify_table(report)
    )
    sys.stdout.write(text)
    if not report.ok:
        print(f"autopar: error: the plan does not verify: {report.problems[0]}", file=sys.stderr)
    return 0 if report.ok else 1


def _run_export(args: argparse.Namespace) -> int:
    from autopar.export import export
    from autopar.graph import load_model
    from autopar.lowering import load_plan_file

    plan_file = load_plan_file(args.plan)
    model = None
    if args.model:  # imported at the batch the plan was made for, as the plan saw it
        shapes = list(plan_file.context.inputs.values()) if plan_file.context else []
        batch = shapes[0][0] if shapes and shapes[0] and all(s and s[0] == shapes[0][0] for s in shapes) else None
        model = load_model(args.model, batch=batch).model
    for path in export(plan_file, args.to, args.out, model):
        print(f"autopar: wrote {path}", file=sys.stderr)
    return 0


def _run_sweep(args: argparse.Namespace) -> int:
    import autopar
    from autopar.report.sweep import sweep_html, sweep_table

    line = _ProgressLine(enabled=not args.quiet and sys.stderr.isatty())
    with warnings.catch_warnings(), progress.listening(line), line:
        warnings.simplefilter("ignore", AutoparWarning)
        points = autopar.sweep(
            args.model,
            args.devices,
            cost_model=args.cost_model,
            batch=args.batch,
            dims=dict(args.dim),
            precision=args.precision,
        )
    if args.out:
        _emit(sweep_html(Path(args.model).stem, points), args.out)
        print(f"autopar: wrote {args.out}", file=sys.stderr)
    text = json.dumps(points, indent=2, allow_nan=False) + "\n" if args.format == "json" else sweep_table(points)
    sys.stdout.write(text)
    return 0


def _run_report(args: argparse.Namespace) -> int:
    import autopar
    from autopar.report.html import plan_report

    line = _ProgressLine(enabled=not args.quiet and sys.stderr.isatty())
    with warnings.catch_warnings(record=True) as caught, progress.listening(line), line:
        warnings.simplefilter("always", AutoparWarning)
        options = _options(args, batch=args.batch, dims=dict(args.dim), precision=args.precision)
        result = autopar.api.plan_with(args.model, options)
        page = plan_report(result, autopar.api.comparison(result))
    for warning in caught:
        if issubclass(warning.category, AutoparWarning):
            print(f"autopar: warning: {warning.message}", file=sys.stderr)
    out = args.out or f"{Path(args.model).stem}.report.html"
    _emit(page, out)
    print(f"autopar: wrote {out} ({len(page.encode('utf-8')):,} bytes)", file=sys.stderr)
    return 0


def _run_schema(args: argparse.Namespace) -> int:
    from autopar.lowering import json_schema

    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")
    return 0


def _in_flag_words(exc: AutoparError) -> str:
    """The core's sentence, with the flags a command-line user types instead of Python arguments."""
    if isinstance(exc, UnknownDimensionError) and exc.dimension is not None:
        return (
            f"Tensor {exc.tensor!r} has an unknown dimension {exc.dimension!r}; bind it with"
            f" --dim {exc.dimension}=VALUE (or --batch for the leading dimension)."
        )
    if isinstance(exc, UnknownDimensionError):
        return f"Tensor {exc.tensor!r} has an unknown shape; bind its dimensions with --batch or --dim."
    if isinstance(exc, UnknownSymbolError):
        have = f" (they have: {', '.join(exc.known)})." if exc.known else "."
        return f"--dim names {', '.join(exc.unknown)} but the model's inputs have no such symbolic dimension{have}"
    return str(exc)


def _run_profiles(args: argparse.Namespace) -> int:
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
    for warning in caught:
        if issubclass(warning.category, AutoparWarning):
            print(f"autopar: warning: {warning.message}", file=sys.stderr)
    sys.stdout.write(text)
    return 0


COMMANDS = {
    "plan": _run_plan,
    "verify": _run_verify,
    "inspect": _run_inspect,
    "schema": _run_schema,
    "profiles": _run_profiles,
    "export": _run_export,
    "sweep": _run_sweep,
    "report": _run_report,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except FixedStrategyError as exc:  # the user's own strategy: a flag's fault
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2
    except AutoparError as exc:
        print(f"autopar: error: {_in_flag_words(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a bug in autopar, not in the input: say so plainly
        if os.environ.get("AUTOPAR_DEBUG"):
            raise
        print(
            f"autopar: internal error: {type(exc).__name__}: {exc} (set AUTOPAR_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
