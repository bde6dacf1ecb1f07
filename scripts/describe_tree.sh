#!/usr/bin/env bash
# One line naming the tree a device call ran: the checkout's commit, marked where the files differ
# from it (the device's copy of .git can be older than the working tree it received), and the
# stamp of the library's sources (scripts/source_stamp.sh), which names the tree either way.
cd "$(dirname "$0")/.." || exit 1
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if ! git diff --quiet HEAD -- . 2>/dev/null; then
  commit="$commit + changes (git older than the files?)"
fi
echo "commit $commit; sources $(scripts/source_stamp.sh | cut -c1-12); $(date -u +%FT%TZ)"
