"""The rules file (SPEC §4): validation messages, bindings, providers, shipped config."""

import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyveil._errors import RulesError
from keyveil._rules import compile_path_glob, load_provider_list, load_rules, parse_rules, shipped_config_dir

CONFIG = Path(__file__).resolve().parents[1] / "config"


def rules(text: str, **kw):
    return parse_rules(textwrap.dedent(text), "rules.yaml", **kw)


def error(text: str, **kw) -> str:
    with pytest.raises(RulesError) as e:
        rules(text, **kw)
    return str(e.value)


SECRET = """\
version: 1
secrets:
  github/pat:
    hosts: [api.github.com]
    inject: [{header: Authorization}]
"""


# --- shipped files ---------------------------------------------------------------------


def test_shipped_config_dir_holds_the_shipped_files():
    assert (shipped_config_dir() / "providers.yaml").is_file()
    assert (shipped_config_dir() / "rules.example.yaml").is_file()


def test_example_rules_load_and_bind_as_documented():
    r = load_rules(CONFIG / "rules.example.yaml")
    assert r.names() == ["github/pat", "anthropic/key"]
    got = r.bindings("api.github.com", 443, "https", "GET", "/user")
    assert [i.location for i in got["github/pat"]] == ["header:authorization", "basic_auth"]
    assert list(r.bindings("raw.githubusercontent.com", 443, "https", "GET", "/o/r/main/x")) == ["github/pat"]
    assert list(r.bindings("api.anthropic.com", 443, "https", "POST", "/v1/messages")) == ["anthropic/key"]
    assert r.bindings("api.gitlab.com", 443, "https", "GET", "/") == {}
    assert r.is_provider("llm.internal.example.com", 443)
    assert r.is_provider("api.openai.com", 443)
    assert r.policy.plaintext_elsewhere == "block"
    assert r.policy.max_body_bytes == 67108864
    assert not r.is_passthrough("api.github.com", 443)


def test_example_restrictions_left_as_comments_are_valid_too():
    text = (CONFIG / "rules.example.yaml").read_text()
    for field in ("methods", "paths", "allow_http"):
        assert f"    # {field}:" in text
        text = text.replace(f"    # {field}:", f"    {field}:")
    r = parse_rules(text, "rules.example.yaml")
    assert r.bindings("api.github.com", 443, "https", "GET", "/repos/o/r")
    assert not r.bindings("api.github.com", 443, "https", "DELETE", "/repos/o/r")
    assert not r.bindings("api.github.com", 443, "https", "GET", "/user")
    assert r.bindings("api.github.com", 80, "http", "GET", "/repos/o/r")


def test_example_table():
    r = load_rules(CONFIG / "rules.example.yaml")
    assert r.table() == [
        ("github/pat", "api.github.com, github.com, *.githubusercontent.com", "header:authorization, basic_auth", "-"),
        ("anthropic/key", "api.anthropic.com", "header:x-api-key", "-"),
    ]


@pytest.mark.parametrize(
    "host",
    [
        "api.anthropic.com",
        "statsig.anthropic.com",
        "claude.ai",
        "api.openai.com",
        "chatgpt.com",
        "generativelanguage.googleapis.com",
        "cloudcode-pa.googleapis.com",
        "aiplatform.googleapis.com",
        "us-central1-aiplatform.googleapis.com",
        "europe-west4-aiplatform.googleapis.com",
        "bedrock-runtime.us-east-1.amazonaws.com",
        "bedrock-runtime.eu-west-1.amazonaws.com",
        "my-resource.openai.azure.com",
        "my-resource.cognitiveservices.azure.com",
        "openrouter.ai",
        "api.mistral.ai",
        "api.deepseek.com",
        "api.groq.com",
        "api.x.ai",
        "api.together.xyz",
        "api.fireworks.ai",
        "api.cohere.com",
        "api.perplexity.ai",
        "api.githubcopilot.com",
        "api.individual.githubcopilot.com",
        "copilot-proxy.githubusercontent.com",
        "api2.cursor.sh",
        "o1158394.ingest.us.sentry.io",
        "http-intake.logs.us5.datadoghq.com",
        "play.googleapis.com",
    ],
)
def test_providers_file_covers_the_spec_vendors(host):
    assert rules("version: 1\n").is_provider(host, 443)


@pytest.mark.parametrize("host", ["api.github.com", "github.com", "example.com", "pypi.org", "googleapis.com"])
def test_providers_file_leaves_out_non_vendors(host):
    assert not rules("version: 1\n").is_provider(host, 443)


def test_providers_file_is_valid_on_its_own():
    patterns = load_provider_list(CONFIG / "providers.yaml")
    assert len(patterns) > 50
    assert len({str(p) for p in patterns}) == len(patterns), "no pattern listed twice"


def test_builtin_providers_can_be_turned_off():
    r = rules(
        """\
        version: 1
        providers:
          builtin: false
          hosts: [llm.internal.example.com, "*.gateway.example.net:8443"]
        """
    )
    assert not r.is_provider("api.anthropic.com", 443)
    assert r.is_provider("llm.internal.example.com", 443)
    assert r.is_provider("a.gateway.example.net", 8443)
    assert not r.is_provider("a.gateway.example.net", 443)


def test_custom_providers_file_replaces_the_shipped_one(tmp_path):
    (tmp_path / "p.yaml").write_text("version: 1\nhosts: [llm.example.org]\n")
    r = rules("version: 1\n", providers_file=tmp_path / "p.yaml")
    assert r.is_provider("llm.example.org", 443)
    assert not r.is_provider("api.anthropic.com", 443)


def test_invalid_providers_file_names_its_own_file_and_line(tmp_path):
    (tmp_path / "p.yaml").write_text("version: 1\nhosts:\n  - ok.example.org\n  - '*.com'\n")
    msg = error("version: 1\n", providers_file=tmp_path / "p.yaml")
    assert msg.startswith(f"{tmp_path / 'p.yaml'}:4: hosts[1]: host pattern '*.com' is too broad")


def test_missing_providers_file_is_refused(tmp_path):
    msg = error("version: 1\n", providers_file=tmp_path / "nope.yaml")
    assert msg.startswith(f"{tmp_path / 'nope.yaml'}:1: (file): cannot read the provider list")


# --- error messages: FILE:LINE: FIELD: what is wrong -----------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", "rules.yaml:1: (top level): the rules file is empty; it needs at least `version: 1`"),
        ("# only a comment\n", "rules.yaml:1: (top level): the rules file is empty; it needs at least `version: 1`"),
        ("\n\n- a\n", "rules.yaml:3: (top level): expected a mapping starting with `version: 1`, got a list"),
        ("secrets: {}\n", "rules.yaml:1: version: required: start the file with `version: 1`"),
        ("\nversion: 2\n", "rules.yaml:2: version: unsupported version: this keyveil reads `version: 1`"),
        ("version: '1'\n", "rules.yaml:1: version: unsupported version: this keyveil reads `version: 1`"),
        ("version: true\n", "rules.yaml:1: version: unsupported version: this keyveil reads `version: 1`"),
        ("version: 1.0\n", "rules.yaml:1: version: unsupported version: this keyveil reads `version: 1`"),
        ("version: 1\npolicyy: {}\n", "rules.yaml:2: policyy: unknown field; did you mean 'policy'?"),
        (
            "version: 1\nzzz: 1\n",
            "rules.yaml:2: zzz: unknown field; expected one of: version, providers, secrets, policy, passthrough, agents",
        ),
        ("version: 1\nsecrets: [\n", "rules.yaml:3: (yaml): while parsing a flow node; expected the node content, but found '<stream end>'"),
        ("version: 1\nsecrets: a: b\n", "rules.yaml:2: (yaml): mapping values are not allowed here"),
        ("version: 1\n---\nversion: 1\n", "rules.yaml:2: (yaml): expected a single document in the stream; but found another document"),
        (
            "version: 1\npolicy:\n  plaintext_elsewhere: maybe\n",
            "rules.yaml:3: policy.plaintext_elsewhere: must be one of 'block', 'seal' or 'allow'",
        ),
        (
            "version: 1\npolicy:\n  unbound_reference: yes\n",
            "rules.yaml:3: policy.unbound_reference: must be one of 'block_auth', 'block' or 'pass'",
        ),
        ("version: 1\npolicy:\n\n  max_body_bytes: 0\n", "rules.yaml:4: policy.max_body_bytes: must be greater than 0"),
        (
            "version: 1\npolicy:\n  max_body_bytes: '64MB'\n",
            "rules.yaml:3: policy.max_body_bytes: expected a whole number, got text",
        ),
        ("version: 1\nproviders:\n  builtin: 'no'\n", "rules.yaml:3: providers.builtin: expected true or false, got text"),
        ("version: 1\nsecrets:\n", "rules.yaml:2: secrets: expected a mapping, got nothing (null)"),
        ("version: 1\npassthrough: example.org\n", "rules.yaml:2: passthrough: expected a list, got text"),
    ],
)
def test_top_level_errors(text, expected):
    assert error(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                hsts: [github.com]
                inject: [{header: Authorization}]
            """,
            "rules.yaml:5: secrets.github/pat.hsts: unknown field; did you mean 'hosts'?",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts:
                  - api.github.com
                  - "*.com"
                inject: [{header: Authorization}]
            """,
            "rules.yaml:6: secrets.github/pat.hosts[1]: host pattern '*.com' is too broad: "
            "it would match every host under .com; bind the hosts you use (e.g. *.example.com)",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: ["*"]
                inject: [{header: Authorization}]
            """,
            "rules.yaml:4: secrets.github/pat.hosts[0]: host pattern '*' would match every host: "
            "name the hosts a value may go to",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [co.uk]
                inject: [{header: Authorization}]
            """,
            "rules.yaml:4: secrets.github/pat.hosts[0]: host pattern 'co.uk' is a public suffix, not a host: "
            "name the host itself (e.g. api.example.co.uk)",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: []
                inject: [{header: Authorization}]
            """,
            "rules.yaml:4: secrets.github/pat.hosts: list at least one host: "
            "a value goes only to the hosts it is bound to",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
            """,
            "rules.yaml:3: secrets.github/pat.inject: list at least one inject location "
            "(e.g. - header: Authorization): binding a value everywhere in a request defeats I2 (bind)",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject: []
            """,
            "rules.yaml:5: secrets.github/pat.inject: list at least one inject location "
            "(e.g. - header: Authorization): binding a value everywhere in a request defeats I2 (bind)",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject:
                  - header: Authorization
                  - header: Authorization
                    query: token
            """,
            "rules.yaml:7: secrets.github/pat.inject[1]: an inject entry names exactly one location, "
            "got header and query: write one entry per location",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject:
                  - {}
            """,
            "rules.yaml:6: secrets.github/pat.inject[0]: an inject entry names one location: header: NAME, "
            "basic_auth: true, query: PARAM, path: true, body: true or websocket: true",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject:
                  - header: Authorization
                  - header: authorization
            """,
            "rules.yaml:5: secrets.github/pat.inject: inject location header:authorization is listed twice",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject:
                  - hedaer: Authorization
            """,
            "rules.yaml:6: secrets.github/pat.inject[0].hedaer: unknown field; did you mean 'header'?",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject:
                  - header: "Author ization"
            """,
            "rules.yaml:6: secrets.github/pat.inject[0].header: 'Author ization' is not a valid HTTP header name",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject:
                  - header: Host
            """,
            "rules.yaml:6: secrets.github/pat.inject[0].header: keyveil does not inject into Host: "
            "that header frames or routes the request",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject:
                  - basic_auth: false
            """,
            "rules.yaml:6: secrets.github/pat.inject[0].basic_auth: write true here, or leave the entry out",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject: [{header: Authorization}]
                methods: [GET, "P OST"]
            """,
            "rules.yaml:6: secrets.github/pat.methods[1]: 'P OST' is not a valid HTTP method",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject: [{header: Authorization}]
                paths:
                  - /repos/**
                  - repos/*
            """,
            "rules.yaml:8: secrets.github/pat.paths[1]: path glob 'repos/*' must start with '/' "
            "(it matches the URL path)",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject: [{header: Authorization}]
                paths: []
            """,
            "rules.yaml:6: secrets.github/pat.paths: list at least one path glob, "
            "or leave paths out to allow every path",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
                hosts: [api.github.com]
                inject: [{header: Authorization}]
                allow_http: yes please
            """,
            "rules.yaml:6: secrets.github/pat.allow_http: expected true or false, got text",
        ),
        (
            """\
            version: 1
            secrets:

              ../etc:
                hosts: [api.github.com]
                inject: [{header: Authorization}]
            """,
            "rules.yaml:4: secrets.../etc: invalid secret name '../etc': use segments of letters, digits, "
            "'.', '_' or '-' joined by '/', each starting with a letter or digit (e.g. github/pat)",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat: {hosts: [api.github.com], inject: [{header: Authorization}]}
              github/pat: {hosts: [github.com], inject: [{header: Authorization}]}
            """,
            "rules.yaml:4: secrets.github/pat: duplicate key (line 3 sets it too)",
        ),
        (
            """\
            version: 1
            secrets:
              github/pat:
            """,
            "rules.yaml:3: secrets.github/pat: expected a mapping, got nothing (null)",
        ),
    ],
)
def test_secret_errors(text, expected):
    assert error(text) == expected


def test_several_errors_are_all_reported_in_file_order():
    msg = error(
        """\
        version: 1
        secrets:
          a/b:
            hosts: ["*.com"]
            inject: [{header: A}]
        policy:
          undecodable_body: maybe
        """
    )
    assert msg.splitlines() == [
        "rules.yaml:4: secrets.a/b.hosts[0]: host pattern '*.com' is too broad: it would match every host "
        "under .com; bind the hosts you use (e.g. *.example.com)",
        "rules.yaml:7: policy.undecodable_body: must be one of 'block' or 'pass'",
    ]


def test_messages_do_not_echo_misplaced_text():
    # A value pasted into the wrong field must not be printed back (I5).
    pasted = "ghp_" + "Zq8" * 12
    msg = error(f"version: 1\npolicy:\n  max_body_bytes: {pasted}\n  plaintext_elsewhere: {pasted}\n")
    assert pasted not in msg
    assert "rules.yaml:3: policy.max_body_bytes:" in msg


def test_merge_keys_and_anchors_report_the_line_of_the_problem():
    msg = error(
        """\
        version: 1
        secrets:
          a: &base
            hosts: [a.example.com]
            inject: [{header: A}]
          b:
            <<: *base
            hosts: ["*.co.uk"]
        """
    )
    assert msg.startswith("rules.yaml:8: secrets.b.hosts[0]: host pattern '*.co.uk' is too broad")


def test_anchors_are_usable():
    r = rules(
        """\
        version: 1
        secrets:
          a: &base
            hosts: [a.example.com]
            inject: [{header: A}]
          b:
            <<: *base
            inject: [{header: B}]
        """
    )
    assert [i.location for i in r.bindings("a.example.com", 443, "https", "GET", "/")["b"]] == ["header:b"]


# --- load_rules ----------------------------------------------------------------------------


def test_load_rules_names_the_file(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("version: 1\nsecrets:\n  x:\n    hosts: [example.com]\n    inject: [{header: A}]\n    hsts: []\n")
    with pytest.raises(RulesError) as e:
        load_rules(path)
    assert str(e.value) == f"{path}:6: secrets.x.hsts: unknown field; did you mean 'hosts'?"
    assert e.value.exit_code == 1


def test_load_rules_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(RulesError, match=r"nope\.yaml:1: \(file\): cannot read the rules file"):
        load_rules(path)


def test_load_rules_not_utf8(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_bytes(b"version: 1\n# \xff\n")
    with pytest.raises(RulesError, match=r"rules\.yaml:1: \(file\): the rules file is not UTF-8 text"):
        load_rules(path)


# --- bindings: hosts, methods, paths, scheme ---------------------------------------------


def test_host_matching_in_bindings_is_normalised():
    r = rules(SECRET)
    assert "github/pat" in r.bindings("API.GitHub.COM.", 443, "https", "GET", "/")
    assert r.bindings("api.github.com", 8443, "https", "GET", "/") == {}
    assert r.bindings("github.com", 443, "https", "GET", "/") == {}


def test_several_secrets_on_one_host():
    r = rules(
        """\
        version: 1
        secrets:
          a: {hosts: ["*.example.com"], inject: [{header: A}]}
          b: {hosts: [api.example.com], inject: [{query: key}]}
          c: {hosts: [other.example.org], inject: [{body: true}]}
        """
    )
    got = r.bindings("api.example.com", 443, "https", "GET", "/")
    assert {name: [i.location for i in injects] for name, injects in got.items()} == {
        "a": ["header:a"],
        "b": ["query:key"],
    }
    assert list(r.bindings("deep.api.example.com", 443, "https", "GET", "/")) == ["a"]
    assert r.bindings("example.com", 443, "https", "GET", "/") == {}


def test_inject_locations():
    r = rules(
        """\
        version: 1
        secrets:
          a:
            hosts: [api.example.com]
            inject:
              - header: X-Api-Key
              - basic_auth: true
              - query: access_token
              - path: true
              - body: true
              - websocket: true
        """
    )
    got = r.bindings("api.example.com", 443, "https", "GET", "/")["a"]
    assert [i.location for i in got] == [
        "header:x-api-key",
        "basic_auth",
        "query:access_token",
        "path",
        "body",
        "websocket",
    ]


RESTRICTED = """\
version: 1
secrets:
  github/pat:
    hosts: [api.github.com]
    inject: [{header: Authorization}]
    methods: [get, POST]
    paths: ["/repos/*/issues", "/orgs/**"]
"""


@pytest.mark.parametrize(
    "method, path, bound",
    [
        ("GET", "/repos/octo/issues", True),
        ("get", "/repos/octo/issues", True),
        ("POST", "/repos/octo/issues?state=open", True),
        ("DELETE", "/repos/octo/issues", False),
        ("GET", "/repos/octo/x/issues", False),  # * stays within one segment
        ("GET", "/repos//issues", True),
        ("GET", "/repos/octo/issues/1", False),
        ("GET", "/orgs", True),  # /orgs/** matches /orgs itself
        ("GET", "/orgs/", True),
        ("GET", "/orgs/a/b/c", True),
        ("GET", "/orgsx", False),
        ("GET", "/user", False),
        ("GET", "/orgs/../user", False),  # would reach /user on the server
        ("GET", "/orgs/%2e%2e/user", False),
        ("GET", "/repos/../issues", False),
    ],
)
def test_method_and_path_restrictions(method, path, bound):
    r = rules(RESTRICTED)
    assert ("github/pat" in r.bindings("api.github.com", 443, "https", method, path)) is bound


@pytest.mark.parametrize(
    "glob, path, expected",
    [
        ("/a/*", "/a/b", True),
        ("/a/*", "/a/b/c", False),
        ("/a/*.json", "/a/x.json", True),
        ("/a/**/z", "/a/z", True),
        ("/a/**/z", "/a/b/c/z", True),
        ("/a/**/z", "/a/b/c/y", False),
        ("/a**", "/abc/d", True),
        ("/**", "/", True),
        ("/v1.0/x", "/v1x0/x", False),  # '.' is literal, not a regex wildcard
        ("/a+b", "/a+b", True),
    ],
)
def test_path_globs(glob, path, expected):
    assert (compile_path_glob(glob).fullmatch(path) is not None) is expected


@given(st.text(alphabet="abc/.-_", max_size=20))
def test_glob_without_stars_is_literal(path):
    glob = "/" + path
    assert compile_path_glob(glob).fullmatch(glob)
    assert not compile_path_glob(glob).fullmatch(glob + "x")


def test_http_is_never_bound_without_allow_http():
    r = rules(SECRET)
    assert r.bindings("api.github.com", 80, "http", "GET", "/") == {}
    assert r.blocked_by_scheme("api.github.com", 80, "http", "GET", "/") == {"github/pat"}
    assert r.blocked_by_scheme("api.github.com", 443, "https", "GET", "/") == set()
    assert r.blocked_by_scheme("example.org", 80, "http", "GET", "/") == set()


def test_allow_http_binds_plain_http():
    r = rules(SECRET + "    allow_http: true\n")
    assert list(r.bindings("api.github.com", 80, "http", "GET", "/")) == ["github/pat"]
    assert r.blocked_by_scheme("api.github.com", 80, "http", "GET", "/") == set()
    # Without a port in the pattern, http means port 80, not 443.
    assert r.bindings("api.github.com", 443, "http", "GET", "/") == {}


def test_scheme_block_respects_method_and_path_restrictions():
    r = rules(RESTRICTED)
    assert r.blocked_by_scheme("api.github.com", 80, "http", "GET", "/orgs/a") == {"github/pat"}
    assert r.blocked_by_scheme("api.github.com", 80, "http", "GET", "/user") == set()


def test_bound_elsewhere_hint():
    r = rules(
        """\
        version: 1
        secrets:
          gitlab/token:
            hosts: [gitlab.com, "*.gitlab.example.com:8443"]
            inject: [{header: PRIVATE-TOKEN}]
        """
    )
    assert r.bound_elsewhere_hint("gitlab/token") == "gitlab.com, *.gitlab.example.com:8443"
    assert "not in the rules file" in r.bound_elsewhere_hint("nope")


def test_table_lists_restrictions():
    r = rules(RESTRICTED.replace("    paths:", "    allow_http: true\n    paths:"))
    assert r.table() == [
        (
            "github/pat",
            "api.github.com",
            "header:authorization",
            "methods GET, POST; paths /repos/*/issues, /orgs/**; allow_http",
        )
    ]


# --- passthrough ------------------------------------------------------------------------


def test_passthrough_hosts_are_matched():
    r = rules(SECRET + "passthrough: [updates.example.org, '*.cdn.example.net']\n")
    assert r.is_passthrough("updates.example.org", 443)
    assert r.is_passthrough("a.cdn.example.net", 443)
    assert not r.is_passthrough("updates.example.org", 8443)
    assert not r.is_passthrough("api.github.com", 443)


@pytest.mark.parametrize(
    "through, expected",
    [
        (
            "api.github.com",
            "rules.yaml:8: passthrough[1]: api.github.com is a host of secret github/pat: "
            "a bound host must be intercepted; remove it from passthrough",
        ),
        (
            "'*.github.com'",
            "rules.yaml:8: passthrough[1]: *.github.com overlaps api.github.com, a host of secret github/pat: "
            "a bound host must be intercepted; remove it from passthrough",
        ),
        (
            "api.github.com:443",
            "rules.yaml:8: passthrough[1]: api.github.com:443 overlaps api.github.com, a host of secret github/pat: "
            "a bound host must be intercepted; remove it from passthrough",
        ),
        (
            "api.openai.com",
            "rules.yaml:8: passthrough[1]: api.openai.com is a model-vendor host: "
            "its traffic must be sealed; remove it from passthrough",
        ),
        (
            "'*.azure.com'",
            "rules.yaml:8: passthrough[1]: *.azure.com overlaps *.openai.azure.com, a model-vendor host: "
            "its traffic must be sealed; remove it from passthrough",
        ),
    ],
)
def test_passthrough_of_a_bound_or_provider_host_is_refused(through, expected):
    assert error(SECRET + f"passthrough:\n  - ok.example.org\n  - {through}\n") == expected


def test_passthrough_on_another_port_than_the_binding_is_allowed():
    r = rules(SECRET + "passthrough: ['api.github.com:8443']\n")
    assert r.is_passthrough("api.github.com", 8443)
    assert "github/pat" in r.bindings("api.github.com", 443, "https", "GET", "/")
