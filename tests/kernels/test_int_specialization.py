"""Static audit: no launched kernel calls ``.to()`` / ``.dtype`` / ``.shape`` on an int argument Triton may specialize.

Triton (3.6) turns an int kernel argument whose value is 1 into a compile-time constant. A constant has no ``.to()``,
so a kernel that casts such an argument builds for every value except 1, and fails only on the GPU (the interpreter
does not specialize). This is how a V4 model of one decode slot failed to build ``_window_step_kernel``
(``num_slots.to(tl.int64)``). The fix is ``do_not_specialize=[...]`` on the kernel, or a cast that does not need a
tensor.

The audit parses every ``@triton.jit`` / ``@gluon.jit`` function in ``megamoe/`` and follows arguments into the jit
helpers they are passed to (by position or keyword, to a fixed point). For every kernel that some module launches
(``name[grid](...)``), it reports a non-constexpr argument that reaches ``.to`` / ``.dtype`` / ``.shape`` / ``.type``
unless the argument is in ``do_not_specialize``. Arguments named ``*_ptr`` / ``*_desc`` are pointers or descriptors,
never ints, and are skipped. In the kernel's own body it also reports an expression cast, ``(s * num_rows).to(...)``,
made only of its arguments, constants and ``range`` / ``static_range`` loop variables (a constant too when the
arguments are): no call or subscript, which would make a tensor. Such expressions passed to helpers are not followed.
"""
from __future__ import annotations

import ast
import pathlib
import re

import megamoe

PACKAGE = pathlib.Path(megamoe.__file__).parent
TENSOR_ATTRS = ("to", "dtype", "shape", "type")


def _jit_functions(sources: dict[str, str]) -> dict[str, list[tuple[str, ast.FunctionDef, set[str]]]]:
    """Name -> [(file, function, do_not_specialize names)] of every function with a decorator ending in ``jit``."""
    found: dict[str, list] = {}
    for file, text in sources.items():
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, ast.FunctionDef):
                continue
            is_jit, unspecialized = False, set()
            for decorator in fn.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if not ast.unparse(target).endswith("jit"):
                    continue
                is_jit = True
                for keyword in getattr(decorator, "keywords", []):
                    if keyword.arg == "do_not_specialize":
                        unspecialized |= set(ast.literal_eval(keyword.value))
            if is_jit:
                found.setdefault(fn.name, []).append((file, fn, unspecialized))
    return found


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.args]


def _runtime_params(fn: ast.FunctionDef) -> set[str]:
    return {a.arg for a in fn.args.args if not (a.annotation is not None and "constexpr" in ast.unparse(a.annotation))}


def _tensor_only_params(functions) -> dict[tuple[str, int], set[str]]:
    """(function name, index) -> its parameters that reach a tensor-only attribute, directly or through helpers."""
    reach = {(name, i): set() for name, versions in functions.items() for i in range(len(versions))}
    changed = True
    while changed:
        changed = False
        for name, versions in functions.items():
            for i, (_, fn, _) in enumerate(versions):
                params, hits = _params(fn), reach[(name, i)]
                before = len(hits)
                for node in ast.walk(fn):
                    if (isinstance(node, ast.Attribute) and node.attr in TENSOR_ATTRS
                            and isinstance(node.value, ast.Name) and node.value.id in params):
                        hits.add(node.value.id)
                    if not isinstance(node, ast.Call):
                        continue
                    callee = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    for j, (_, helper, _) in enumerate(functions.get(callee, [])):
                        helper_params, helper_hits = _params(helper), reach[(callee, j)]
                        passed = list(zip(helper_params, node.args)) + [(k.arg, k.value) for k in node.keywords]
                        for helper_param, value in passed:
                            if isinstance(value, ast.Name) and value.id in params and helper_param in helper_hits:
                                hits.add(value.id)
                changed |= len(hits) != before
    return reach


def _constant_expression_casts(fn: ast.FunctionDef) -> set[str]:
    """Runtime arguments of ``fn`` inside a cast expression that holds nothing else but arguments, constants and loop
    variables of ``range`` / ``static_range`` (so a constant when the arguments are specialized)."""
    params = set(_params(fn))
    loop_vars = {node.target.id for node in ast.walk(fn)
                 if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Call)
                 and ast.unparse(node.iter.func).endswith("range")}
    found = set()
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Attribute) and node.attr in TENSOR_ATTRS and not isinstance(node.value, ast.Name)):
            continue
        if any(isinstance(part, (ast.Call, ast.Subscript)) for part in ast.walk(node.value)):
            continue
        names = {part.id for part in ast.walk(node.value) if isinstance(part, ast.Name)}
        if names <= params | loop_vars | {"tl", "gl"}:
            found |= names & params
    return found


def specializable_casts(sources: dict[str, str]) -> list[str]:
    """``file:line kernel(arg)`` for each launched kernel argument that would break when Triton specializes it."""
    functions = _jit_functions(sources)
    reach = _tensor_only_params(functions)
    everything = "\n".join(sources.values())
    problems = []
    for name, versions in functions.items():
        if not re.search(r"\b" + re.escape(name) + r"\s*\[", everything):
            continue  # a helper, never launched: its callers' arguments are what get specialized
        for i, (file, fn, unspecialized) in enumerate(versions):
            for param in sorted((reach[(name, i)] | _constant_expression_casts(fn)) & _runtime_params(fn)):
                if param in unspecialized or param.endswith(("_ptr", "_desc")):
                    continue
                problems.append(f"{file}:{fn.lineno} {name}({param})")
    return problems


def _package_sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_launched_kernel_casts_a_specializable_int():
    problems = specializable_casts(_package_sources())
    assert not problems, "int arguments cast in a kernel without do_not_specialize (a value of 1 would not build):\n" \
        + "\n".join(problems)


_SYNTHETIC = '''
import triton
import triton.language as tl

@triton.jit
def _helper(count, x):
    return count.to(tl.int64) + x

@triton.jit{decorator_args}
def _kernel(out_ptr, count, BLOCK: tl.constexpr):
    tl.store(out_ptr, _helper(count, 1))

def launch(out, count):
    _kernel[(1,)](out, count, BLOCK=16)
'''


_SYNTHETIC_EXPRESSION = '''
import triton
import triton.language as tl

@triton.jit{decorator_args}
def _kernel(out_ptr, rows, cols, BLOCK: tl.constexpr):
    for s in tl.static_range(2):
        tl.store(out_ptr + (s * rows).to(tl.int64) + (tl.program_id(0) * cols).to(tl.int64), 1)

def launch(out, rows, cols):
    _kernel[(1,)](out, rows, cols, BLOCK=16)
'''


def test_audit_flags_a_cast_through_a_helper_and_accepts_do_not_specialize():
    """The audit must see the bug it exists for: the cast one helper deep, fixed only by ``do_not_specialize``."""
    flagged = specializable_casts({"synthetic.py": _SYNTHETIC.format(decorator_args="")})
    assert flagged == ["synthetic.py:10 _kernel(count)"]
    fixed = specializable_casts({"synthetic.py": _SYNTHETIC.format(decorator_args='(do_not_specialize=["count"])')})
    assert fixed == []


def test_audit_flags_a_constant_expression_cast():
    """``(s * rows).to(...)`` over a ``static_range`` variable is a constant when ``rows`` is 1; the cast of an
    expression holding ``tl.program_id`` is a tensor's and is not flagged."""
    flagged = specializable_casts({"synthetic.py": _SYNTHETIC_EXPRESSION.format(decorator_args="")})
    assert flagged == ["synthetic.py:6 _kernel(rows)"]
    fixed = specializable_casts(
        {"synthetic.py": _SYNTHETIC_EXPRESSION.format(decorator_args='(do_not_specialize=["rows"])')})
    assert fixed == []
