"""RFC 8785 canonical JSON: the known answers, and agreement with the Rust services.

The Rust oracle is the real policy service: ``Policy.Check`` (a dry run that records nothing)
canonicalizes ``args_json`` with ``serde_jcs`` and returns its SHA-256 as ``args_sha256`` —
the digest every authorization binds. A Python host computing anything else would refuse
every call, so each value below must digest identically on both sides, and both sides must
refuse the same malformed texts.
"""

from __future__ import annotations

import json

import grpc
import pytest

from mesh import TENANT, Mesh
from warden_sdk.canonical import JsonError, args_digest, canonical_json, parse_json
from warden_sdk.v1 import policy_pb2, policy_pb2_grpc


def test_keys_are_sorted_and_whitespace_dropped() -> None:
    assert canonical_json({"b": 1, "a": {"d": [1, 2], "c": "x"}}) == '{"a":{"c":"x","d":[1,2]},"b":1}'


def test_numbers_use_ecmascript_form() -> None:
    assert canonical_json(1.0) == "1"
    assert canonical_json(1e21) == "1e+21"
    assert canonical_json(0.000001) == "0.000001"
    assert canonical_json(1e-7) == "1e-7"
    assert canonical_json(-0.0) == "0"


def test_integers_beyond_2_pow_53_become_doubles_as_in_rust() -> None:
    assert canonical_json(2**64) == "18446744073709552000"
    assert canonical_json(2**53 + 1) == "9007199254740992"


def test_strings_escape_minimally() -> None:
    assert canonical_json("é\n\x01") == '"é\\n\\u0001"'


def test_keys_sort_by_utf16_code_units_not_code_points() -> None:
    # U+1F600 is D83D DE00 in UTF-16, which sorts before U+E000.
    assert canonical_json({"\ue000": 1, "😀": 2}) == '{"😀":2,"\ue000":1}'


def test_digest_is_independent_of_key_order_and_number_spelling() -> None:
    a = parse_json('{"x":1,"y":[true,null]}')
    b = parse_json('{ "y":[true, null], "x":1.0 }')
    assert args_digest(a) == args_digest(b)
    assert len(args_digest(a)) == 64


@pytest.mark.parametrize(
    "text",
    ["NaN", "[Infinity]", "-Infinity", "1e400", '"\\ud800"', '{"a":1}x', "[" * 128 + "]" * 128, "\ufeff{}"],
)
def test_what_serde_json_refuses_is_refused(text: str) -> None:
    with pytest.raises(JsonError):
        parse_json(text)


def test_nesting_up_to_serde_jsons_limit_is_accepted() -> None:
    assert parse_json("[" * 127 + "]" * 127) is not None


# Values whose canonical form is easy to get wrong: number formatting at every boundary,
# integers past 2^53 and past u64, escapes, non-BMP keys, deep nesting.
ORACLE_VALUES: list[str] = [
    "0",
    "-0",
    "-0.0",
    "1.0",
    "100",
    "1E2",
    "12345678.9e-3",
    "0.1",
    "0.30000000000000004",
    "3.141592653589793",
    "1e21",
    "1e20",
    "123456789012345678901",
    "1e-6",
    "1e-7",
    "0.000001234",
    "5e-324",
    "1.7976931348623157e308",
    "-1.5e-300",
    "9007199254740991",
    "9007199254740992",
    "9007199254740993",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "-9223372036854775809",
    "123456789012345678901234567890",
    "0.1000000000000000055511151231257827",
    '"é\\n\\u0001\\u001f\\u007f\\"\\\\/"',
    '"\\ud83d\\ude00 \\u2028 \\u00e9"',
    '{"\\ue000":1,"\\ud83d\\ude00":2,"a":3,"B":4,"":5}',
    '[true,false,null,[],{},[[{"z":{"y":[1,2.5,"x"]}}]]]',
    '{"b":{"d":1,"c":2},"a":[{"f":null,"e":[3,2,1]}]}',
    "[" * 120 + "1" + "]" * 120,
    "9" * 300,
]


def _rust_digest(mesh: Mesh, args_json: str) -> tuple[str | None, grpc.StatusCode | None]:
    with grpc.insecure_channel(mesh.policy.endpoint.removeprefix("http://")) as ch:
        stub = policy_pb2_grpc.PolicyStub(ch)
        req = policy_pb2.AuthorizeRequest(
            tenant=TENANT,
            run_id="canonical-oracle",
            step_id="s1",
            attempt=1,
            tool="echo",
            args_json=args_json,
            idempotency_key="canonical-oracle-k",
        )
        try:
            return stub.Check(req, timeout=10).args_sha256, None
        except grpc.RpcError as e:
            return None, e.code()  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", ORACLE_VALUES)
def test_digest_matches_the_rust_policy_service(mesh: Mesh, value: str) -> None:
    args_json = '{"v":' + value + "}"
    rust, code = _rust_digest(mesh, args_json)
    assert code is None, f"Rust refused {args_json}: {code}"
    assert args_digest(parse_json(args_json)) == rust


@pytest.mark.parametrize(
    "args_json",
    [
        '{"v":NaN}',
        '{"v":1e400}',
        '{"v":' + "9" * 400 + "}",
        '{"v":"\\ud800"}',
        '{"v":' + "[" * 127 + "]" * 127 + "}",
        '{"v":1,}',
    ],
)
def test_what_rust_refuses_python_refuses(mesh: Mesh, args_json: str) -> None:
    _, code = _rust_digest(mesh, args_json)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(JsonError):
        args_digest(parse_json(args_json))


def test_the_deepest_nesting_rust_accepts_python_accepts(mesh: Mesh) -> None:
    args_json = '{"v":' + "[" * 126 + "]" * 126 + "}"
    rust, code = _rust_digest(mesh, args_json)
    assert code is None
    assert args_digest(parse_json(args_json)) == rust


def test_python_json_dumps_spelling_does_not_change_the_digest(mesh: Mesh) -> None:
    value = {"n": [1.5, 2**60, -3], "s": "ünïcödé", "nested": {"b": True, "a": None}}
    text = json.dumps(value, indent=2, ensure_ascii=True)
    rust, _ = _rust_digest(mesh, text)
    assert args_digest(value) == rust
