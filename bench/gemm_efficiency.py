"""Measured matrix-multiply efficiency on a GPU: achieved FLOP/s over the profile's peak, by shape.

Usage: python bench/gemm_efficiency.py [--peak 989.4e12] [--dtype bfloat16] [--out gemm.json]

The rows measured on an H200 (torch 2.11, CUDA 13) are kept in costmodels/measured/gemm_h200.json.

Needs torch with CUDA. Times ``A[m, k] @ B[k, n]`` with CUDA events (warm-up first, the median of
the timed repeats) for square shapes and for the per-device GEMMs of transformer layers split by
tensor parallelism (GPT-3's hidden 12288 and the 7.5B-39B models' 4096-8192, a micro-batch of 1-8
sequences of 2048 tokens), and prints one Markdown row per shape: m, n, k, the smallest of the
three, TFLOP/s and the fraction of ``--peak`` (989.4 TFLOP/s: H100/H200 SXM, dense BF16, NVIDIA's
datasheet). The cost model's matmul efficiency by shape comes from rows like these.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def shapes() -> list[tuple[int, int, int]]:
    """(m, n, k): square sizes, then transformer GEMMs per device (tokens x hidden x 3h or 4h / tp)."""
    found = [(s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192, 16384)]
    for hidden in (4096, 8192, 12288):
        for tp in (1, 2, 4, 8):
            for tokens in (2048, 8192, 16384):
                found.append((tokens, 4 * hidden // tp, hidden))  # MLP up-projection
                found.append((tokens, hidden, 4 * hidden // tp))  # MLP down-projection (k split)
    for tokens in (128, 512):
        found.append((tokens, 4096, 4096))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak", type=float, default=989.4e12, help="peak FLOP/s of the device (dense)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/gemm_efficiency.py needs a CUDA device.")
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, peak {args.peak / 1e12:.1f} TF/s")
    print("| m | n | k | smallest | TFLOP/s | of peak |")
    print("|---|---|---|---|---|---|")
    for m, n, k in shapes():
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        for _ in range(5):
            a @ b
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        seconds = statistics.median(times)
        flops = 2.0 * m * n * k / seconds
        rows.append({"m": m, "n": n, "k": k, "seconds": seconds, "flops": flops, "efficiency": flops / args.peak})
        print(f"| {m} | {n} | {k} | {min(m, n, k)} | {flops / 1e12:.1f} | {flops / args.peak:.3f} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
