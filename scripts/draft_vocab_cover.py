"""How much of a text a draft scoring part of its vocabulary could propose (`spec.draft_vocab_tokens`).

    python scripts/draft_vocab_cover.py $M/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf \\
        --first 32768 65536 --files meshd/**/*.py docs/*.md

Tokenizes each group of files with the model's tokenizer and prints, per `--first` N, the
share of tokens whose id is N or more (what the draft's first N ids leave out) and the share
that is also new to its file so far (what the draft leaves out when it also scores every id
the request has seen, as meshd's draft does: each file stands for one request).
"""

from __future__ import annotations

import argparse
import glob
import pathlib

from meshd.model.files import open_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint or .gguf whose tokenizer to use")
    parser.add_argument("--first", type=int, nargs="+", default=[32768])
    parser.add_argument("--files", nargs="+", required=True, help="files or globs (** allowed)")
    args = parser.parse_args()
    tokenizer = open_tokenizer(args.model)
    paths = sorted({p for pattern in args.files for p in glob.glob(pattern, recursive=True)})
    texts = [tokenizer.encode(pathlib.Path(p).read_text(errors="ignore")) for p in paths]
    total = sum(len(ids) for ids in texts)
    print(f"{len(paths)} files, {total} tokens")
    for first in args.first:
        beyond = new = 0
        for ids in texts:
            seen: set[int] = set()
            for token in ids:
                if token >= first:
                    beyond += 1
                    new += token not in seen
                seen.add(token)
        print(
            f"first {first}: ids >= {first} {100 * beyond / total:.2f} %, "
            f"of those new to their file {100 * new / total:.2f} %"
        )


if __name__ == "__main__":
    main()
