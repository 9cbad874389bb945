"""Quiet mismatches of issue 31, now each a 400 that names the field and says what is allowed:
stop_token_ids outside the vocabulary, and a prompt of none of the accepted shapes."""

from __future__ import annotations

from server_harness import MODEL_NAME, assert_error


def test_stop_token_ids_outside_the_vocabulary(http):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1, "stop_token_ids": [10**9]}
    error = assert_error(http.post("/v1/completions", json=body), 400, "stop_token_ids")
    assert "in [0, 49152)" in error["message"]
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
    chat |= {"max_tokens": 1, "stop_token_ids": [49152]}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, "stop_token_ids")


def test_a_negative_token_id_is_named_with_what_a_prompt_may_be(http):
    body = {"model": MODEL_NAME, "prompt": [-1], "max_tokens": 1}
    error = assert_error(http.post("/v1/completions", json=body), 400, "prompt")
    assert error["message"] == "prompt: prompt[0] is -1: token ids are integers >= 0"
    body["prompt"] = [[3, 4], [5, "x"]]
    error = assert_error(http.post("/v1/completions", json=body), 400, "prompt")
    assert "prompt[1][1] is 'x': the prompt must be a string, a list of strings" in error["message"]
    assert "more problems" not in error["message"]
