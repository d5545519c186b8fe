"""A missing optional package (transformers, tiktoken, safetensors) is one line naming the extra
that installs it, exit 2, before anything is built. The packages are blocked in a subprocess
(sys.modules[name] = None makes both import and importlib's find_spec fail), one for all checks."""
import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys
    for name in ("transformers", "tiktoken", "safetensors"):
        sys.modules[name] = None
    from megatron_dmoe.cli import train_main
    from megatron_dmoe.export.cli import export_main

    def call(main, argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit:
                code = exit.code
        return [code, err.getvalue()]

    data = ["data.data_path=[corpus_text_document]", "data.tokenizer_model=tok"]
    print(json.dumps({
        "transformers": call(train_main, ["data.tokenizer_type=HuggingFaceTokenizer", *data]),
        "tiktoken": call(train_main, ["data.tokenizer_type=TikTokenizer", *data]),
        "safetensors": call(export_main, [sys.argv[1], sys.argv[2], "--format", "hf"]),
    }))
""")

EXTRAS = {"transformers": "megatron-dmoe[tokenizers]", "tiktoken": "megatron-dmoe[tiktoken]",
          "safetensors": "megatron-dmoe[hf]"}


def test_missing_optional_packages_name_their_extra(tmp_path):
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "no_run"), str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for package, (code, stderr) in results.items():
        message = stderr.strip()
        assert code == 2, (package, message)
        assert len(message.splitlines()) == 1 and "Traceback" not in message, (package, message)
        assert f"{package}" in message and EXTRAS[package] in message, (package, message)
    assert not out.exists()
