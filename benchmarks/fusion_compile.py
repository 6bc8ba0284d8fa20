"""Would ``torch.compile`` pay for the exchange's element-wise passes? Eager against compiled, one thread.

    python benchmarks/fusion_compile.py [--sizes 1e6 1e7 2.5e7] [--repeats 15]

Two kernels of the exchange, written with the same in-place eager operations as the package uses and
as one function for inductor to fuse:

* error feedback and block peaks: ``p = g + e`` into a kept buffer, then ``max |p|`` per block of 64;
* DGC's state: ``u = m·u + g``, ``v += u`` in place, then the block peaks of ``v``.

Printed: median milliseconds and passes (÷ one copy of the tensor, measured in the same run), the time of
the first compiled call (compilation; inductor caches it on disk, so a second run is faster), and
whether the compiled results equal eager's bit for bit.
"""

from __future__ import annotations

import argparse
import time

import torch

from _timing import median_seconds, memory_pass_seconds, print_table

BLOCK = 64


def peaks_eager(values: torch.Tensor) -> torch.Tensor:
    grid = values.view(-1, BLOCK)
    return torch.maximum(grid.amax(1), grid.amin(1).neg_())


def error_feedback_eager(g: torch.Tensor, e: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    torch.add(g, e, out=out)
    return peaks_eager(out)


def error_feedback_fusable(g: torch.Tensor, e: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    p = g + e
    out.copy_(p)
    grid = p.view(-1, BLOCK)
    return torch.maximum(grid.amax(1), -grid.amin(1))


def dgc_eager(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, m: float) -> torch.Tensor:
    torch.add(g, u, alpha=m, out=u)
    v.add_(u)
    return peaks_eager(v)


def dgc_fusable(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, m: float) -> torch.Tensor:
    u_new = torch.add(g, u, alpha=m)
    v_new = v + u_new
    u.copy_(u_new)
    v.copy_(v_new)
    grid = v_new.view(-1, BLOCK)
    return torch.maximum(grid.amax(1), -grid.amin(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 2.5e7])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    compiled_ef = torch.compile(error_feedback_fusable, dynamic=True)
    compiled_dgc = torch.compile(dgc_fusable, dynamic=True)
    rows = []
    for size in args.sizes:
        n = int(size) // BLOCK * BLOCK
        generator = torch.Generator().manual_seed(0)
        g, e, u, v = (torch.randn(n, generator=generator) for _ in range(4))
        out, out_compiled, u2, v2 = torch.empty(n), torch.empty(n), u.clone(), v.clone()
        unit = memory_pass_seconds(g, args.repeats)
        began = time.perf_counter()
        same_ef = torch.equal(compiled_ef(g, e, out_compiled), error_feedback_eager(g, e, out))
        same_ef = same_ef and torch.equal(out, out_compiled)
        same_dgc = torch.equal(compiled_dgc(g, u2, v2, 0.9), dgc_eager(g, u, v, 0.9))
        same_dgc = same_dgc and torch.equal(u, u2) and torch.equal(v, v2)
        first = time.perf_counter() - began
        for name, eager, compiled, same in [
            ("EF add + peaks", lambda: error_feedback_eager(g, e, out), lambda: compiled_ef(g, e, out_compiled),
             same_ef),
            ("DGC u, v + peaks", lambda: dgc_eager(g, u, v, 0.9), lambda: compiled_dgc(g, u2, v2, 0.9), same_dgc),
        ]:
            eager_s = median_seconds(eager, args.repeats)
            compiled_s = median_seconds(compiled, args.repeats)
            rows.append([f"{n / 1e6:g}M", name, f"{eager_s * 1e3:.2f} ({eager_s / unit:.1f})",
                         f"{compiled_s * 1e3:.2f} ({compiled_s / unit:.1f})", f"{eager_s / compiled_s:.2f}x",
                         "yes" if same else "no", f"{first:.1f} s"])
    print(f"# eager vs torch.compile (inductor), 1 thread, torch {torch.__version__}; ms (passes)\n")
    print_table(["size", "kernel", "eager", "compiled", "speed-up", "bit-identical", "first calls"], rows)


if __name__ == "__main__":
    main()
