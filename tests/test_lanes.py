"""The lanes of tests/lanes.py: every entry of its lists names a test file or folder here, and
none of the test files MCORE_FREE lists imports megatron-core itself (one that does can tell versions apart
and belongs in CI's megatron-core 0.19 leg)."""
import ast
from pathlib import Path

from lanes import MCORE_FREE, QUICK_PROCESSES, STARTS_PROCESSES

TESTS = Path(__file__).resolve().parent


def _listed_files():
    for entry in MCORE_FREE:
        path = TESTS / entry
        yield from sorted(path.rglob("test_*.py")) if entry.endswith("/") else [path]


def _imports_megatron_core(path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(name == "megatron" or name.startswith("megatron.") for name in names):
            return True
    return False


def test_every_entry_exists():
    missing = [entry for entry in [*MCORE_FREE, *QUICK_PROCESSES]
               if not ((TESTS / entry).is_dir() if entry.endswith("/") else (TESTS / entry).is_file())]
    assert not missing, f"tests/lanes.py names what is not there: {missing}"


def test_no_megatron_core_free_test_imports_megatron_core():
    importing = [str(path.relative_to(TESTS)) for path in _listed_files() if _imports_megatron_core(path)]
    assert not importing, f"these import megatron-core; take them out of MCORE_FREE: {importing}"


def test_starting_a_process_marks_a_module_slow():
    for source in ("import subprocess", "cmd = [sys.executable, '-m', 'torch.distributed.run']",
                   "from process_group import run_in_processes", "proc = Popen(cmd)"):
        assert STARTS_PROCESSES.search(source), source
    assert not STARTS_PROCESSES.search("from megatron_dmoe.config import load_config")
