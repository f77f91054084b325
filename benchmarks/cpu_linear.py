"""torch's linear layer against rlhf's oneDNN one (`rlhf.fastpaths.cpu_linear`) on this CPU: forward
alone (decoding, log-prob forwards) and forward + backward (training), per shape, as ratios.

The shapes are those of the benchmarks' `small` model (hidden 256, MLP 1024) in a training
micro-batch (290 tokens) and a decode step (32 rows), and one of a larger model (hidden 1024,
MLP 4096, 1024 tokens); ``--sweep``: rows 32-546 against the layer shapes of `small`,
`vocab152k` (hidden 512, MLP 2048) and the larger model. ``--layers N`` cycles the products over
N layers' weights, which then stream from memory as in a step instead of staying in the cache.
Each timing is the median of interleaved repeats, so the two sides see the same machine load. Usage:

    python benchmarks/cpu_linear.py [--threads 1] [--repeats 30] [--sweep] [--layers 4]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

SHAPES = [  # (rows M, in K, out N)
    (290, 256, 1024), (290, 1024, 256), (290, 256, 256),
    (32, 256, 1024), (32, 1024, 256), (32, 256, 256),
    (1024, 1024, 4096), (1024, 4096, 1024),
]
SWEEP = [(rows, fan_in, fan_out) for rows in (32, 64, 128, 256, 546)
         for fan_in, fan_out in ((256, 256), (256, 1024), (1024, 256), (512, 512), (512, 2048), (2048, 512),
                                 (1024, 4096))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--sweep", action="store_true", help="rows 32-546 against seven layer shapes")
    parser.add_argument("--layers", type=int, default=1, help="products cycled over this many layers' weights")
    args = parser.parse_args()
    threads = benchlib.setup_environment(args.threads)
    import torch

    from rlhf.fastpaths.cpu_linear import onednn_available, onednn_pays, use_onednn_linears

    print(benchlib.machine_line(threads))
    if not onednn_available():
        sys.exit("this torch has no oneDNN kernels")
    print(f"--cpu-linear auto picks {'oneDNN' if onednn_pays() else 'torch'} on this CPU")
    print(f"times per product, over {args.layers} layer(s)' weights")
    print(f"{'M x K -> N':>20}{'forward torch/oneDNN (us)':>28}{'ratio':>7}{'fwd+bwd torch/oneDNN (us)':>29}{'ratio':>7}")
    for rows, fan_in, fan_out in SWEEP if args.sweep else SHAPES:
        torch.manual_seed(0)
        plain = torch.nn.ModuleList(torch.nn.Linear(fan_in, fan_out, bias=False) for _ in range(args.layers))
        fast = copy.deepcopy(plain)
        use_onednn_linears(fast, "onednn")
        x = torch.randn(rows, fan_in, requires_grad=True)
        upstream = torch.randn(rows, fan_out)

        def forward(layers: torch.nn.ModuleList) -> None:
            with torch.no_grad():
                for layer in layers:
                    layer(x)

        def train(layers: torch.nn.ModuleList) -> None:
            for layer in layers:
                layer(x).backward(upstream)

        cells = []
        for work in (forward, train):
            times: dict[str, list[float]] = {"torch": [], "onednn": []}
            for _ in range(args.repeats):
                for name, layer in (("torch", plain), ("onednn", fast)):
                    start = time.perf_counter()
                    for _ in range(5):
                        work(layer)
                    times[name].append((time.perf_counter() - start) / (5 * args.layers) * 1e6)
            mkl, dnnl = statistics.median(times["torch"]), statistics.median(times["onednn"])
            cells.append(f"{mkl:13.0f} / {dnnl:<12.0f}{mkl / dnnl:6.2f}x")
        print(f"{f'{rows} x {fan_in} -> {fan_out}':>20}  {cells[0]}  {cells[1]}")


if __name__ == "__main__":
    main()
