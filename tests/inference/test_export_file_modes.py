"""dmoe-export's files are all created alike: model.safetensors (safetensors creates it 0600) gets the
mode config.json got from the umask."""
import stat


def test_every_exported_file_has_the_same_mode(exported):
    out = exported["dense"]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {modes["config.json"]}, {name: oct(mode) for name, mode in modes.items()}
