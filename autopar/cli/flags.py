"""The command line's flags: one parser, every command's flags and help, each value checked into one sentence.

A bad flag exits 2 with ``autopar: error: ...`` and a pointer to ``--help``, never a usage dump.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.graph.experts import GROUP_ROWS
from autopar.limits import MAX_DEVICES, MAX_DIMENSION, MAX_MICRO_BATCHES, MAX_SEED
from autopar.options import Mode, Optimizer, Precision, Runtime, SearchAlgorithm
from autopar.units import parse_bytes


class UsageError(AutoparError):
    """Flags that cannot go together, found once they are read: exit 2, as argparse's own errors."""


def check_out(out: str | None, *reads: str | None) -> None:
    """Refuse, before any work, an ``--out`` nothing could be written to: a directory, or a file in a folder
    that does not exist (one sentence, exit 2, where writing would have failed after the whole search), or a
    file the command reads (``reads``: the model first, then a plan or strategies file), which writing would
    destroy.

    >>> check_out(".")
    Traceback (most recent call last):
    ...
    autopar.cli.flags.UsageError: --out '.' is a directory: name a file to write.
    """
    if not out:
        return
    target = Path(out)
    if target.is_dir():
        raise UsageError(f"--out {out!r} is a directory: name a file to write.")
    folder = target.parent
    if str(folder) and not folder.is_dir():
        raise UsageError(f"--out {out!r} is in a folder that does not exist ({str(folder)!r}).")
    if target.is_symlink() and not target.exists() and not target.resolve().parent.is_dir():
        raise UsageError(f"--out {out!r} is a link into a folder that does not exist.")
    for index, read in enumerate(reads):
        if read and target.exists() and Path(read).exists() and target.samefile(read):
            what = "the model itself" if index == 0 else f"{read!r}, which this command reads"
            raise UsageError(f"--out {out!r} is {what}: name another file.")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one sentence instead of a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse prefixes "argument --devices: " to a sentence that already names the flag
        message = re.sub(r"^argument (?:\S+/)?(\S+): (?=\1\b)", "", message)
        # a flag's text may hold a line break or another control character (--dim $'N\r=8'): shown escaped,
        # the sentence stays on one line
        message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        flag = re.fullmatch(r"argument (?:\S+/)?(--\S+): expected one argument", message)
        if flag:  # its value began with "-" (--memory-reserve -4GB), which argparse takes for another flag
            message += f"; a value that starts with '-' goes as {flag.group(1)}=VALUE"
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
    name, sep, value = text.rpartition("=")  # a computed size's key names a tensor, which may hold "="
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
    """``1,8,64``: device counts, each a power of two and given once (exit 2 otherwise)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"--devices expects device counts such as 1,8,64, got {text!r}")
    counts = [_devices(part) for part in parts]
    twice = sorted({count for count in counts if counts.count(count) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"--devices names {', '.join(map(str, twice))} more than once, got {text!r}")
    return counts


def _batch(text: str) -> int:
    return _integer("--batch", text, 1, MAX_DIMENSION)


def _per_device_batch(text: str) -> int:
    return _integer("--per-device-batch", text, 1, MAX_DIMENSION)


def _top(text: str) -> int:
    return _integer("--top", text, 1, MAX_DIMENSION)


def _micro_batches(text: str) -> int:
    return _integer("--micro-batches", text, 1, MAX_MICRO_BATCHES)


def _pipeline_stages(text: str) -> int:
    stages = _integer("--pipeline-stages", text, 1, MAX_DEVICES)
    if stages & (stages - 1):
        raise argparse.ArgumentTypeError(f"--pipeline-stages must be a power of two (1, 2, 4, ...), got {text!r}")
    return stages


def _operator_names(text: str) -> list[str]:
    """``layer4.0,layer8.0``: operator names, comma-separated (exit 2 when empty)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"--stage-starts expects operator names such as h4.ln1,h8.ln1, got {text!r}")
    return names


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


def _capacity_factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"--capacity-factor must be a positive number, not {text!r}")
    return value


def _group_rows(text: str) -> int:
    return _integer("--group-rows", text, 1, MAX_DIMENSION)


def _seed(text: str) -> int:
    return _integer("--seed", text, 0, MAX_SEED)


def _port(text: str) -> int:
    return _integer("--port", text, 1024, 65535)


def _timeout(text: str) -> float:
    return float(_integer("--timeout", text, 1, 24 * 3600))


def _memory_reserve(text: str) -> float:
    """``4GB``, ``512MiB``, ``0``: device memory a plan leaves free (exit 2 otherwise)."""
    value = parse_bytes(text)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"--memory-reserve must be a size such as 4GB, 512MiB or 0 (decimal KB/MB/GB/TB or binary"
            f" KiB/MiB/GiB/TiB; a bare number is bytes), got {text!r}"
        )
    if 0 < value < 2**20 and text.strip().replace(".", "", 1).isdigit():  # a bare number: bytes, and no reserve
        raise argparse.ArgumentTypeError(
            f"--memory-reserve {text} is {text} bytes, less than a megabyte: write its unit ({text}GB, {text}GiB)"
        )
    return value


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="ONNX model file")
    parser.add_argument("--batch", type=_batch, help="override the leading dimension of the data inputs")
    _add_dim_argument(
        parser, "bind a symbolic input dimension, or a size computed from data as TENSOR:AXIS=VALUE (repeatable)"
    )


def _add_dim_argument(parser: argparse.ArgumentParser, explained: str) -> None:
    parser.add_argument("--dim", type=_dim_binding, action="append", default=[], metavar="NAME=VALUE", help=explained)


DEVICES_HELP = "number of devices, a power of two (default 8, or the rank table's count)"
RANK_TABLE_HELP = "MindSpore's rank_table.json: the device count and the servers that set the link levels"
COST_MODEL_HELP = "a bundled profile's name (ascend910, a100, h100; any case) or a .toml file (default ascend910)"
PRECISION_HELP = (
    "mixed: fp16 compute with fp32 master weights (default); fp32: everything in fp32; fp8: mixed, with the"
    " matrix products in fp8 as Transformer Engine runs them (profiles with fp8 units: h100, h200)"
)
OPTIMIZER_HELP = (
    "the optimizer whose state each trainable parameter keeps: adam (two fp32 moments; 16 bytes a parameter in"
    " mixed precision) or sgd (momentum; 12 bytes); default: the cost model's (sgd in the bundled ones)"
)
MEMORY_RESERVE_HELP = (
    "device memory plans leave free for workspace, communication buffers and fragmentation, e.g. 4GB or 0"
    " (default: the cost model's, a tenth of the device's memory in the bundled ones)"
)
FORMAT_HELP = "table: for people (default); json: for programs, on stdout alone"


def _names(kind: type[Mode] | type[Precision] | type[SearchAlgorithm] | type[Runtime] | type[Optimizer]) -> list[str]:
    """A flag's choices: the enum's names, as argparse lists them in its one-sentence error."""
    return [member.value for member in kind]


def _add_target_arguments(parser: argparse.ArgumentParser, rank_table: bool = True) -> None:
    """What a plan is made for besides the model: the hardware profile and the precision (and the devices)."""
    if rank_table:
        parser.add_argument("--devices", type=_devices, help=DEVICES_HELP)
        parser.add_argument("--rank-table", metavar="FILE", help=RANK_TABLE_HELP)
    parser.add_argument("--cost-model", default="ascend910", metavar="NAME|FILE.toml", help=COST_MODEL_HELP)
    parser.add_argument("--precision", choices=_names(Precision), default=Precision.MIXED.value, help=PRECISION_HELP)
    _add_memory_arguments(parser)


def _add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """What training keeps in device memory besides the plan's tensors: the optimizer's state and a reserve."""
    parser.add_argument("--optimizer", choices=_names(Optimizer), help=OPTIMIZER_HELP)
    parser.add_argument("--memory-reserve", type=_memory_reserve, metavar="SIZE", help=MEMORY_RESERVE_HELP)


def _add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """How a plan is searched: mode, fixed strategies, solver, frozen parameters, micro-batches, overlap."""
    parser.add_argument(
        "--mode",
        choices=_names(Mode),
        default=Mode.AUTO_PARALLEL.value,
        help="MindSpore's parallel mode: auto_parallel searches every operator (default); semi_auto_parallel"
        " searches around the strategies --fix and --strategies give; data_parallel splits the batch"
        " everywhere; stand_alone runs every operator whole on every device",
    )
    parser.add_argument(
        "--fix",
        type=_fixed_strategy,
        action="append",
        default=[],
        metavar="OP=STRATEGY",
        help="keep this operator's in_strategy, search the rest (semi_auto_parallel; repeatable)",
    )
    parser.add_argument(
        "--strategies", metavar="FILE.json", help="fixed strategies as a JSON object {operator: in_strategy}"
    )
    parser.add_argument(
        "--search",
        choices=_names(SearchAlgorithm),
        default=SearchAlgorithm.DP.value,
        help="dp (elimination DP, default) or ilp (exact ILP cross-check, needs autopar[ilp])",
    )
    parser.add_argument(
        "--frozen",
        action="append",
        default=[],
        metavar="NAME",
        help="a parameter not to train (a name or a shell glob such as 'embed.*'; repeatable)",
    )
    parser.add_argument(
        "--trainable",
        action="append",
        default=[],
        metavar="NAME",
        help="a float constant to train though the import took it for a mask or table (a name or glob; repeatable)",
    )
    parser.add_argument(
        "--pipeline-stages",
        type=_pipeline_stages,
        help="cut the model into this many pipeline stages (a power of two), each on its own group of devices"
        " over the slowest links (default: searched; 1 keeps one stage)",
    )
    parser.add_argument(
        "--micro-batches",
        type=_micro_batches,
        help="run the batch as this many micro-batches: 1F1B across pipeline stages, gradient accumulation in"
        " one stage (default: searched with the stages)",
    )
    parser.add_argument(
        "--stage-starts",
        type=_operator_names,
        metavar="OP[,OP...]",
        help="the first operator of every pipeline stage after the first (fixes the cuts and so the stage count)",
    )
    parser.add_argument(
        "--recompute",
        action="store_const",
        const=True,
        help="recompute every repeated block's forward in the backward pass, as Megatron-LM's activation"
        " recomputation does (default: only where memory binds)",
    )
    parser.add_argument(
        "--no-overlap",
        dest="overlap",
        action="store_false",
        help="add every gradient synchronisation to the step (default: it overlaps the backward pass)",
    )


def _add_format_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("table", "json"), default="table", help=FORMAT_HELP)


def _add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress line on stderr (it shows on a terminal once the work has taken two seconds)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description="Auto-parallel strategy search for ONNX models.")
    parser.add_argument("--version", action="version", version=f"autopar {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    plan = commands.add_parser("plan", help="search a sharding plan")
    _add_model_arguments(plan)
    _add_target_arguments(plan)
    _add_search_arguments(plan)
    _add_format_argument(plan)
    plan.add_argument(
        "--top",
        type=_top,
        default=10,
        metavar="N",
        help="after the decisions, the table lists the N costliest operators (default 10)",
    )
    plan.add_argument("--all", action="store_true", help="the table lists every operator, in graph order")
    plan.add_argument("-o", "--out", help="write the output to this file instead of stdout")
    _add_quiet_argument(plan)

    verify = commands.add_parser("verify", help="run a plan on virtual devices and compare with one device")
    _add_model_arguments(verify)
    verify.add_argument("--devices", type=_devices, help=DEVICES_HELP)
    verify.add_argument("--rank-table", metavar="FILE", help=RANK_TABLE_HELP)
    verify.add_argument(
        "--plan",
        help="a plan JSON file (from 'autopar plan --format json'); default: the model's sharding annotations"
        " (from 'autopar export --to onnx'), else search one",
    )
    _add_memory_arguments(verify)
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
    _add_format_argument(verify)
    _add_quiet_argument(verify)

    sweep = commands.add_parser("sweep", help="plan at several device counts: throughput, scaling, MFU, memory")
    _add_model_arguments(sweep)
    sweep.add_argument(
        "--devices", type=_device_list, default=[1, 8, 64, 512], help="device counts, e.g. 1,8,64,512 (the default)"
    )
    sweep.add_argument(
        "--per-device-batch",
        type=_per_device_batch,
        metavar="B",
        help="weak scaling: the global batch is B times the devices at each count (default: the model's batch,"
        " or --batch, at every count)",
    )
    _add_target_arguments(sweep, rank_table=False)
    _add_format_argument(sweep)
    sweep.add_argument("-o", "--out", help="write a self-contained HTML page with the charts to this file")
    _add_quiet_argument(sweep)

    report = commands.add_parser("report", help="plan, then write the plan's report as one self-contained HTML page")
    _add_model_arguments(report)
    _add_target_arguments(report)
    _add_search_arguments(report)
    report.add_argument(
        "--plan",
        metavar="FILE",
        help="report this plan file (from 'autopar plan --format json') instead of searching one; it must be"
        " made for the model",
    )
    report.add_argument("-o", "--out", help="the page to write (default: MODEL.report.html in this folder)")
    _add_quiet_argument(report)

    inspect = commands.add_parser("inspect", help="summarise a model: operators, parameters, FLOPs")
    _add_model_arguments(inspect)
    _add_format_argument(inspect)
    _add_quiet_argument(inspect)

    export = commands.add_parser(
        "export", help="write a plan in a framework's own form (onnx, mindspore, dtensor, jax)"
    )
    export.add_argument("plan", help="a plan JSON file (from 'autopar plan --format json')")
    export.add_argument("--to", required=True, choices=("onnx", "mindspore", "dtensor", "jax"), help="the format")
    export.add_argument("-o", "--out", help="the file to write (default: named after the model, here)")
    export.add_argument("--model", help="the ONNX model the plan was made for (needed by --to onnx)")
    _add_quiet_argument(export)

    _add_route_command(commands)

    commands.add_parser("schema", help="print the JSON Schema of plan files")

    profiles = commands.add_parser("profiles", help="list the bundled hardware profiles ('profiles show NAME': one)")
    shown = profiles.add_subparsers(dest="profiles_command", metavar="show", parser_class=_Parser)
    show = shown.add_parser("show", help="check a profile and print it (its TOML, every number with its source)")
    show.add_argument("name", metavar="NAME", help="a bundled profile (see 'autopar profiles') or a .toml file")
    return parser


def _add_route_command(commands: Any) -> None:
    """``route``: gathered experts written as GShard's dispatch (`autopar.graph.experts`)."""
    route = commands.add_parser(
        "route", help="write gathered experts (Hugging Face's batched_mm) as GShard's dispatch, so plans split them"
    )
    route.add_argument("model", help="ONNX model file")
    _add_dim_argument(route, "bind a symbolic input dimension other than the batch (a symbolic batch is per sample)")
    route.add_argument(
        "--capacity-factor",
        type=_capacity_factor,
        default=1.25,
        metavar="F",
        help="each expert's slots in a group, as a multiple of an even share of the group's routed rows; rows past"
        " them are dropped, as in GShard (default 1.25; experts / top-k or more drops none)",
    )
    route.add_argument(
        "--group-rows",
        type=_group_rows,
        default=GROUP_ROWS,
        metavar="N",
        help=f"the most routed rows (tokens times top-k) a group holds (default {GROUP_ROWS})",
    )
    route.add_argument(
        "-o",
        "--out",
        help="the model to write (default: MODEL_routed.onnx beside the model, where its external weights are found)",
    )
    _add_quiet_argument(route)


def defaults_of(command: str) -> dict[str, Any]:
    """Every flag's default value for ``command`` (by destination), as its parser holds them."""
    return vars(build_parser().parse_args([command, "MODEL"]))


def _version() -> str:
    from autopar import __version__

    return __version__
