"""The one reader for JSON from outside (`lucebox.bounded_json`): what it refuses, that the refusal is
a JSONInputError naming the text, and that it reads files only within their bound."""

import os

import pytest

from lucebox import bounded_json
from lucebox.errors import InvalidArgumentError, JSONInputError


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000 + "]" * 100_000, "more than 100 deep"),
    ('{"a": ' * 101 + "1" + "}" * 101, "more than 100 deep"),
    ("[" * 100_000, "more than 100 deep|not valid JSON"),
    ('{"hidden_size": ' + "1" * 5_000 + "}", "a number of 5000 characters"),
    ("[-0." + "0" * 5_000 + "1]", "a number of 5004 characters"),
    ("[1e999]", "past the range of a float64"),
    ("[NaN]", "NaN is not JSON"),
    ('{"a": -Infinity}', "-Infinity is not JSON"),
    ('{"a": 1', "not valid JSON: Expecting ',' delimiter"),
    (b"\xff[]", "not UTF-8"),
])
def test_hostile_json_is_a_typed_error_naming_the_text(text, message):
    with pytest.raises(JSONInputError, match=message) as e:
        bounded_json.loads(text, "the saved thing")
    assert str(e.value).startswith("the saved thing")
    assert isinstance(e.value, InvalidArgumentError) and "\n" not in str(e.value)


def test_json_within_the_bounds_reads_as_json_does():
    text = '{"a": [' * 49 + "1.5e300, -12345678901234567890, null, true, \"\\u00e9\"" + "]}" * 49
    assert bounded_json.loads(text, "x") == __import__("json").loads(text)
    with pytest.raises(JSONInputError, match="at most 10 are read"):
        bounded_json.loads("[" + "1," * 10 + "1]", "x", max_bytes=10)


def test_values_given_already_parsed_are_held_to_the_same_depth():
    deep = current = {}
    for _ in range(150):
        current["a"] = current = {}
    with pytest.raises(JSONInputError, match="json_schema nests"):
        bounded_json.check_depth(deep, "json_schema")
    bounded_json.check_depth({"a": [[1]]}, "json_schema")


def test_files_are_read_only_when_regular_and_within_their_bound(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # opening it to read would wait for a writer
    (tmp_path / "big.json").write_text("[" + " " * 200 + "]")
    sparse = tmp_path / "sparse.json"
    with open(sparse, "wb") as f:
        f.truncate(6 * 2**30)  # 6 GiB that take no disk: refused by size before a byte is read
    for path, message in ((tmp_path / "fifo", "not a regular file"), ("/dev/zero", "not a regular file"),
                          (tmp_path, "not a regular file"), (tmp_path / "none.json", "does not exist"),
                          (tmp_path / "big.json", "larger than 100 bytes"), (sparse, "larger than 100 bytes"),
                          (str(tmp_path / "a\0b"), "NUL character")):
        with pytest.raises(InvalidArgumentError, match=message):
            bounded_json.read_json_file(path, "the result", 100)
    (tmp_path / "ok.json").write_text('{"model": "m"}')
    assert bounded_json.read_json_file(tmp_path / "ok.json", "the result", 100) == {"model": "m"}


def test_a_byte_order_mark_deeper_documents_and_the_model_s_infinite_floats():
    assert bounded_json.loads(b"\xef\xbb\xbf{\"a\": 1}", "x") == {"a": 1}  # RFC 8259 lets a reader skip it
    wrapped = "[" * 105 + "]" * 105
    with pytest.raises(JSONInputError, match="more than 100 deep"):
        bounded_json.loads(wrapped, "x")
    bounded_json.loads(wrapped, "x", max_depth=bounded_json.MAX_DEPTH + bounded_json.ENVELOPE_DEPTH)
    assert bounded_json.loads('[Infinity, NaN, 1e999]', "x", nonfinite=True)[0] == float("inf")
