# Sourced by latency_ab.sh and serve_ab.sh: a variant is a quoted string of bench arguments,
# e.g. "--passes=-rotary_into_attention" or '--kernel-config={"pdl":false}' (split at spaces,
# so JSON without them); the runs of all variants alternate round by round (A B A B ...) so
# that clock and power drift land on every variant.

# split_variant "<variant>": its words into the array ARGS; a word VAR=value (not a flag) goes
# into ENVS instead, set in the run's environment. No globbing: JSON's [ ] stay as written.
split_variant() {
  ENVS=() ARGS=()
  local - word
  set -f
  for word in $1; do
    if [[ $word == *=* && $word != -* ]]; then ENVS+=("$word"); else ARGS+=("$word"); fi
  done
}

# alternate <rounds> <run function> "<variant A>" "<variant B>" ...: calls
# `<run function> <label> <round> <variant>` for every round and variant, labels a, b, c, ...
alternate() {
  local rounds=$1 fn=$2 labels=(a b c d e f g h) round i
  shift 2
  local variants=("$@")
  for round in $(seq 1 "$rounds"); do
    for i in "${!variants[@]}"; do
      "$fn" "${labels[$i]}" "$round" "${variants[$i]}"
    done
  done
}
