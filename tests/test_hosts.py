"""Hosts (SPEC §4): normalisation, host patterns, over-broad refusals, fast matching."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyveil._hosts import HostMap, HostSet, normalize_host, parse_host_pattern, patterns_overlap

# --- normalize_host -----------------------------------------------------------------


@pytest.mark.parametrize(
    "host, expected",
    [
        ("API.GitHub.com", "api.github.com"),
        ("api.github.com.", "api.github.com"),
        ("Bücher.example", "xn--bcher-kva.example"),
        ("BÜCHER.example.", "xn--bcher-kva.example"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("ＡＰＩ.example.com", "api.example.com"),  # full-width letters, UTS #46 mapping
        ("r3---sn-abc.googlevideo.com", "r3---sn-abc.googlevideo.com"),  # real hosts have `--`
        ("_dmarc.example.com", "_dmarc.example.com"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]", "::1"),
        ("::1", "::1"),
        ("[2001:DB8:0:0::1]", "2001:db8::1"),
        ("localhost", "localhost"),
    ],
)
def test_normalize_host(host, expected):
    assert normalize_host(host) == expected


@pytest.mark.parametrize(
    "host, reason",
    [
        ("", "empty host"),
        (".", "empty host"),
        ("a..b", "empty label"),
        ("api.github.com..", "empty label"),
        ("ex ample.com", "invalid label"),
        ("-a.example.com", "invalid label"),
        ("a" * 64 + ".com", "invalid label"),
        ("x." * 127 + "com", "longer than 253"),
        ("xn--abc.example", "invalid IDNA label"),
        ("127.1", "not a valid IPv4"),
        ("2130706433", "not a valid IPv4"),
        ("[::g]", "not a valid IPv6"),
    ],
)
def test_normalize_host_refuses_with_reason(host, reason):
    with pytest.raises(ValueError, match=reason):
        normalize_host(host)


label = st.from_regex(r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,8}[a-zA-Z0-9])?", fullmatch=True)
unicode_label = st.text(st.characters(categories=["Ll", "Lu", "Nd"]), min_size=1, max_size=8)
hosts = st.lists(st.one_of(label, unicode_label), min_size=1, max_size=4).map(".".join)


@given(hosts, st.booleans())
def test_normalisation_is_idempotent(host, trailing_dot):
    try:
        once = normalize_host(host + ("." if trailing_dot else ""))
    except ValueError:
        return  # not every Unicode string is a host; refusing it is fine
    assert normalize_host(once) == once
    assert once == once.lower() and once.isascii() and not once.endswith(".")


@given(st.lists(label, min_size=2, max_size=4).map(".".join))
def test_case_and_trailing_dot_do_not_change_the_host(host):
    if host.rpartition(".")[2].isdigit():
        return  # numeric TLD: IPv4 rules apply
    assert normalize_host(host.upper() + ".") == normalize_host(host) == host.lower()


# --- parse_host_pattern ---------------------------------------------------------------


def test_parse_exact_and_wildcard_and_port():
    p = parse_host_pattern("API.GitHub.com")
    assert (p.host, p.wildcard, p.port, p.text) == ("api.github.com", False, None, "API.GitHub.com")
    p = parse_host_pattern("*.githubusercontent.com:8443")
    assert (p.host, p.wildcard, p.port) == ("githubusercontent.com", True, 8443)
    p = parse_host_pattern("[::1]:8443")
    assert (p.host, p.wildcard, p.port) == ("::1", False, 8443)
    assert str(p) == "[::1]:8443"
    p = parse_host_pattern("10.0.0.7:8080")
    assert (p.host, p.port) == ("10.0.0.7", 8080)
    assert str(parse_host_pattern("*.Bücher.example")) == "*.xn--bcher-kva.example"


@pytest.mark.parametrize(
    "text, reason",
    [
        ("*", "would match every host"),
        ("*.", "would match every host"),
        ("*.com", r"too broad: it would match every host under \.com"),
        ("*.localhost", "too broad"),
        ("*.co.uk", "too broad: co.uk is a public suffix"),
        ("*.com.au", "too broad: com.au is a public suffix"),
        ("*.foo.ck", "too broad: foo.ck is a public suffix"),  # PSL wildcard rule *.ck
        ("com", "is a public suffix, not a host"),
        ("co.uk", "is a public suffix, not a host"),
        ("COM.", "is a public suffix, not a host"),
        ("x.*.example.com", r"only as a leading '\*\.'"),
        ("*example.com", r"only as a leading '\*\.'"),
        ("*.*.example.com", r"only as a leading '\*\.'"),
        ("api.*", r"only as a leading '\*\.'"),
        ("https://api.github.com", "has a scheme"),
        ("api.github.com/repos", "has a path"),
        ("user@api.github.com", "user information"),
        ("api..github.com", "empty label"),
        ("", "empty host pattern"),
        ("api.github.com:0", "port must be a number from 1 to 65535"),
        ("api.github.com:65536", "port must be a number from 1 to 65535"),
        ("api.github.com:", "port must be a number from 1 to 65535"),
        ("api.github.com:https", "port must be a number from 1 to 65535"),
        ("::1", "in brackets"),
        ("[::1", r"missing '\]'"),
        ("[::1]x", "unexpected text"),
        ("*.10.0.0.1", "IP address"),
        (" api.github.com", "whitespace"),
    ],
)
def test_parse_refuses_with_exact_reason(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_host_pattern(text)


@pytest.mark.parametrize(
    "text",
    [
        "*.githubusercontent.com",  # SPEC §4's own example: a private-section PSL entry
        "*.example.co.uk",
        "*.www.ck",  # PSL exception rule !www.ck
        "github.io",  # an exact host, even if the private PSL section lists it
        "localhost",
        "*.openai.azure.com",
    ],
)
def test_parse_accepts_narrow_patterns(text):
    parse_host_pattern(text)


def test_parse_refuses_non_text():
    with pytest.raises(ValueError, match="host pattern"):
        parse_host_pattern(443)  # type: ignore[arg-type]


# --- HostPattern.matches ---------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, host, port, default_port, expected",
    [
        ("api.github.com", "api.github.com", 443, 443, True),
        ("api.github.com", "API.GITHUB.COM.", 443, 443, True),
        ("api.github.com", "github.com", 443, 443, False),
        ("api.github.com", "xapi.github.com", 443, 443, False),
        ("api.github.com", "api.github.com.evil.com", 443, 443, False),
        ("api.github.com", "api.github.com", 8443, 443, False),
        ("api.github.com", "api.github.com", 80, 80, True),  # http default port
        ("api.github.com", "api.github.com", 443, 80, False),  # https port over http
        ("api.github.com:8443", "api.github.com", 8443, 443, True),
        ("api.github.com:8443", "api.github.com", 443, 443, False),
        ("*.example.com", "a.example.com", 443, 443, True),
        ("*.example.com", "a.b.c.example.com", 443, 443, True),
        ("*.example.com", "example.com", 443, 443, False),
        ("*.example.com", "badexample.com", 443, 443, False),
        ("*.example.com", "a.example.com.evil.net", 443, 443, False),
        ("*.example.com", "a..example.com", 443, 443, False),
        ("*.example.com:9000", "a.example.com", 9000, 443, True),
        ("*.example.com:9000", "a.example.com", 443, 443, False),
        ("Bücher.example", "xn--bcher-kva.example", 443, 443, True),
        ("xn--bcher-kva.example", "BÜCHER.example", 443, 443, True),
        ("[::1]:8443", "::1", 8443, 443, True),
        ("[::1]:8443", "[0:0::1]", 8443, 443, True),
        ("127.0.0.1", "127.0.0.1", 443, 443, True),
        ("127.0.0.1", "127.1", 443, 443, False),  # not canonical: never matched
    ],
)
def test_pattern_matches(pattern, host, port, default_port, expected):
    p = parse_host_pattern(pattern)
    assert p.matches(host, port, default_port) is expected
    assert HostSet([p]).matches(host, port, default_port) is expected


# --- HostSet / HostMap -------------------------------------------------------------------

PATTERNS = ["api.github.com", "github.com", "*.githubusercontent.com", "*.corp.example.com:8443", "[::1]:9000"]
CANDIDATES = [
    ("api.github.com", 443),
    ("github.com", 80),
    ("gist.github.com", 443),
    ("raw.githubusercontent.com", 443),
    ("a.b.githubusercontent.com", 443),
    ("githubusercontent.com", 443),
    ("x.corp.example.com", 8443),
    ("x.corp.example.com", 443),
    ("corp.example.com", 8443),
    ("::1", 9000),
    ("example.org", 443),
]


@pytest.mark.parametrize("default_port", [443, 80])
@pytest.mark.parametrize("host, port", CANDIDATES)
def test_hostset_agrees_with_patterns(host, port, default_port):
    patterns = [parse_host_pattern(t) for t in PATTERNS]
    expected = any(p.matches(host, port, default_port) for p in patterns)
    assert HostSet(patterns).matches(host, port, default_port) is expected


def test_hostset_examples():
    s = HostSet(parse_host_pattern(t) for t in PATTERNS)
    assert s.matches("raw.githubusercontent.com", 443)
    assert not s.matches("githubusercontent.com", 443)
    assert not s.matches("gist.github.com", 443)
    assert s.matches("x.corp.example.com", 8443)
    assert not s.matches("x.corp.example.com", 443)
    assert not HostSet([]).matches("api.github.com", 443)


def test_hostmap_returns_every_matching_item():
    m = HostMap(
        [
            (parse_host_pattern("api.github.com"), "exact"),
            (parse_host_pattern("*.github.com"), "sub"),
            (parse_host_pattern("*.api.github.com"), "deeper"),
            (parse_host_pattern("api.github.com:8443"), "port"),
        ]
    )
    assert sorted(m.lookup("api.github.com", 443)) == ["exact", "sub"]
    assert sorted(m.lookup("x.api.github.com", 443)) == ["deeper", "sub"]
    assert sorted(m.lookup("api.github.com", 8443)) == ["port"]
    assert list(m.lookup("not a host", 443)) == []


@given(st.lists(label, min_size=1, max_size=5).map(".".join), st.sampled_from([443, 80, 8443]))
def test_hostset_agrees_with_patterns_on_random_hosts(host, port):
    patterns = [parse_host_pattern(t) for t in PATTERNS + ["*.a.com", "b.a.com:80", "*.x.y"]]
    for candidate in (host, host + ".a.com", host + ".githubusercontent.com"):
        expected = any(p.matches(candidate, port) for p in patterns)
        assert HostSet(patterns).matches(candidate, port) is expected


# --- overlap ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ("api.github.com", "api.github.com", True),
        ("api.github.com", "github.com", False),
        ("*.github.com", "api.github.com", True),
        ("*.github.com", "github.com", False),
        ("*.github.com", "*.api.github.com", True),
        ("*.a.example.com", "*.b.example.com", False),
    ],
)
def test_patterns_overlap(a, b, expected):
    pa, pb = parse_host_pattern(a), parse_host_pattern(b)
    assert patterns_overlap(pa, pb) is expected
    assert patterns_overlap(pb, pa) is expected


@given(st.one_of(st.text(max_size=30), st.from_regex(r"(\*\.)?xn--[a-z0-9-]{1,12}(\.[a-z]{2,4})?(:[0-9]{1,6})?", fullmatch=True)))
def test_any_text_is_parsed_or_refused_with_valueerror(text):
    # The rules loader turns ValueError into FILE:LINE messages; anything else would crash it.
    for parse in (normalize_host, parse_host_pattern):
        try:
            parse(text)
        except ValueError:
            pass
