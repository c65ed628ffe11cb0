#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter: $PYTHON, python3.12/python3.13 on PATH, or pyenv's.
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for c in "${PYTHON:-}" python3.12 python3.13 python3; do
  [ -n "$c" ] || continue
  p=$(command -v "$c" 2>/dev/null) || continue
  if ok "$p"; then echo "$p"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for d in $(ls -d "$root"/versions/3.12* "$root"/versions/3.13* 2>/dev/null | sort -V); do
    if ok "$d/bin/python"; then echo "$d/bin/python"; exit 0; fi
  done
fi
echo "error: no Python >= 3.12 found. Install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2
exit 1
