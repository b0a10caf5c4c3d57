"""The compiled kernels' traced graphs can be kept in the compiler's cache of traced graphs (AOTAutograd's
cache, next to Inductor's cache of generated code). A graph it cannot keep (one that makes a tensor from
Python numbers, say) is traced again in every new process: seconds per kernel at each server's warm-up and
in each one-shot run that compiles."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Every kernel the warm-ups build (the common schemes, HQQ among them, and every ggml type with and without
# an importance matrix), traced by a backend that runs AOTAutograd's cacheability check on each graph and
# then runs the graph as traced (no code generation: the check is what is tested, not the kernels).
_PROBE = r"""
import torch
from torch._functorch._aot_autograd.autograd_cache import check_cacheable

from quantd.engine import kernels
from quantd.io import pipeline
from quantd.io.outputs import gguf
from quantd_client import Scheme

traced = []


def backend(gm, example_inputs):
    check_cacheable(gm)  # raises, naming the operation, for a graph the cache cannot keep
    traced.append(gm)
    return gm.forward


real_compile = torch.compile


def compile_checked(fn, **kwargs):
    kwargs.pop("options", None)
    return real_compile(fn, backend=backend, **kwargs)


torch.compile = compile_checked  # what the kernels are compiled with
kernels.KERNELS.reset(available=True)
gguf.WARM_UP_SHAPES = ((256, 1024),)  # one statistics chunk: every kernel, the sub-block scales' search included
pipeline.warm_up((*pipeline.WARMUP_SCHEMES, Scheme(dtype="int4", granularity="group", group_size=32,
                                                   observer="mse")))
gguf.warm_up_gguf()
assert kernels.KERNELS._broken is None, kernels.KERNELS._broken
print("graphs", len(traced))
"""


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("c++"), reason="needs a C++ compiler: without one no kernel is compiled")
def test_every_compiled_kernel_graph_is_cacheable(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "QUANTD_COMPILE": "1"}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    graphs = int(out.stdout.split("graphs")[-1])
    assert graphs >= 20, out.stdout  # the k-quant searches, settles and statistics, HQQ, the common schemes
