r"""Train a sentencepiece tokenizer for megatron_dmoe (byte fallback: any text round-trips).

Writes OUT_PREFIX.model and OUT_PREFIX.vocab. The same inputs, flags and seed give the same model.
Pieces: <unk>=0, <s>=1, </s>=2 (end of document), <pad>=3.

Example:
  python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 32000 --out-prefix tok
"""
import argparse
import sys
import warnings
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="training text: files or folders; *.jsonl/*.json files are JSONL "
                        "(fields from --json-keys), everything else plain text")
    p.add_argument("--vocab-size", type=int, required=True,
                   help="number of pieces, specials and the 256 byte pieces included")
    p.add_argument("--out-prefix", required=True,
                   help="output path prefix: writes OUT_PREFIX.model and OUT_PREFIX.vocab")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                   help="sentencepiece algorithm (default bpe: fast to train)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="JSONL fields to learn from (default: text)")
    p.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="lines sampled for training, 0 = all (default 2000000)")
    p.add_argument("--character-coverage", type=float, default=0.9999,
                   help="share of characters given their own piece; the rest fall back to "
                        "bytes (default 0.9999)")
    p.add_argument("--max-sentence-length", type=int, default=16384,
                   help="longer lines (in bytes) are left out of training (default 16384)")
    p.add_argument("--threads", type=int, default=None,
                   help="training threads (default: the CPU count, at most 16)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the line sampling (default 0)")
    p.add_argument("--verbose", action="store_true", help="show sentencepiece's training log")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # imported after parsing so that --help answers at once; megatron-core warns on import
    # about optional accelerators that tokenizer training does not use
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron_dmoe.data.errors import DataError
    from megatron_dmoe.data.sentencepiece_tokenizer import train_tokenizer

    try:
        model = train_tokenizer(
            [Path(p) for p in args.input], args.vocab_size, args.out_prefix,
            model_type=args.model_type, json_keys=args.json_keys,
            input_sentence_size=args.input_sentence_size,
            character_coverage=args.character_coverage,
            max_sentence_length=args.max_sentence_length, num_threads=args.threads,
            seed=args.seed, verbose=args.verbose,
        )
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
