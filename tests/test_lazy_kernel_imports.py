"""megatron_dmoe imports dmoe_kernels (and with it triton) inside the functions that launch kernels,
never while a module loads: triton is optional (Linux only, setup.py), and every module of the
package is imported when a model is built, which works on CPU without triton
(tests/model/test_without_triton.py checks that in a fresh process; this reads the source, so
the fast lane finds a module-level import too)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_dmoe"
KERNEL_PACKAGES = ("dmoe_kernels", "triton")


def _runs_on_import(tree: ast.Module):
    """The statements a module runs when it is imported: its body, and what if/try/with/class
    blocks hold, but not function bodies nor `if TYPE_CHECKING:` blocks."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending += node.orelse
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            pending += [child for child in getattr(node, field, []) if isinstance(child, ast.AST)]


def _kernel_imports(tree: ast.Module):
    for node in _runs_on_import(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] in KERNEL_PACKAGES for name in names):
            yield node.lineno


def test_no_module_imports_the_kernels_when_it_loads():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             for line in _kernel_imports(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, ("dmoe_kernels or triton imported at module level (import it inside the function "
                       "that launches the kernel):\n" + "\n".join(found))


def test_the_walk_finds_module_level_imports_only():
    tree = ast.parse("import os\n"
                     "from dmoe_kernels import ops\n"
                     "try:\n    import triton\nexcept ImportError:\n    pass\n"
                     "if TYPE_CHECKING:\n    import dmoe_kernels\n"
                     "class A:\n    import triton.language\n"
                     "def f():\n    import dmoe_kernels\n")
    assert sorted(_kernel_imports(tree)) == [2, 4, 10]
