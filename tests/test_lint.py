"""The repository passes `ruff check` (rules and per-file settings in ruff.toml)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args, cwd=ROOT):
    try:
        import ruff  # noqa: F401  (the package only ships the binary that `python -m ruff` finds)
    except ImportError:
        raise AssertionError("ruff is not installed; install the test extra: pip install -e '.[test]'") from None
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_repository_is_clean():
    result = ruff("--output-format", "concise", ".")
    assert result.returncode == 0, f"ruff check found problems:\n{result.stdout}{result.stderr}"


def test_the_configured_rules_report_findings(tmp_path):
    """The configuration is the one ruff reads, and its rules (pyflakes, pycodestyle, isort) are on."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\nx = '" + "y" * 130 + "'\n")
    result = ruff("--config", str(ROOT / "ruff.toml"), "--output-format", "concise", str(bad), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for code in ("F401", "I001", "E501"):
        assert code in result.stdout, result.stdout
