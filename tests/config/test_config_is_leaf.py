"""The run configuration loads and validates without megatron-core, triton or torch: a config is
checked (by dmoe-train before it starts, by the sweep tools, by editors' checks) in the time it takes
to read YAML. Each check runs in a fresh interpreter, where nothing else has imported them yet."""
import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = ROOT / "configs"
PACKAGE = ROOT / "megatron_dmoe"

HEAVY = ("megatron", "triton", "torch")


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120)


def _imported(script: str) -> list:
    """The heavy top-level modules in sys.modules after `script` (megatron_dmoe's own excluded)."""
    done = _run(textwrap.dedent(script) + textwrap.dedent(f"""
        import sys
        print(sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r})))
    """))
    assert done.returncode == 0, done.stderr[-3000:]
    return eval(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", [None, str(CONFIGS_DIR / "base.yaml")])
def test_loading_and_validating_a_shipped_config_imports_nothing_heavy(config):
    imported = _imported(f"""
        from megatron_dmoe.config import Environment, find_warnings, load_config, resolve, validate
        cfg = load_config({config!r})
        validate(cfg, world_size=1, env=Environment(cuda=False, transformer_engine=False, apex=False))
        validate(resolve(cfg), world_size=1, env=Environment(cuda=True, transformer_engine=True, apex=True))
        find_warnings(cfg, world_size=1, env=Environment(cuda=False, transformer_engine=False, apex=False))
    """)
    assert imported == []


def test_probing_the_machine_imports_torch_only():
    # Environment.detect asks torch whether CUDA is there
    imported = _imported("""
        from megatron_dmoe.config import load_config, validate
        validate(load_config(None), world_size=1)
    """)
    assert "megatron" not in imported and "triton" not in imported


def test_megatron_core_imported_after_this_package_is_quiet():
    """`import megatron_dmoe` no longer imports megatron-core, but still silences the notices it gives
    when any module first imports it (Transformer Engine and apex are optional here)."""
    done = _run("""
        import megatron_dmoe
        import sys
        assert "megatron.core" not in sys.modules
        import megatron.core
        import megatron.core.optimizer
        import megatron.core.models.gpt.gpt_layer_specs
    """)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]


def _imported_names(path: Path) -> set:
    """The absolute names a file imports (relative imports stay inside its own package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module)
    return names


def test_config_reaches_only_the_parallel_layout_rules_of_our_other_packages():
    """config/ imports no other package of ours but parallel/layout_rules.py, which imports nothing
    (no torch either), so validating a config still costs no more than reading it."""
    ours = {name for path in sorted((PACKAGE / "config").rglob("*.py")) for name in _imported_names(path)
            if name.startswith("megatron_dmoe.")}
    assert ours <= {"megatron_dmoe.parallel", "megatron_dmoe.parallel.layout_rules"}, sorted(ours)
    assert _imported_names(PACKAGE / "parallel" / "layout_rules.py") <= {"__future__"}
