"""Prompt token estimates read from the parsed request (``gateway.traffic.estimate``):
text by its UTF-8 length, token ids one each, media items at their per-item cost whatever
the size of their data."""

from __future__ import annotations

import base64

from gateway.traffic.estimate import (
    AUDIO,
    FILE,
    IMAGE,
    VIDEO,
    MediaCosts,
    data_url_kind,
    prompt_tokens,
)

COSTS = MediaCosts(image=700, audio=1500, video=4000, file=900)
BIG = base64.b64encode(bytes(300_000)).decode()  # 400,000 characters of base64


def tokens_of(*texts: str) -> int:
    """Text tokens of these keys and values together: UTF-8 bytes / 4, rounded up."""
    return -(-sum(len(t.encode()) for t in texts) // 4)


def test_text_counts_its_utf8_bytes_over_four():
    body = {"messages": [{"role": "user", "content": "x" * 400}]}
    assert prompt_tokens(body, COSTS) == tokens_of("messages", "role", "user", "content",
                                                   "x" * 400) == 106
    assert prompt_tokens({"p": "abc" * 5}, COSTS) == 4  # 16 bytes
    assert prompt_tokens({"p": "a"}, COSTS) == 1  # rounded up
    assert prompt_tokens({"p": "漢" * 100}, COSTS) == tokens_of("p", "漢" * 100) == 76
    assert prompt_tokens({}, COSTS) == 0
    # numbers, booleans and nulls outside token-id lists count nothing (their keys do)
    assert prompt_tokens({"t": 0.5, "m": 9, "s": True, "x": None}, COSTS) == 1


def test_token_id_lists_count_their_length():
    assert prompt_tokens({"p": list(range(60_000))}, COSTS) == 60_001  # + the key
    assert prompt_tokens([[1, 2, 3], [4, 5]], COSTS) == 5
    assert prompt_tokens([[7] * 10, "abcdefgh"], COSTS) == 12
    assert prompt_tokens([True, False], COSTS) == 0  # not ids


def test_chat_media_parts_cost_per_item_never_by_their_data():
    parts = [
        {"type": "text", "text": "abcd" * 5},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + BIG}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": BIG, "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/mp3;base64," + BIG}},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + BIG}},
        {"type": "file", "file": {"file_data": "data:application/pdf;base64," + BIG}},
        {"type": "image_embeds", "image_embeds": BIG},
    ]
    body = {"messages": [{"role": "user", "content": parts}]}
    text = tokens_of("messages", "role", "user", "content", "type", "text", "text", "abcd" * 5)
    assert prompt_tokens(body, COSTS) == text + 3 * 700 + 2 * 1500 + 4000 + 900


def test_untyped_parts_and_other_fields_of_media_names():
    """vLLM reads ``{"image_url": ...}`` without ``type``; vLLM's ``prompt_embeds`` (a
    base64 tensor) is an item, not text."""
    assert prompt_tokens({"image_url": "https://e.com/a.png"}, COSTS) == 700
    assert prompt_tokens({"video_url": {"url": "data:video/mp4;base64," + BIG}}, COSTS) == 4000
    assert prompt_tokens({"prompt_embeds": BIG}, COSTS) == 900
    assert prompt_tokens({"image_url": None}, COSTS) == 0


def test_responses_api_input_items():
    body = {
        "instructions": "abcd" * 3,
        "input": [
            {"role": "user", "content": [
                {"type": "input_text", "text": "abcd" * 4},
                {"type": "input_image", "image_url": "data:image/jpeg;base64," + BIG,
                 "detail": "high"},
                {"type": "input_image", "file_id": "file-123"},
                {"type": "input_file", "file_data": BIG, "filename": "a.pdf"},
            ]},
        ],
    }
    text = tokens_of("instructions", "abcd" * 3, "input", "role", "user", "content", "type",
                     "input_text", "text", "abcd" * 4)
    assert prompt_tokens(body, COSTS) == text + 2 * 700 + 900


def test_anthropic_shaped_blocks_and_tool_schemas():
    """vLLM also serves Anthropic's Messages API: its ``image`` / ``document`` blocks are
    items; a tool's schema with a property named ``image`` is text, not an item."""
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": BIG}},
              {"type": "document", "source": {"type": "base64", "data": BIG}}]
    assert prompt_tokens(blocks, COSTS) == 700 + 900
    tool = {"type": "function", "function": {"name": "look", "parameters": {
        "type": "object", "properties": {"image": {"type": "string"}}}}}
    assert prompt_tokens(tool, COSTS) == tokens_of(
        "type", "function", "function", "name", "look", "parameters", "type", "object",
        "properties", "image", "type", "string")


def test_any_other_data_url_is_an_item_of_its_mime_type():
    assert data_url_kind("data:image/png;base64,AAAA") == IMAGE
    assert data_url_kind("data:audio/wav;base64,AAAA") == AUDIO
    assert data_url_kind("data:video/mp4;base64,AAAA") == VIDEO
    assert data_url_kind("data:application/pdf;base64,AAAA") == FILE
    # a data URL that is not a base64 medium is text: "data:text/plain,hi" is 18 bytes
    assert data_url_kind("data:text/plain,hi") is None
    assert prompt_tokens(["data:image/png;base64," + BIG, "data:text/plain,hi"], COSTS) == (
        700 + 5)


def test_deep_json_does_not_recurse():
    deep: object = "abcd"
    for _ in range(10_000):
        deep = [[deep]]
    assert prompt_tokens(deep, COSTS) == 1


def test_defaults_are_the_documented_costs():
    """OpenAI's 1024x1024 high-detail image (85 + 4 x 170), one Whisper window (1500),
    LLaVA-NeXT-Video's 32 frames x 144; the config's defaults are the same numbers."""
    from gateway.config import TokenEstimateConfig

    c = MediaCosts()
    assert (c.image, c.audio, c.video) == (85 + 4 * 170, 1500, 32 * 144)
    e = TokenEstimateConfig()
    assert (e.image_tokens, e.audio_tokens, e.video_tokens, e.file_tokens) == (
        c.image, c.audio, c.video, c.file)



def test_text_that_starts_with_data_is_text() -> None:
    """Only a base64 data URL of a medium is a media item: an SSE log pasted into a prompt
    (``data: {...}``) or a 4 MB text that starts with ``data:`` is counted as text."""
    costs = MediaCosts()
    log_text = "data: " + '{"x": 1}' * 50_000
    assert prompt_tokens({"prompt": log_text}, costs) >= len(log_text) // 4
    assert prompt_tokens({"prompt": "data:text/plain;base64," + "A" * 40_000}, costs) >= 10_000
    assert prompt_tokens({"x": "data:image/png;base64," + "A" * 400_000}, costs) < 800
    assert prompt_tokens({"x": "data:application/pdf;name=a.pdf;base64,AAAA"}, costs) < 800


def test_token_id_list_with_text_inside_counts_the_text() -> None:
    """A list counted as token ids because it starts with one still counts any text in
    it: ``[0, <4 MB>]`` is not 2 tokens."""
    costs = MediaCosts()
    big = "word " * 200_000
    assert prompt_tokens({"prompt": [0, big]}, costs) >= len(big) // 4
    assert prompt_tokens({"prompt": [1, 2, 3]}, costs) < 10
    assert prompt_tokens({"prompt": [1, True, 3]}, costs) < 10
