"""The kubelet checkpoint codec: spew text, FNV checksum, Go encoding/json in both directions (spec §4.9)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplane.core.checkpoint import (
    CheckpointData,
    CheckpointEncoder,
    CheckpointFormatError,
    CorruptCheckpointError,
    PodDevicesEntry,
    checkpoint_data_for_write,
    checksum,
    decode,
    encode,
    fnv1a_32,
    spew_text,
)
from deviceplane.core.spew import framed_pieces

HEAD = "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)"
REGISTERED = " RegisteredDevices:(map[string][]string)"

# ContainerAllocateResponse{envs: {"A": ""}} in proto3 binary.
ALLOC_RESP = bytes([0x0A, 0x05, 0x0A, 0x01, 0x41, 0x12, 0x00])

EXAMPLE_ENTRY = PodDevicesEntry(
    PodUID="pod-uid-1",
    ContainerName="ctr",
    ResourceName="example.com/resource",
    DeviceIDs={-1: ["Dev-2"], 0: ["Dev-1"]},
    AllocResp=ALLOC_RESP,
)
EXAMPLE = CheckpointData(
    PodDeviceEntries=[EXAMPLE_ENTRY],
    RegisteredDevices={"a.com/b": ["x"], "example.com/resource": ["Dev-1", "Dev-2"]},
)
# The spec's example file, byte for byte.
EXAMPLE_FILE = (
    b'{"Data":{"PodDeviceEntries":[{"PodUID":"pod-uid-1","ContainerName":"ctr","ResourceName":"example.com/resource",'
    b'"DeviceIDs":{"-1":["Dev-2"],"0":["Dev-1"]},"AllocResp":"CgUKAUESAA=="}],'
    b'"RegisteredDevices":{"a.com/b":["x"],"example.com/resource":["Dev-1","Dev-2"]}},"Checksum":1336083214}'
)

# The spec's six vectors: (data, go-spew text, FNV-1a 32), produced by the real go-spew.
SPEC_VECTORS = [
    pytest.param(CheckpointData(None, {}), f"{HEAD}<nil>{REGISTERED}map[]}}", 3467439661, id="nil-entries"),
    pytest.param(CheckpointData([], {}), f"{HEAD}[]{REGISTERED}map[]}}", 2932075448, id="empty-entries"),
    pytest.param(CheckpointData(None, None), f"{HEAD}<nil>{REGISTERED}<nil>}}", 1944006890, id="all-nil"),
    pytest.param(
        CheckpointData(None, {"example.com/resource": ["Dev-1", "Dev-2"]}),
        f"{HEAD}<nil>{REGISTERED}map[example.com/resource:[Dev-1 Dev-2]]}}",
        468646588,
        id="registered-only",
    ),
    pytest.param(
        CheckpointData(None, {"example.com/resource": []}),
        f"{HEAD}<nil>{REGISTERED}map[example.com/resource:[]]}}",
        625530563,
        id="registered-empty-list",
    ),
    pytest.param(
        EXAMPLE,
        f"{HEAD}[{{PodUID:(string)pod-uid-1 ContainerName:(string)ctr ResourceName:(string)example.com/resource "
        "DeviceIDs:(checkpoint.DevicesPerNUMA)map[-1:[Dev-2] 0:[Dev-1]] AllocResp:([]uint8)[10 5 10 1 65 18 0]}]"
        f"{REGISTERED}map[a.com/b:[x] example.com/resource:[Dev-1 Dev-2]]}}",
        1336083214,
        id="one-entry",
    ),
]


@pytest.mark.parametrize(("data", "text", "fnv"), SPEC_VECTORS)
def test_spec_vectors(data: CheckpointData, text: str, fnv: int) -> None:
    assert spew_text(data) == text
    assert fnv1a_32(text.encode()) == fnv
    assert checksum(data) == fnv


@pytest.mark.parametrize(
    ("data", "fnv"),
    # Reference vectors of the FNV-1a 32-bit algorithm (Fowler/Noll/Vo test suite).
    [(b"", 0x811C9DC5), (b"a", 0xE40C292C), (b"foobar", 0xBF9CF968)],
)
def test_fnv1a_32(data: bytes, fnv: int) -> None:
    assert fnv1a_32(data) == fnv


@pytest.mark.parametrize(("data", "text", "fnv"), SPEC_VECTORS)
def test_spec_vectors_round_trip_through_the_file_format(data: CheckpointData, text: str, fnv: int) -> None:
    raw = encode(data)
    assert json.loads(raw)["Checksum"] == fnv
    assert decode(raw) == data


def test_spec_example_file_decodes_and_reencodes_byte_identically() -> None:
    assert decode(EXAMPLE_FILE) == EXAMPLE
    assert encode(EXAMPLE) == EXAMPLE_FILE


def test_spew_text_sorts_map_keys_as_go() -> None:
    entry = PodDevicesEntry("p", "c", "r", {10: ["a"], 2: ["b"], -1: None}, None)
    data = CheckpointData([entry], {"b": None, "B": [], "é": ["x y"], "a": ["z"]})
    text = spew_text(data)
    # int64 keys numerically; strings by bytes (upper case before lower, ASCII before é); strings raw, unquoted.
    assert "DeviceIDs:(checkpoint.DevicesPerNUMA)map[-1:<nil> 2:[b] 10:[a]]" in text
    assert "AllocResp:([]uint8)<nil>" in text
    assert text.endswith("map[B:[] a:[z] b:<nil> é:[x y]]}")


# -- what the kubelet writes ------------------------------------------------------------------------------------------


def test_checkpoint_data_for_write_follows_write_checkpoint() -> None:
    kept = PodDevicesEntry("p", "c", "example.com/resource", {0: ["Dev-1"]}, b"")
    dropped = PodDevicesEntry("p", "c2", "example.com/resource", {0: ["Dev-2"]}, None)
    data = checkpoint_data_for_write([kept, dropped], {"example.com/resource": {"Dev-2", "Dev-1"}, "x.io/y": set()})
    assert data.PodDeviceEntries == [kept]
    assert data.RegisteredDevices == {"example.com/resource": ["Dev-1", "Dev-2"], "x.io/y": []}


def test_checkpoint_data_for_write_without_allocations_is_what_the_kubelet_hashes() -> None:
    # No entry with a response: a nil list, as the spec's vectors for "registered only" and "empty list".
    unallocated = [PodDevicesEntry("p", "c", "example.com/resource", {0: ["Dev-1"]}, None)]
    assert checksum(checkpoint_data_for_write(unallocated, {"example.com/resource": ["Dev-2", "Dev-1"]})) == 468646588
    assert checksum(checkpoint_data_for_write([], {"example.com/resource": []})) == 625530563


def test_entry_devices_unions_numa_nodes() -> None:
    entry = PodDevicesEntry("p", "c", "r", {-1: ["a"], 0: ["b", "a"], 1: None}, None)
    assert entry.devices() == {"a", "b"}
    assert PodDevicesEntry("p", "c", "r", None, None).devices() == set()


# -- encoding: Go encoding/json ----------------------------------------------------------------------------------------


def test_encode_sorts_int64_keys_by_their_text_as_go() -> None:
    entry = PodDevicesEntry("p", "c", "r", {2: ["b"], 10: ["a"], -1: ["n"], 0: ["z"]}, None)
    raw = encode(CheckpointData([entry], None))
    assert b'"DeviceIDs":{"-1":["n"],"0":["z"],"10":["a"],"2":["b"]}' in raw


def test_encode_keeps_nil_and_empty_apart() -> None:
    entry = PodDevicesEntry("", "", "", None, None)
    empty = PodDevicesEntry("", "", "", {0: []}, b"")
    raw = encode(CheckpointData([entry, empty], None))
    assert b'{"PodUID":"","ContainerName":"","ResourceName":"","DeviceIDs":null,"AllocResp":null}' in raw
    assert b'"DeviceIDs":{"0":[]},"AllocResp":""}' in raw
    assert b'"RegisteredDevices":null' in raw


@pytest.mark.parametrize(
    ("text", "json_text"),
    [
        ('<a href="x">&</a>', r'"\u003ca href=\"x\"\u003e\u0026\u003c/a\u003e"'),  # Go escapes HTML characters
        ("\u2028\u2029", r'"\u2028\u2029"'),
        ("\b\f\n\r\t\\", r'"\b\f\n\r\t\\"'),
        ("\x00\x01\x1f", r'"\u0000\u0001\u001f"'),
        ("\x7fé😀/", '"\x7fé😀/"'),  # DEL, non-ASCII and "/" are written raw
    ],
)
def test_encode_escapes_strings_as_go(text: str, json_text: str) -> None:
    raw = encode(CheckpointData(None, {text: []}))
    assert f'"RegisteredDevices":{{{json_text}:[]}}'.encode() in raw
    assert decode(raw).RegisteredDevices == {text: []}


def test_encode_rejects_what_go_cannot_hold() -> None:
    with pytest.raises(ValueError, match="int64"):
        encode(CheckpointData([PodDevicesEntry("p", "c", "r", {2**63: []}, None)], None))
    with pytest.raises(ValueError):
        encode(CheckpointData(None, {"\ud800": []}))


# -- decoding: what the kubelet accepts, and the values it sees --------------------------------------------------------


def file_for(data_json: str, data: CheckpointData) -> bytes:
    """A checkpoint file with `data_json` as its Data, stored with the checksum `data` must have once decoded."""
    return f'{{"Data":{data_json},"Checksum":{checksum(data)}}}'.encode()


@pytest.mark.parametrize(
    ("data_json", "expected"),
    [
        # The kubelet decodes into an empty slice and map: absent keys read as [] and {}, null as nil.
        ("{}", CheckpointData([], {})),
        ('{"PodDeviceEntries":null}', CheckpointData(None, {})),
        ('{"RegisteredDevices":null}', CheckpointData([], None)),
        ("null", CheckpointData([], {})),
        # Unknown keys are ignored; keys match field names without regard to case (Unicode simple folding).
        (
            '{"podDEVICEentries":null,"Extra":[1,{}],"registeredDevices":{"r/x":["a"]}}',
            CheckpointData(None, {"r/x": ["a"]}),
        ),
        ('{"RegisteredDevices":{"r/x":null,"r/y":["a",null]}}', CheckpointData([], {"r/x": None, "r/y": ["a", ""]})),
        # A repeated map key merges into the map decoded so far.
        ('{"RegisteredDevices":{"a":["1"]},"RegisteredDevices":{"b":[]}}', CheckpointData([], {"a": ["1"], "b": []})),
    ],
)
def test_decode_follows_go_json(data_json: str, expected: CheckpointData) -> None:
    assert decode(file_for(data_json, expected)) == expected


def test_decode_entry_details_follow_go_json() -> None:
    data_json = (
        '{"PodDeviceEntries":[{"poduid":"p","CONTAINERNAME":"c","DeviceIDs":{"+3":["a"],"003":["b"],"-0":[]},'
        '"AllocResp":[1,2,255]},{"AllocResp":"QU\\nJD\\r\\nRA=="}]}'
    )
    expected = CheckpointData(
        [
            PodDevicesEntry("p", "c", "", {3: ["b"], 0: []}, bytes([1, 2, 255])),  # ParseInt keys; byte arrays
            PodDevicesEntry("", "", "", None, b"ABCD"),  # base64 skips CR and LF
        ],
        {},
    )
    assert decode(file_for(data_json, expected)) == expected


def test_decode_kelvin_sign_and_long_s_match_field_names_as_in_go() -> None:
    raw = f'{{"Data":{{"PodDeviceEntries":null}},"Chec\u212a\u017fum":{checksum(CheckpointData(None, {}))}}}'
    assert decode(raw.encode()) == CheckpointData(None, {})


def test_decode_replaces_invalid_utf8_per_byte_as_go() -> None:
    # Go's decoder turns each byte that is not UTF-8 into U+FFFD (a truncated sequence gives one per byte).
    expected = CheckpointData([], {"a\ufffd\ufffdb\ufffd": []})
    raw = file_for('{"RegisteredDevices":{"a\xe2\x82b\\udc00":[]}}', expected)
    raw = raw.replace("\xe2\x82".encode(), b"\xe2\x82")
    assert decode(raw) == expected


def test_decode_repeated_array_decodes_into_the_previous_elements_as_go() -> None:
    # Go reuses the slice's backing array: the second array's objects fill in fields of the first one's elements.
    data_json = (
        '{"PodDeviceEntries":[{"PodUID":"a","AllocResp":"QUJD"},{"PodUID":"b"}],'
        '"PodDeviceEntries":[{"ContainerName":"c"}]}'
    )
    expected = CheckpointData([PodDevicesEntry("a", "c", "", None, b"ABC")], {})
    assert decode(file_for(data_json, expected)) == expected


def test_decode_checksum_mismatch_reports_both_values() -> None:
    tampered = EXAMPLE_FILE.replace(b'"Dev-1","Dev-2"', b'"Dev-1","Dev-3"')
    with pytest.raises(CorruptCheckpointError) as caught:
        decode(tampered)
    changed = CheckpointData(EXAMPLE.PodDeviceEntries, {"a.com/b": ["x"], "example.com/resource": ["Dev-1", "Dev-3"]})
    assert (caught.value.actual, caught.value.expected) == (checksum(changed), 1336083214)
    assert str(caught.value) == "checkpoint is corrupted"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"Data":{}}',  # no checksum stored: 0
        b'{"Data":{},"Checksum":null}',
        b"null",
        b'{"Data":{"PodDeviceEntries":null},"Checksum":2932075448}',  # the checksum of [] entries, not of nil
    ],
)
def test_decode_rejects_checksums_that_do_not_match(raw: bytes) -> None:
    with pytest.raises(CorruptCheckpointError):
        decode(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"{} x",
        b"[]",
        b'"x"',
        b"\xef\xbb\xbf{}",  # a byte-order mark
        b'{"Data":[]}',
        b'{"Checksum":"1"}',
        b'{"Checksum":-1}',
        b'{"Checksum":1.0}',
        b'{"Checksum":1e3}',
        b'{"Checksum":18446744073709551616}',
        b'{"Checksum":NaN}',
        b'{"Data":{"PodDeviceEntries":{}}}',
        b'{"Data":{"PodDeviceEntries":[{"PodUID":1}]}}',
        b'{"Data":{"PodDeviceEntries":[{"DeviceIDs":{"x":[]}}]}}',
        b'{"Data":{"PodDeviceEntries":[{"DeviceIDs":{"9223372036854775808":[]}}]}}',
        b'{"Data":{"PodDeviceEntries":[{"DeviceIDs":{"1":"a"}}]}}',
        b'{"Data":{"PodDeviceEntries":[{"AllocResp":"QQ"}]}}',  # base64 without padding
        b'{"Data":{"PodDeviceEntries":[{"AllocResp":"QUJD="}]}}',
        b'{"Data":{"PodDeviceEntries":[{"AllocResp":[256]}]}}',
        b'{"Data":{"RegisteredDevices":[]}}',
        b'{"Data":{"RegisteredDevices":{"a":[1]}}}',
        b'{"Data":{"RegisteredDevices":{"a":"\xff"}}}',
        b'{"Data":{"RegisteredDevices":{"a":[]}}\xff}',  # a byte that is not UTF-8 outside a string
    ],
)
def test_decode_rejects_what_go_cannot_unmarshal(raw: bytes) -> None:
    with pytest.raises(CheckpointFormatError):
        decode(raw)


# -- round trip -------------------------------------------------------------------------------------------------------

ids = st.text(max_size=12)
id_lists = st.none() | st.lists(ids, max_size=4)
numa_ids = st.sampled_from([-1, 0, 1, 2, 10]) | st.integers(min_value=-(2**63), max_value=2**63 - 1)
entries = st.builds(
    PodDevicesEntry,
    PodUID=ids,
    ContainerName=ids,
    ResourceName=ids,
    DeviceIDs=st.none() | st.dictionaries(numa_ids, id_lists, max_size=4),
    AllocResp=st.none() | st.just(b"") | st.binary(max_size=40),
)
checkpoints = st.builds(
    CheckpointData,
    PodDeviceEntries=st.none() | st.lists(entries, max_size=4),
    RegisteredDevices=st.none() | st.dictionaries(ids, id_lists, max_size=4),
)


@settings(max_examples=300)
@given(checkpoints)
def test_round_trip(data: CheckpointData) -> None:
    raw = encode(data)
    decoded = decode(raw)
    assert decoded == data
    assert checksum(decoded) == checksum(data)
    assert encode(decoded) == raw


@settings(max_examples=200)
@given(checkpoints)
def test_encoding_is_json_of_the_data(data: CheckpointData) -> None:
    # Independent of our decoder: a standard JSON parser sees the same values, and the checksum of the data.
    document = json.loads(encode(data))
    assert list(document) == ["Data", "Checksum"]
    assert document["Checksum"] == checksum(data)
    stored = document["Data"]
    assert list(stored) == ["PodDeviceEntries", "RegisteredDevices"]
    assert stored["RegisteredDevices"] == data.RegisteredDevices
    if data.PodDeviceEntries is None:
        assert stored["PodDeviceEntries"] is None
        return
    assert len(stored["PodDeviceEntries"]) == len(data.PodDeviceEntries)
    for written, entry in zip(stored["PodDeviceEntries"], data.PodDeviceEntries, strict=True):
        assert list(written) == ["PodUID", "ContainerName", "ResourceName", "DeviceIDs", "AllocResp"]
        assert (written["PodUID"], written["ContainerName"], written["ResourceName"]) == (
            entry.PodUID,
            entry.ContainerName,
            entry.ResourceName,
        )
        expected_ids = None if entry.DeviceIDs is None else {str(k): v for k, v in entry.DeviceIDs.items()}
        assert written["DeviceIDs"] == expected_ids
        expected_resp = None if entry.AllocResp is None else base64.b64encode(entry.AllocResp).decode()
        assert written["AllocResp"] == expected_resp


@settings(max_examples=150)
@given(st.lists(entries, min_size=1, max_size=8), st.lists(st.lists(st.integers(0, 7), max_size=8), max_size=6))
def test_encoder_keeping_entry_texts_writes_what_encode_writes(
    pool: list[PodDevicesEntry], picks: list[list[int]]
) -> None:
    """Checkpoints in a row sharing entry objects (as PodDevices' entries outlive many checkpoints), in any order,
    with entries equal in content but distinct objects among them: byte for byte what `encode` writes."""
    encoder = CheckpointEncoder()
    registered = {"example.com/r": ["a", "b"]}
    for pick in picks:
        chosen = [pool[i % len(pool)] for i in pick]
        chosen += [PodDevicesEntry(**vars(entry)) for entry in chosen[:1]]  # an equal copy: a new object
        data = CheckpointData(chosen or None, registered)
        assert encoder.encode(data) == encode(data)


def test_encoder_after_an_entry_go_cannot_hold_goes_on() -> None:
    encoder = CheckpointEncoder()
    good = PodDevicesEntry("p1", "c", "example.com/r", {0: ["d1"]}, ALLOC_RESP)
    bad = PodDevicesEntry("p2", "c", "example.com/r", {0: ["\ud800"]}, ALLOC_RESP)
    with pytest.raises(ValueError, match="lone surrogate"):
        encoder.encode(CheckpointData([good, bad], {}))
    assert encoder.encode(CheckpointData([good], {})) == encode(CheckpointData([good], {}))


class TickingClock:
    """Advances one second at every reading, so every check of a slice's time finds it spent."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def run_slices(encoder: CheckpointEncoder, data: CheckpointData, clock: Callable[[], float]) -> tuple[bytes, int]:
    """The bytes `encode_in_slices` returns, and how many times it paused."""
    slices = encoder.encode_in_slices(data, clock, 0.5)
    pauses = 0
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value, pauses
        pauses += 1


@settings(max_examples=100)
@given(st.lists(entries, min_size=1, max_size=6), st.lists(st.integers(0, 5), min_size=20, max_size=100), st.booleans())
def test_encoding_in_slices_writes_what_encode_writes_pausing_once_per_chunk(
    pool: list[PodDevicesEntry], picks: list[int], nil_registered: bool
) -> None:
    """20-100 entries (up to three chunks of texts; entries repeat, as objects and as copies): the bytes are
    `encode`'s, a pause comes after each full chunk and each resource's RegisteredDevices texts made when the
    slice's time is spent, and the final steps (texts gathered, checksum, file) are separated by three more."""
    chosen = [pool[i % len(pool)] if i % 2 else PodDevicesEntry(**vars(pool[i % len(pool)])) for i in picks]
    data = CheckpointData(chosen, None if nil_registered else {"example.com/r": ["b", "a"]})
    encoded, pauses = run_slices(CheckpointEncoder(), data, TickingClock())
    assert encoded == encode(data)
    assert pauses == len(chosen) // 32 + (0 if nil_registered else 1) + 3


def test_encoding_in_slices_does_not_pause_while_the_slice_lasts() -> None:
    data = CheckpointData([PodDevicesEntry(f"p{i}", "c", "r", {0: ["d"]}, ALLOC_RESP) for i in range(100)], {})
    encoded, pauses = run_slices(CheckpointEncoder(), data, lambda: 0.0)
    assert (encoded, pauses) == (encode(data), 3)


@settings(max_examples=100)
@given(st.lists(st.tuples(st.booleans(), id_lists), min_size=1, max_size=6))
def test_encoder_keeps_registered_devices_texts_only_while_their_lists_are_the_same(
    steps: list[tuple[bool, list[str] | None]],
) -> None:
    """A resource's RegisteredDevices texts are kept while its list is the very same object (the registry shares a
    resource's sorted list until its devices change): a new list, even an equal one, is written as it is, and a
    resource gone from the map is gone from the file."""
    encoder = CheckpointEncoder()
    lists: dict[str, list[str] | None] = {"example.com/a": ["a-1"], "example.com/b": None}
    for replace, new_list in steps:
        if replace:
            lists = {**lists, "example.com/a": new_list}
        data = CheckpointData(None, dict(lists))
        assert encoder.encode(data) == encode(data)
    removed = CheckpointData(None, {"example.com/a": lists["example.com/a"]})
    assert encoder.encode(removed) == encode(removed)
    assert encoder.encode(CheckpointData(None, None)) == encode(CheckpointData(None, None))


@given(st.binary(max_size=8), st.lists(st.binary(max_size=8), max_size=6), st.binary(max_size=2), st.binary(max_size=8))
def test_framed_pieces_join_as_the_plain_join(opening: bytes, parts: list[bytes], separator: bytes, end: bytes) -> None:
    assert b"".join(framed_pieces(opening, parts, separator, end)) == opening + separator.join(parts) + end


@given(st.binary(max_size=512))
def test_compiled_fnv_matches_the_pure_implementation(blob: bytes) -> None:
    from deviceplane.core.checkpoint import fnv1a_32, fnv1a_32_pure

    assert fnv1a_32(blob) == fnv1a_32_pure(blob)
