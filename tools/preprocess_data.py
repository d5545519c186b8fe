r"""Tokenise JSONL or text files into megatron-core indexed datasets (.bin/.idx).

Writes `{output_prefix}_{key}_document.bin/.idx` per JSON key, the names Megatron-LM's own
preprocessing tool uses, so data made here works in Megatron-LM and the reverse. Every document
ends with the end-of-document token; empty documents are skipped and counted.

Example:
  python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
      --tokenizer-model tok.model --workers 4
  # then train with data.data_path=[data/corpus_text_document] data.tokenizer_model=tok.model
  python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
      --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt
  # then train with data.data_path=[data/corpus_text_document] data.tokenizer_type=GPT2BPETokenizer
  #     data.vocab_file=vocab.json data.merge_file=merges.txt
"""
import argparse
import sys
import warnings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="input files or folders (folders are read recursively in sorted order); "
                        "*.jsonl/*.json files are JSONL, everything else text (see --input-format)")
    p.add_argument("--output-prefix", required=True,
                   help="output path prefix; writes PREFIX_KEY_document.bin and .idx per JSON key")
    p.add_argument("--tokenizer-type", default=None, metavar="TYPE",
                   help="Megatron-LM's tokenizer type: GPT2BPETokenizer (--vocab-file, --merge-file), "
                        "HuggingFaceTokenizer (--tokenizer-model FOLDER), SentencePieceTokenizer / "
                        "GPTSentencePieceTokenizer / Llama2Tokenizer (--tokenizer-model), TikTokenizer "
                        "(--tokenizer-model), NullTokenizer (--vocab-size); default: a sentencepiece "
                        "--tokenizer-model")
    p.add_argument("--tokenizer-model", default=None, metavar="MODEL",
                   help="sentencepiece .model file (make one with tools/train_tokenizer.py), or the "
                        "file/folder of --tokenizer-type")
    p.add_argument("--vocab-file", default=None, metavar="FILE", help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", default=None, metavar="FILE", help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="NullTokenizer: ids 0..N-1 (documents are space-separated ids; the end of a "
                        "document is id N)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="JSONL fields to tokenise, one dataset each (default: text); text files "
                        "are written under the single key given here")
    p.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto",
                   help="how to read input files: by file suffix (auto, the default), or all as "
                        "JSONL, or all as text")
    p.add_argument("--split-lines", action="store_true",
                   help="text files: one document per line instead of one per file")
    p.add_argument("--glob", default=None, metavar="PATTERN",
                   help="in input folders, read only file names matching this pattern, "
                        "e.g. '*.jsonl' (default: every non-hidden file)")
    p.add_argument("--workers", type=int, default=1,
                   help="tokenising processes (default 1); any number gives the same output")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # imported after parsing so that --help answers at once; megatron-core warns on import
    # about optional accelerators that tokenising does not use
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron_dmoe.data.errors import DataError
    from megatron_dmoe.data.preprocess import preprocess_data

    try:
        stats = preprocess_data(
            args.input, args.output_prefix, args.tokenizer_model,
            tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
            vocab_size=args.vocab_size,
            json_keys=args.json_keys, input_format=args.input_format,
            split_lines=args.split_lines, glob=args.glob, workers=args.workers,
            progress=not args.no_progress,
        )
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for s in stats.values():
        print(f"{s.key}: {s.documents} documents, {s.tokens} tokens, {s.skipped} empty skipped "
              f"-> {s.prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
