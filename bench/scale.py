"""Planning at scale: wall time, peak memory and answer of the whole `autopar plan` command.

Usage: python bench/scale.py [--cases gpt3,gpt2,bert-large,resnet50,chain,plain-gpt3,batch1536,39b,llama,llama3]
                             [--devices 8,64,256,1024] [--timeout 600] [--scrambled]

Every case runs the real command line in a fresh process on an ONNX file written beforehand
(interpreter start-up, imports, import of the model, costing, search and JSON output
included) and reports its wall time, its own peak resident memory, the predicted step time,
the predicted MFU (ideal step time / step time: the step's FLOPs at the devices' peak over the
predicted step), the repeated blocks the search folded, and the distinct layouts and layout
pairs it costed. Transformers are built with models/transformer.py (weights elided), except:
"plain-gpt3" is GPT-3's shape from tests/plain_gpt.py, a second builder unlike ours (separate
Q/K/V, GELU written out, one mask initializer every layer reads); "batch1536" is GPT-3 175B at
its real global batch on ascend910 and a100; "39b" is Megatron-LM's 39B model at batch 1536 on
512 a100; "llama" is tests/torch_llama.py's plain torch.nn Llama (24 layers, hidden 2048, GQA,
rotary) exported by torch.onnx.export(dynamo=True) (needs torch and onnxscript); "llama3" is the same
module at Llama-3-8B's shape (32 layers, hidden 4096, 8 key-value heads, vocabulary 128,256, batch
64) on h100, with rotary in Hugging Face's ``rotate_half`` form and in the interleaved form (two
twin branches, `autopar.search.twins`), exported from the meta device. With
--scrambled each transformer is planned a second time with its node names replaced by a random
permutation, to show that repeated blocks are found from the structure alone. A case that is
refused (too large, nothing fits) says why in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.transformer import build_preset, build_transformer  # noqa: E402
from tests.plain_gpt import build_plain_gpt  # noqa: E402

GPT3 = dict(hidden=12288, heads=96, seq=2048, batch=64)
GPT3_175B = dict(hidden=12288, heads=96, seq=2048, vocab=51200)
MEGATRON_39B = dict(layers=48, hidden=8192, heads=64, seq=2048, vocab=51200)
LLAMA = dict(hidden=2048, heads=16, kv_heads=4, ffn=5632, seq=2048, vocab=32000, layers=24)
LLAMA3_8B = dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=2048, vocab=128256, layers=32)


def cases(selected: set[str]) -> list[tuple[str, str, int, str]]:
    """(label, model key, devices, cost model) in table order."""
    found: list[tuple[str, str, int, str]] = []
    if "gpt3" in selected:
        for layers in (1, 24, 96):
            for devices in (8, 64, 256, 1024):
                found.append((f"GPT-3 shape, {layers} layer(s)", f"gpt3:{layers}", devices, "ascend910"))
    if "plain-gpt3" in selected:
        for layers in (24, 96):
            found.append((f"GPT-3 shape, second builder, {layers} layers", f"plain:{layers}", 1024, "ascend910"))
    if "batch1536" in selected:
        for cost_model in ("ascend910", "a100"):
            found.append(("GPT-3 175B, batch 1536", "gpt3-1536", 1024, cost_model))
    if "39b" in selected:
        found.append(("Megatron 39B, batch 1536", "39b-1536", 512, "a100"))
    if "llama" in selected:
        for devices in (8, 256):
            found.append(("Llama (torch dynamo), 24 layers, batch 64", "llama", devices, "ascend910"))
    if "llama3" in selected:
        for rope in ("half", "interleaved"):
            for devices in (8, 64):
                found.append((f"Llama-3-8B (torch dynamo), {rope} rotary, batch 64", f"llama3:{rope}", devices, "h100"))
    if "gpt2" in selected:
        found.append(("GPT-2 (12 layers, batch 8)", "gpt2", 64, "ascend910"))
    if "bert-large" in selected:
        found.append(("BERT-large (24 layers, batch 8)", "bert-large", 64, "ascend910"))
    if "resnet50" in selected:
        for devices in (8, 64, 256, 1024):
            found.append(("ResNet-50 (batch 256)", "resnet50", devices, "ascend910"))
    if "chain" in selected:
        found.append(("20,000-operator Relu/Add chain", "chain", 8, "ascend910"))
    return found


def relu_add_chain(operators: int) -> onnx.ModelProto:
    """x -> Relu -> Add(relu, x) -> Relu -> ...: a residual chain of ``operators`` operators."""
    nodes, x = [], "X"
    for i in range(operators // 2):
        nodes.append(helper.make_node("Relu", [x], [f"r{i}"], name=f"relu{i}"))
        nodes.append(helper.make_node("Add", [f"r{i}", x], [f"a{i}"], name=f"add{i}"))
        x = f"a{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [64, 1024])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [64, 1024])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def model_for(key: str, folder: Path) -> onnx.ModelProto | Path | str:
    """The model of a case: built, a path, or a sentence saying why it cannot be made here."""
    if key.startswith("gpt3:"):
        return build_preset("gpt3", layers=int(key.split(":")[1]), **GPT3)
    if key.startswith("plain:"):
        return build_plain_gpt(
            layers=int(key.split(":")[1]), heads=96, hidden=12288, seq=2048, vocab=50304, batch=64, stored=False
        )
    if key == "gpt3-1536":
        return build_transformer(kind="gpt", layers=96, batch=1536, **GPT3_175B)
    if key == "39b-1536":
        return build_transformer(kind="gpt", batch=1536, **MEGATRON_39B)
    if key == "llama" or key.startswith("llama3:"):
        path = folder / f"{key.replace(':', '_')}.onnx"
        sizes, rope = (LLAMA, "half") if key == "llama" else (LLAMA3_8B, key.split(":")[1])
        return _export_llama(path, dict(sizes, batch=64, rope=rope))
    if key in ("gpt2", "bert-large"):
        return build_preset(key, batch=8)
    if key == "chain":
        return relu_add_chain(20_000)
    return ROOT / "models" / "resnet50.onnx"


def _export_llama(path: Path, arguments: dict) -> Path | str:
    """tests/torch_llama.py's export, in a process of its own: the planning processes forked from
    this one would otherwise report torch's peak memory as theirs."""
    code = (
        "import json, sys; from pathlib import Path; from tests.torch_llama import export;"
        " export(Path(sys.argv[1]), 'dynamo', **json.loads(sys.argv[2]))"
    )
    argv = [sys.executable, "-c", code, str(path), json.dumps(arguments)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return f"skipped: the export needs torch and onnxscript ({last[:120]})"
    return path


def scrambled(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    order = np.random.default_rng(0).permutation(len(copy.graph.node))
    for node, index in zip(copy.graph.node, order):
        node.name = f"op{index}"
    return copy


def run_case(
    path: Path, devices: int, timeout: float, cost_model: str = "ascend910", flags: tuple[str, ...] = ()
) -> dict:
    """Run `autopar plan` (with ``flags``) in a fresh process; wall seconds, peak RSS, and the plan or the
    refusal. The RSS is the process's own peak (the kernel's count) or, where larger, the most the process
    and any process it starts held together, sampled as it runs."""
    argv = [sys.executable, "-m", "autopar.cli", "plan", str(path), "--devices", str(devices)]
    argv += ["--cost-model", cost_model, *flags]
    argv += ["--format", "json", "--quiet"]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        child = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT)
        deadline = start + timeout
        status, usage = 0, None
        together = 0
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                child.kill()
                _, status, usage = os.wait4(child.pid, 0)
                rss = max(usage.ru_maxrss * 1024, together)
                return {"wall": time.perf_counter() - start, "rss": rss, "error": "time-out"}
            together = max(together, tree_rss(child.pid))
            time.sleep(0.05)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        result = {"wall": wall, "rss": max(usage.ru_maxrss * 1024, together)}
        if os.waitstatus_to_exitcode(status) != 0:
            message = err.read().decode(errors="replace").strip().splitlines()
            result["error"] = message[-1] if message else f"exit {os.waitstatus_to_exitcode(status)}"
            return result
        result["plan"] = json.loads(out.read())
        return result


def tree_rss(pid: int) -> int:
    """Bytes resident now in a process and its descendants (Linux's /proc; 0 where it cannot be read)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
        pending.extend(int(child) for child in children)
    return total


def row(label: str, devices: int, cost_model: str, result: dict, names: str) -> str:
    wall, rss = f"{result['wall']:.1f} s", f"{result['rss'] / 2**30:.2f} GiB"
    head = f"| {label} | {devices} | {cost_model} | {names} | {wall} | {rss}"
    if "error" in result:
        return f"{head} | refused: {result['error'][:150]} | | | | |"
    plan = result["plan"]
    totals, search = plan["totals"], plan["search"]
    mfu = totals["ideal_step_time_s"] / totals["step_time_s"] if totals["step_time_s"] else 0.0
    blocks = ", ".join(f"{b['copies']} x {b['operators']} ops" for b in search.get("repeated_blocks", [])) or "none"
    return (
        f"{head} | {totals['step_time_s'] * 1e3:.3f} ms | {mfu:.1%} | {blocks}"
        f" | {search.get('layouts', 0):,} | {search.get('layout_pairs', 0):,} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="gpt3,gpt2,bert-large,resnet50,chain")
    parser.add_argument("--devices", default="", help="only these device counts (default: every case's)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    parser.add_argument("--scrambled", action="store_true", help="plan each transformer again with scrambled names")
    args = parser.parse_args()
    print(
        "| model | devices | cost model | node names | wall | peak RSS | objective (step time) | MFU"
        " | repeated blocks | layouts | layout pairs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        written: dict[str, list[tuple[str, Path]]] = {}
        only = {int(d) for d in args.devices.split(",") if d}
        for label, key, devices, cost_model in cases(set(args.cases.split(","))):
            if only and devices not in only:
                continue
            if key not in written:
                model = model_for(key, Path(folder))
                if isinstance(model, str):
                    print(f"| {label} | {devices} | {cost_model} | | | | {model} | | | | |", flush=True)
                    continue
                if isinstance(model, Path):
                    written[key] = [("as built", model)]
                else:
                    path = Path(folder) / f"{key.replace(':', '_')}.onnx"
                    onnx.save(model, path)
                    written[key] = [("as built", path)]
                    if args.scrambled and key != "chain" and not key.startswith("llama"):
                        other = Path(folder) / f"{key.replace(':', '_')}_scrambled.onnx"
                        onnx.save(scrambled(model), other)
                        written[key].append(("scrambled", other))
            for names, path in written[key]:
                result = run_case(path, devices, args.timeout, cost_model)
                print(row(label, devices, cost_model, result, names), flush=True)


if __name__ == "__main__":
    main()
