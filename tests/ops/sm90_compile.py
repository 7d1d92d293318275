"""Compile a ``@triton.jit`` kernel for sm_90 without a GPU and read its resource usage (test helper).

``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` builds PTX and a cubin offline, in a fresh process: the
test session may run Triton's interpreter (TRITON_INTERPRET=1), whose jit functions cannot be compiled.
``cuobjdump -res-usage`` (shipped with Triton's NVIDIA backend) gives registers, local memory (spills) and stack.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import triton

_SCRIPT = r"""
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constexprs, num_warps, out = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(module), name)
for param in kernel.params:  # defaulted constexprs left out get their defaults (not None)
    if param.is_constexpr and param.has_default and param.name not in constexprs:
        constexprs[param.name] = param.default
sig = dict(signature, **{k: "constexpr" for k in constexprs})
c = triton.compile(ASTSource(kernel, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": num_warps})
open(out + ".cubin", "wb").write(c.asm["cubin"])
open(out + ".ptx", "w").write(c.asm["ptx"])
"""


def _cuobjdump() -> str | None:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.path.exists(bundled) else shutil.which("cuobjdump")


def compile_sm90(module: str, kernel: str, signature: dict, constexprs: dict, num_warps: int) -> tuple[str, dict]:
    """-> (PTX text, {"REG", "LOCAL", "STACK": ints from cuobjdump, "SASS": instruction count}).

    module / kernel: where the ``@triton.jit`` function lives (e.g. "megamoe.kernels.moe_router",
    "_moe_topk_kernel"); signature: the runtime arguments' types ("*fp32", "i32", ...); constexprs: their values.
    Skips the test when no cuobjdump is available.
    """
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "kernel")
        args = json.dumps([module, kernel, signature, constexprs, num_warps, out])
        subprocess.run([sys.executable, "-c", _SCRIPT, args], env=env, check=True, timeout=600, cwd=root)
        ptx = open(out + ".ptx").read()
        usage = subprocess.run([tool, "-res-usage", out + ".cubin"], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tool, "-sass", out + ".cubin"], capture_output=True, text=True, check=True).stdout
    res = {key: int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "LOCAL", "STACK")}
    res["SASS"] = sum(1 for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", line))
    return ptx, res
