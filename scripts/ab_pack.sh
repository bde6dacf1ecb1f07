#!/usr/bin/env bash
# Here, before an A/B device call (scripts/gpu_ab_python.sh): packs the base version of every file
# the working tree changes against BASE (default HEAD) into .devpack/ab_base/ (files the working
# tree adds are listed in .devpack/ab_base.added), so that the device rebuilds the base tree from
# its copy of this one without git.
#   scripts/ab_pack.sh [BASE]
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-HEAD}
rm -rf .devpack/ab_base .devpack/ab_base.added
mkdir -p .devpack/ab_base
: > .devpack/ab_base.added
git diff --name-status --no-renames "$base" -- src include python CMakeLists.txt cmake |
  while read -r status path; do
    if [ "$status" = A ]; then
      echo "$path" >> .devpack/ab_base.added
    else
      mkdir -p ".devpack/ab_base/$(dirname "$path")"
      git show "$base:$path" > ".devpack/ab_base/$path"
    fi
  done
git ls-files --others --exclude-standard -- src include python >> .devpack/ab_base.added
echo "base $(git rev-parse --short "$base"): $(find .devpack/ab_base -type f | wc -l) files," \
  "$(wc -l < .devpack/ab_base.added) added"
