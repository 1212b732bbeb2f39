"""Measure how close one GPU's matmuls come to its peak as the smallest GEMM dimension shrinks.

Usage: python bench/gemm_efficiency.py --peak 989.4e12 [--dtype bf16] [--out gemm.json]

For each smallest dimension d (32 ... 8192) it times ``torch.matmul`` (CUDA, cuBLAS) on four shape
families whose other dimensions are 8192: square (d x d x d), thin rows (M = d), thin columns (N = d)
and a short contraction (K = d), and prints the achieved FLOP/s as a fraction of ``--peak``. The
fall-off the profiles use (``matmul_falloff`` in costmodels/*.toml) is the median over the
families of each fraction divided by the large-shape fraction. Needs a CUDA GPU and torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
LARGE = 8192


def shapes(d: int) -> dict[str, tuple[int, int, int]]:
    """(M, N, K) of each family at smallest dimension d."""
    return {"square": (d, d, d), "thin_m": (d, LARGE, LARGE), "thin_n": (LARGE, d, LARGE), "short_k": (LARGE, LARGE, d)}


def time_matmul(torch, m: int, n: int, k: int, dtype, repeats: int = 50) -> float:
    """Seconds per matmul, the median of ``repeats`` runs after a warm-up, timed with CUDA events."""
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    for _ in range(10):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak", type=float, required=True, help="the GPU's dense peak FLOP/s at --dtype")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--out", help="write the measurements as JSON here")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gemm_efficiency: no CUDA GPU")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = []
    for d in SIZES:
        for family, (m, n, k) in shapes(d).items():
            seconds = time_matmul(torch, m, n, k, dtype)
            fraction = 2.0 * m * n * k / seconds / args.peak
            rows.append(
                {"min_dim": d, "family": family, "m": m, "n": n, "k": k, "seconds": seconds, "fraction": fraction}
            )
            print(f"{family:8} M={m:5} N={n:5} K={k:5}: {fraction:6.1%} of peak", flush=True)
    large = statistics.median(r["fraction"] for r in rows if r["min_dim"] == LARGE)
    factors = {d: statistics.median(r["fraction"] for r in rows if r["min_dim"] == d) / large for d in SIZES}
    print(f"large-shape fraction of peak: {large:.3f} ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    for d, factor in factors.items():
        print(f"smallest dimension {d:5}: {factor:.3f} of the large-shape fraction")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "dtype": args.dtype,
                    "peak": args.peak,
                    "large_fraction": large,
                    "factors": factors,
                    "rows": rows,
                },
                handle,
                indent=2,
            )


if __name__ == "__main__":
    main()
