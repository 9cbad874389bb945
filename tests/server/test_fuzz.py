"""Fuzzed request bodies: plausible and implausible fields and types never make a 500 or a hang.

Generation length is always bounded (max_tokens is drawn from small or invalid values) so that an
accepted body finishes quickly on CPU; httpx's timeout turns a hang into a failure.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server_harness import MODEL_NAME

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()  # NaN and inf too: json.dumps writes them and json.loads reads them back
    | st.text(max_size=12)
)


def _containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)


anything = st.recursive(scalars, _containers, max_leaves=8)


# Bounded lengths, or values that must be rejected; never None, which means "up to max_model_len".
max_tokens = st.integers(-2, 4) | st.sampled_from(
    [0, 10**6, 2**63, 10**30, "3", 2.0, 2.5, True, False, [], {}, "lots", float("inf")]
)
text = st.text(max_size=30)
token_ids = st.lists(st.integers(0, 49_151), min_size=1, max_size=6)
stop = st.text(min_size=1, max_size=3)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "user", "system", "assistant", "tool", "wizard"]),
        "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text})),
    }
)

# Plausible values: mostly in range, sometimes just outside it.
common = {
    "n": st.integers(0, 3),
    "temperature": st.floats(0, 2.5),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 100_000),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2.5, 2.5),
    "frequency_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(0, 2),
    "seed": st.integers(-(2**64), 2**64),
    "stop": stop | st.lists(stop, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 60_000), max_size=3),
    "min_tokens": st.integers(0, 5),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "cache_salt": text,
    "logit_bias": st.dictionaries(text, st.floats(-100, 100), max_size=1),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "user": text,
    "prompt_logprobs": st.integers(-1, 21),
}
fields = {
    "/v1/completions": common
    | {
        "prompt": text | token_ids | st.lists(text, min_size=1, max_size=3) | st.lists(token_ids),
        "logprobs": st.integers(0, 21),
        "echo": st.booleans(),
        "best_of": st.integers(0, 2),
    },
    "/v1/chat/completions": common
    | {
        "messages": st.lists(message, min_size=1, max_size=3),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 21),
        "add_generation_prompt": st.booleans(),
        "max_completion_tokens": max_tokens,
    },
}


@st.composite
def requests(draw) -> tuple[str, dict]:
    """A valid base request, plausible optional fields, then 0-2 fields set to anything."""
    path = draw(st.sampled_from(sorted(fields)))
    body = {"model": MODEL_NAME, "max_tokens": draw(st.integers(1, 4))}
    if path == "/v1/completions":
        body["prompt"] = draw(st.text(min_size=1, max_size=30))
    else:
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=30))}]
    body |= draw(st.fixed_dictionaries({}, optional=fields[path]))
    names = sorted(fields[path]) + ["model", "max_tokens", "some_future_field"]
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        bounded = name in ("max_tokens", "max_completion_tokens")
        body[name] = draw(max_tokens if bounded else anything)
    return path, body


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=requests())
def test_fuzzed_bodies_never_500(http, request):
    path, body = request
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    event(f"{path} -> {r.status_code}")  # --hypothesis-show-statistics shows the mix
    assert r.status_code != 500 and r.status_code in (200, 400, 404, 413), r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif body.get("stream") is True:
        assert r.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in r.text
    else:
        assert r.json()["choices"]


def test_server_still_serves_after_the_fuzz(http):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200
    assert http.get("/health").status_code == 200
