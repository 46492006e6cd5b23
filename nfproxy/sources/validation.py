"""Field validators for Kubernetes objects that reach the service model.

Every string the renderers will print (names, addresses, zones) comes from a user-editable
manifest or from an API server we do not control, and ends up inside nft and iptables-restore
input, chain names and comments. So each value is checked against the same grammar the API server
enforces, and addresses are re-printed in canonical form: a value that survives these functions
cannot carry a quote, a newline, `;`, `#`, a brace or anything else the rule syntaxes give meaning
to. Validators raise `FieldError` with a message about the value; the caller adds the field path.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Collection

from nfproxy.core.model import IPFamily

MAX_PORT = 65535
MIN_AFFINITY_TIMEOUT = 1
MAX_AFFINITY_TIMEOUT = 86400

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
# Checked before `ipaddress` sees the text: it accepts IPv6 scope ids (`fe80::1%eth0`), and
# ip_network silently drops them and accepts zero-padded prefix lengths.
_IP_CHARS = re.compile(r"[0-9A-Fa-f:.]+")
_CIDR_CHARS = re.compile(r"[0-9A-Fa-f:.]+/(0|[1-9][0-9]{0,2})")
# Longest printable form of a value quoted in an error message: enough to recognise it, not
# enough for a hostile 1 MB string to flood the log.
_SHOW_LIMIT = 60
_PLAIN = re.compile(r"[A-Za-z0-9._:/-]{1,253}")


class FieldError(ValueError):
    """A value the API server would reject; the message names the value, the caller the path."""


def show(value: object) -> str:
    """A one-line, bounded rendering of an untrusted value for error messages.

    Error text goes to terminals and logs, so a hostile value must not be able to forge lines or
    flood them: anything but plain identifier characters is shown as a truncated Python repr.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if value.bit_length() > 3 * _SHOW_LIMIT:  # str() refuses past 4 300 digits, and floods
            return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
        text = str(value)
        return text if len(text) <= _SHOW_LIMIT else text[: _SHOW_LIMIT - 3] + "..."
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return value
    if isinstance(value, (str, int, float)) or value is None:
        text = repr(value)
    else:
        text = f"a {type_name(value)}"
    if len(text) > _SHOW_LIMIT:
        text = text[: _SHOW_LIMIT - 3] + "..."
    return text


def got(value: object) -> str:
    """What a message says was found: `string 'x'`, `integer 5`, `null`, `a list` (the type
    alone where the value would only repeat it)."""
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return show(value)
    return f"{type_name(value)} {show(value)}"


def type_name(value: object) -> str:
    """The YAML-level name of a value's type, as a manifest author thinks of it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "mapping"
    return type(value).__name__


def string(value: object) -> str:
    if not isinstance(value, str):
        raise FieldError(f"expected a string, got {got(value)}")
    return value


def _matching(value: object, pattern: re.Pattern[str], limit: int, what: str) -> str:
    text = string(value)
    if len(text) > limit:
        raise FieldError(f"{show(text)} is not a valid {what} (longer than {limit} characters)")
    if not pattern.fullmatch(text):
        raise FieldError(f"{show(text)} is not a valid {what}")
    return text


def dns_label(value: object) -> str:
    """RFC 1123 label: namespaces and port names."""
    return _matching(value, _DNS1123_LABEL, 63, "DNS label (RFC 1123)")


def service_name(value: object) -> str:
    """Service names: RFC 1123 labels, so a name may begin with a digit. Kubernetes 1.36 relaxed
    them from RFC 1035 (KEP-5311, RelaxedServiceNameValidation, on by default; GA in 1.37), and
    kube-proxy never checked them at all: a name the API server stored is one to proxy."""
    return _matching(value, _DNS1123_LABEL, 63, "Service name (RFC 1123 label)")


def dns_subdomain(value: object) -> str:
    """RFC 1123 subdomain: EndpointSlice and Node names."""
    return _matching(value, _DNS1123_SUBDOMAIN, 253, "DNS subdomain (RFC 1123)")


def label_value(value: object) -> str:
    """A Kubernetes label value (zones and zone hints are label values), possibly empty."""
    return _matching(value, _LABEL_VALUE, 63, "label value")


def one_of(value: object, allowed: Collection[str]) -> str:
    text = string(value)
    if text not in allowed:
        choices = ", ".join(sorted(allowed))
        raise FieldError(f"{show(text)} is not one of {choices}")
    return text


def boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise FieldError(f"expected true or false, got {got(value)}")
    return value


def integer(value: object, low: int, high: int, what: str) -> int:
    """An integer in [low, high]; YAML booleans and floats are refused, not coerced."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(f"expected an integer, got {got(value)}")
    if not low <= value <= high:
        raise FieldError(f"{show(value)} is not a valid {what} ({low}-{high})")
    return value


MAX_WEIGHT = 1000


def weight(value: object) -> int:
    """An endpoint weight (docs/weights.md): 0 drains the endpoint, the rest share new
    connections in proportion. The cap keeps a weighted nft choice at most 1 000 slots per
    endpoint and every cascade denominator within what the analysis decodes exactly."""
    return integer(value, 0, MAX_WEIGHT, "weight")


def port(value: object) -> int:
    return integer(value, 1, MAX_PORT, "port")


def family_of(address: str) -> IPFamily:
    return IPFamily.V6 if ":" in address else IPFamily.V4


def _family_name(family: IPFamily) -> str:
    return "IPv6" if family is IPFamily.V6 else "IPv4"


def ip_address(value: object, family: IPFamily | None = None) -> str:
    """A canonical (compressed) IP address, optionally of one family."""
    text = string(value)
    if len(text) > 45 or not _IP_CHARS.fullmatch(text):
        raise FieldError(f"{show(text)} is not a valid IP address")
    try:
        parsed = ipaddress.ip_address(text)
    except ValueError:
        raise FieldError(f"{show(text)} is not a valid IP address") from None
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        # Go parses these as IPv4, Python as IPv6: refuse rather than guess the family.
        raise FieldError(f"{show(text)} is an IPv4-mapped IPv6 address; write the IPv4 address")
    canonical = parsed.compressed
    if family is not None and family_of(canonical) is not family:
        raise FieldError(f"{show(text)} is not an {_family_name(family)} address")
    return canonical


# KEP-4858: before Kubernetes validated IPs strictly, the API server stored what Go's pre-1.17
# parser accepted, and kube-proxy still reads those fields with netutils' forked copy of it
# (`ParseIPSloppy`, `ParseCIDRSloppy`): an IPv4 part may carry leading zeros, read as DECIMAL
# (`010.001.002.003` is 10.1.2.3; C's inet_aton would read 8.1.2.3), an IPv6 group may be
# zero-padded past four digits while it stays <= ffff, and a CIDR's prefix length may be padded
# (`/025`). The fields it reads that way are the sources' to choose (see `sloppy_ip`); the
# result is canonical, so nothing downstream ever sees the padding.
_SLOPPY_V4_PART = re.compile(r"[0-9]{1,12}")
_SLOPPY_V6_GROUP = re.compile(r"[0-9A-Fa-f]{1,12}")
_SLOPPY_PREFIX = re.compile(r"[0-9]{1,12}")


def _unpad_ipv4(text: str) -> str | None:
    """`text` as strict dotted decimal, if Go's old parser reads it as IPv4 (else None)."""
    parts = text.split(".")
    if len(parts) != 4 or not all(_SLOPPY_V4_PART.fullmatch(p) and int(p) <= 255 for p in parts):
        return None
    return ".".join(str(int(p)) for p in parts)


def _unpad(text: str) -> str:
    """`text` with the padding Go's old parser allowed removed; anything else is left for the
    strict parser to refuse."""
    if "." in text and (":" not in text or text.index(".") < text.index(":")):
        return _unpad_ipv4(text) or text
    if ":" not in text:
        return text
    head, _, last = text.rpartition(":")
    tail = _unpad_ipv4(last) if "." in last else None
    groups = (head.split(":") if tail is not None else text.split(":"))
    unpadded = [
        format(int(g, 16), "x") if _SLOPPY_V6_GROUP.fullmatch(g) and int(g, 16) <= 0xFFFF else g
        for g in groups
    ]
    return ":".join(unpadded + ([tail] if tail is not None else []))


def sloppy_ip(value: object, family: IPFamily | None = None) -> str:
    """`ip_address` for fields kube-proxy reads with netutils.ParseIPSloppy: Service cluster
    IPs and load-balancer ingress IPs, Node addresses."""
    return _sloppy(ip_address, value, family, "IP address")


def sloppy_endpoint_address(value: object, family: IPFamily | None = None) -> str:
    """`endpoint_address`, read as `sloppy_ip`: EndpointSlice addresses and external IPs."""
    return _sloppy(endpoint_address, value, family, "IP address")


def sloppy_cidr(value: object, family: IPFamily | None = None) -> str:
    """`cidr` for fields kube-proxy reads with netutils.ParseCIDRSloppy: loadBalancerSourceRanges
    and a Node's pod CIDRs. The prefix length may be zero-padded too (`/025`)."""
    return _sloppy(cidr, value, family, "CIDR")


def _sloppy(validator: Callable[..., str], value: object, family: IPFamily | None, what: str) -> str:
    """The strict `validator` on the value with its padding removed; an error names the value as
    it was written."""
    text = string(value)
    if len(text) > 96:
        raise FieldError(f"{show(text)} is not a valid {what}")
    address, slash, prefix = text.partition("/")
    unpadded = _unpad(address)
    if slash and _SLOPPY_PREFIX.fullmatch(prefix):
        unpadded += f"/{int(prefix)}"
    elif slash:
        unpadded += f"/{prefix}"
    try:
        return validator(unpadded, family)
    except FieldError as exc:
        raise FieldError(str(exc).replace(show(unpadded), show(text), 1)) from None


def endpoint_address(value: object, family: IPFamily | None = None) -> str:
    """An IP a packet may be sent to or accepted for: endpoint and external IPs.

    Refuses what the API server refuses there (unspecified, loopback, link-local, multicast):
    traffic DNATed to or accepted for those would reach the node itself, not a backend.
    """
    canonical = ip_address(value, family)
    parsed = ipaddress.ip_address(canonical)
    if parsed.is_unspecified or parsed.is_loopback or parsed.is_link_local or parsed.is_multicast:
        raise FieldError(
            f"{show(canonical)} is an unspecified, loopback, link-local or multicast address"
        )
    return canonical


def cidr(value: object, family: IPFamily | None = None) -> str:
    """A canonical CIDR, host bits cleared (`10.0.0.1/8` -> `10.0.0.0/8`) as Go's ParseCIDR does."""
    text = string(value)
    if len(text) > 49 or not _CIDR_CHARS.fullmatch(text):
        raise FieldError(f"{show(text)} is not a valid CIDR")
    try:
        network = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise FieldError(f"{show(text)} is not a valid CIDR") from None
    if (
        isinstance(network, ipaddress.IPv6Network)
        and network.network_address.ipv4_mapped is not None
    ):
        raise FieldError(f"{show(text)} is an IPv4-mapped IPv6 CIDR; write the IPv4 CIDR")
    canonical = network.compressed
    if family is not None and family_of(canonical) is not family:
        raise FieldError(f"{show(text)} is not an {_family_name(family)} CIDR")
    return canonical


def ip_family(value: object) -> IPFamily:
    name = one_of(value, ("IPv4", "IPv6"))
    return IPFamily.V6 if name == "IPv6" else IPFamily.V4
