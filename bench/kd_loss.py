"""Chunked knowledge-distillation loss benchmark: `python bench/chunked_ce.py --op kd` by its own name.

    python bench/kd_loss.py [--quick] [--repeats N] [--calls N] [--chunk-size C]

Ours (`posttrain.ops.kd.chunked_kd_loss`: both models' logits formed one chunk of positions
at a time) against the naive loss that holds the student's and the teacher's full `[T, V]`
logits (`posttrain.ops.kd.naive_kd_loss`: log-softmax of both, the divergence, the labels'
cross-entropy), at V = 151,936, hidden 1024 (student and teacher), 4,096 loss positions,
float32: forward KL at temperature 2, mixed half and half with the hard-label CE (`KD` in
bench/chunked_ce.py). Each measurement runs in its own child process (bench/chunked_ce.py's
docstring: peak memory above the inputs, time of forward + backward, gradients against the
naive ones). The last stdout line is one JSON object with `peak_mem_ratio` (naive / ours,
goal >= 5), `grad_max_rel_diff` (<= 1e-5) and `time_ratio` (ours / naive, <= 1.2), each with
its spread over `--repeats` rounds. Children run under glibc's default allocator settings
(the Makefile's `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...` are removed: under them the
naive side grew past this machine's 24 GiB). The full run takes about 6 minutes and 18 GiB.
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "--op", "kd", *sys.argv[1:]]
    runpy.run_path(str(Path(__file__).resolve().parent / "chunked_ce.py"), run_name="__main__")
