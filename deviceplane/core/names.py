"""Resource-name and endpoint validation, and the kubelet's registration error strings (spec §3.3, §4.2).

The error strings are byte-exact copies of the kubelet's: plugins and tools match on them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from deviceplane.core.constants import SUPPORTED_VERSIONS, VERSION

# k8s.io/apimachinery validation: a qualified name is `[prefix/]name`.
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_DNS1123_SUBDOMAIN_MAX_LENGTH = 253
_QUALIFIED_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_QUALIFIED_NAME_PART_MAX_LENGTH = 63

_NATIVE_RESOURCE_PREFIX = "kubernetes.io/"
_QUOTA_REQUESTS_PREFIX = "requests."

# Linux NAME_MAX: no longer file name can exist, so such an endpoint can never be dialled.
_FILE_NAME_MAX_BYTES = 255


# The longest name that can pass: "requests." + name is a qualified name, whose prefix is at most 253 characters
# and whose name part at most 63.
_EXTENDED_NAME_MAX_LENGTH = (
    _DNS1123_SUBDOMAIN_MAX_LENGTH - len(_QUOTA_REQUESTS_PREFIX) + 1 + _QUALIFIED_NAME_PART_MAX_LENGTH
)


def is_extended_resource_name(name: str) -> bool:
    """Whether `name` is an extended resource name, exactly as upstream `v1helper.IsExtendedResourceName`."""
    # A longer one is refused before the cache, which would otherwise keep it alive: a hostile Register may send
    # names of megabytes.
    return len(name) <= _EXTENDED_NAME_MAX_LENGTH and _is_extended_resource_name(name)


# Asked several times per admission for the same few names (each pod's limits, the admission plan): two regular
# expressions per call otherwise. Bounded, since the names come from pods and plugins, which may be hostile.
@functools.lru_cache(maxsize=4096)
def _is_extended_resource_name(name: str) -> bool:
    is_native = "/" not in name or _NATIVE_RESOURCE_PREFIX in name
    if is_native or name.startswith(_QUOTA_REQUESTS_PREFIX):
        return False
    # Upstream validates the name as it would appear in a ResourceQuota ("requests.<name>").
    return _is_qualified_name(_QUOTA_REQUESTS_PREFIX + name)


def _is_qualified_name(value: str) -> bool:
    parts = value.split("/")
    if len(parts) > 2:
        return False
    if len(parts) == 2:
        prefix = parts[0]
        # The patterns are ASCII-only, so once one matches, characters and (Go's) bytes count the same.
        if not prefix or len(prefix) > _DNS1123_SUBDOMAIN_MAX_LENGTH or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
            return False
    name = parts[-1]
    return 0 < len(name) <= _QUALIFIED_NAME_PART_MAX_LENGTH and _QUALIFIED_NAME_PART.fullmatch(name) is not None


def is_utf8(text: str) -> bool:
    """False for text holding lone surrogates: what Python makes of bytes that are not UTF-8 in a file name
    (os.fsdecode, os.scandir), argv or the environment. Neither protobuf nor UTF-8 JSON can carry it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_supported_version(version: str) -> bool:
    return version in SUPPORTED_VERSIONS


def any_supported_version(versions: Iterable[str]) -> bool:
    """The plugin watcher's check: at least one of the plugin's versions is one the manager speaks."""
    return any(is_supported_version(v) for v in versions)


_GO_SHORT_ESCAPES = {
    "\a": r"\a",
    "\b": r"\b",
    "\f": r"\f",
    "\n": r"\n",
    "\r": r"\r",
    "\t": r"\t",
    "\v": r"\v",
    '"': r"\"",
    "\\": r"\\",
}


def go_quote(text: str) -> str:
    """Go's `strconv.Quote` (the `%q` verb): a double-quoted Go literal, escaping what Go deems unprintable.

    Go's and Python's notions of printable agree (letters, marks, numbers, punctuation, symbols and the
    ASCII space) but for the Unicode version: Go's tables are Unicode 15, Python 3.11's are Unicode 14.
    """
    out = ['"']
    for char in text:
        escape = _GO_SHORT_ESCAPES.get(char)
        if escape is not None:
            out.append(escape)
        elif char.isprintable() or _printable_since_unicode_15(ord(char)):
            out.append(char)
        else:
            out.append(_go_escape_unprintable(ord(char)))
    out.append('"')
    return "".join(out)


# Printable since Unicode 15.0 (Go's unicode.Version); unassigned, hence escaped, in Python 3.11's tables.
_PRINTABLE_IN_UNICODE_15_ONLY = (
    (0x0CF3, 0x0CF3), (0x0ECE, 0x0ECE), (0x10EFD, 0x10EFF), (0x1123F, 0x11241), (0x11B00, 0x11B09),
    (0x11F00, 0x11F10), (0x11F12, 0x11F3A), (0x11F3E, 0x11F59), (0x1342F, 0x1342F), (0x13440, 0x13455),
    (0x1B132, 0x1B132), (0x1B155, 0x1B155), (0x1D2C0, 0x1D2D3), (0x1DF25, 0x1DF2A), (0x1E030, 0x1E06D),
    (0x1E08F, 0x1E08F), (0x1E4D0, 0x1E4F9), (0x1F6DC, 0x1F6DC), (0x1F774, 0x1F776), (0x1F77B, 0x1F77F),
    (0x1F7D9, 0x1F7D9), (0x1FA75, 0x1FA77), (0x1FA87, 0x1FA88), (0x1FAAD, 0x1FAAF), (0x1FABB, 0x1FABD),
    (0x1FABF, 0x1FABF), (0x1FACE, 0x1FACF), (0x1FADA, 0x1FADB), (0x1FAE8, 0x1FAE8), (0x1FAF7, 0x1FAF8),
    (0x2B739, 0x2B739), (0x31350, 0x323AF),
)  # fmt: skip


def _printable_since_unicode_15(code: int) -> bool:
    return any(first <= code <= last for first, last in _PRINTABLE_IN_UNICODE_15_ONLY)


def _go_escape_unprintable(code: int) -> str:
    if code < 0x20 or code == 0x7F:
        return f"\\x{code:02x}"
    if 0xD800 <= code <= 0xDFFF:
        # Not a valid rune; Go would print the replacement character.
        return "\\ufffd"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def go_quote_list(values: Iterable[str]) -> str:
    """Go's `%q` of a `[]string`: `["a" "b"]`."""
    return "[" + " ".join(go_quote(v) for v in values) + "]"


def go_print_list(values: Iterable[str]) -> str:
    """Go's `%v` of a `[]string`: `[a b]`, elements unquoted."""
    return "[" + " ".join(values) + "]"


def unsupported_version_error(version: str) -> str:
    """gRPC `Register` with a version the kubelet does not speak."""
    return (
        f"requested API version {go_quote(version)} is not supported by kubelet. "
        f"Supported version is {go_quote_list(SUPPORTED_VERSIONS)}"
    )


def invalid_resource_name_error(name: str) -> str:
    """gRPC `Register` with a name that is not an extended resource name."""
    return f"the ResourceName {go_quote(name)} is invalid"


def plugin_versions_unsupported_error(versions: Iterable[str]) -> str:
    """Plugin-watcher `ValidatePlugin` when none of the plugin's versions is supported."""
    return f"manager version, {VERSION}, is not among plugin supported versions {go_print_list(versions)}"


def invalid_plugin_name_error(name: str) -> str:
    """Plugin-watcher `ValidatePlugin` with a name that is not an extended resource name."""
    return f"invalid name of device plugin socket: {invalid_resource_name_error(name)}"


def validate_watcher_plugin(name: str, versions: Iterable[str]) -> str | None:
    """None if the plugin watcher may register this device plugin, else the error (upstream `ValidatePlugin`)."""
    versions = list(versions)
    if not any_supported_version(versions):
        return plugin_versions_unsupported_error(versions)
    if not is_extended_resource_name(name):
        return invalid_plugin_name_error(name)
    return None


def validate_endpoint_name(endpoint: str) -> str | None:
    """None if `endpoint` is a plain file name, else why not.

    Stricter than the kubelet, which joins any string onto its directory: a registration must not point
    outside the plugin directory. Whether the file exists and is a socket is for the caller to check.
    """
    if (
        endpoint in ("", ".", "..")
        or "/" in endpoint
        or "\0" in endpoint
        or len(endpoint.encode("utf-8", "surrogatepass")) > _FILE_NAME_MAX_BYTES
    ):
        return f"invalid endpoint {go_quote(endpoint)}: must be a socket file name inside the plugin directory"
    return None
