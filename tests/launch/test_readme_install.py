"""The README's install text says what the torch pin does: the version, not the build; the quick
start stays the commands the CPU suite is run with."""
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_torch_pin_is_described_truthfully():
    assert "python -m pip install torch==2.13.0 -e . && dmoe-train" in README
    assert 'python -m pip install torch==2.13.0 -e ".[test]" && python -m pytest' in README
    assert "pins the CPU build" not in README
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in README
