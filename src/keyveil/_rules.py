"""The rules file (SPEC §4): its models, its loading, and the binding lookups built from it.

A rules file says where each value may go (bindings), which hosts are model vendors
(providers) and what to do when a request breaks the rules (policy). This module
validates it once, with errors of the form ``FILE:LINE: FIELD: what is wrong``, and
compiles it into lookups that cost O(labels of the host) per request. It must never
accept a binding that could send a value to a host the user did not name, and never
put anything from the rules file but names, hosts and paths into a message.
"""

from __future__ import annotations

import difflib
import importlib.resources
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from keyveil._errors import RulesError
from keyveil._hosts import HostMap, HostPattern, HostSet, parse_host_pattern, patterns_overlap
from keyveil._references import check_name

# --- models ------------------------------------------------------------------------

# RFC 9110 token: what a header name or a method may be made of.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")

# Headers that frame or route the request: a value there would break the request or
# send it elsewhere, never authenticate it.
_NO_INJECT_HEADERS = frozenset(
    "host content-length transfer-encoding connection keep-alive proxy-connection te upgrade trailer".split()
)


def _method(method: str) -> str:
    if _TOKEN.match(method) is None:
        raise ValueError(f"{method!r} is not a valid HTTP method")
    return method.upper()


def _path_glob(glob: str) -> str:
    compile_path_glob(glob)
    return glob


# Host patterns are parsed by _hosts, whose ValueError becomes a field error here.
HostPatternField = Annotated[HostPattern, PlainValidator(parse_host_pattern)]
SecretName = Annotated[str, AfterValidator(check_name)]


def _bindable(name: str) -> str:
    # detect: a detected value (SPEC §3a) is never bound: it must be adopted under a name first.
    if name.startswith("detected/"):
        raise ValueError(
            f"{name} names a value keyveil detected, which is never injected; register it with "
            f"`keyveil secret adopt {name} NAME` and bind NAME instead"
        )
    return name


BindableName = Annotated[str, AfterValidator(check_name), AfterValidator(_bindable)]
Method = Annotated[str, AfterValidator(_method)]
PathGlob = Annotated[str, AfterValidator(_path_glob)]


class _Model(BaseModel):
    # strict: YAML's `yes`, `"1"` or `1` are not silently read as true, 1 or "1".
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Inject(_Model):
    """One place where a reference may be replaced by its value."""

    header: str | None = None
    basic_auth: bool | None = None
    query: str | None = None
    path: bool | None = None
    body: bool | None = None
    websocket: bool | None = None

    @field_validator("header")
    @classmethod
    def _check_header(cls, name: str) -> str:
        if _TOKEN.match(name) is None:
            raise ValueError(f"{name!r} is not a valid HTTP header name")
        if name.lower() in _NO_INJECT_HEADERS:
            raise ValueError(f"keyveil does not inject into {name}: that header frames or routes the request")
        return name

    @field_validator("query")
    @classmethod
    def _check_query(cls, name: str) -> str:
        if not name or any(c in "&=#" or not c.isprintable() for c in name):
            raise ValueError(f"{name!r} is not a usable query parameter name")
        return name

    @field_validator("basic_auth", "path", "body", "websocket")
    @classmethod
    def _check_flag(cls, flag: bool) -> bool:
        if not flag:
            raise ValueError("write true here, or leave the entry out")
        return flag

    @model_validator(mode="after")
    def _exactly_one(self) -> Inject:
        given = [name for name in type(self).model_fields if getattr(self, name) is not None]
        if not given:
            raise ValueError(
                "an inject entry names one location: header: NAME, basic_auth: true, "
                "query: PARAM, path: true, body: true or websocket: true"
            )
        if len(given) > 1:
            raise ValueError(
                f"an inject entry names exactly one location, got {' and '.join(given)}: "
                "write one entry per location"
            )
        return self

    @property
    def location(self) -> str:
        """A short key: `header:<lowercased name>`, `basic_auth`, `query:<param>`, `path`, ..."""
        if self.header is not None:
            return "header:" + self.header.lower()
        if self.query is not None:
            return "query:" + self.query
        for name in ("basic_auth", "path", "body", "websocket"):
            if getattr(self, name):
                return name
        raise AssertionError("validated Inject has a location")  # pragma: no cover


class SecretRule(_Model):
    """The binding of one secret: where its value may go, and in which locations."""

    hosts: list[HostPatternField] = Field(default=[], validate_default=True)
    inject: list[Inject] = Field(default=[], validate_default=True)
    methods: list[Method] | None = None
    paths: list[PathGlob] | None = None
    allow_http: bool = False

    @field_validator("hosts")
    @classmethod
    def _check_hosts(cls, hosts: list[HostPattern]) -> list[HostPattern]:
        if not hosts:
            raise ValueError("list at least one host: a value goes only to the hosts it is bound to")
        return hosts

    @field_validator("inject")
    @classmethod
    def _check_inject(cls, inject: list[Inject]) -> list[Inject]:
        if not inject:
            raise ValueError(
                "list at least one inject location (e.g. - header: Authorization): "
                "binding a value everywhere in a request defeats I2 (bind)"
            )
        seen: set[str] = set()
        for entry in inject:
            if entry.location in seen:
                raise ValueError(f"inject location {entry.location} is listed twice")
            seen.add(entry.location)
        return inject

    @field_validator("methods")
    @classmethod
    def _check_methods(cls, methods: list[str]) -> list[str]:
        if not methods:
            raise ValueError("list at least one method, or leave methods out to allow every method")
        return methods

    @field_validator("paths")
    @classmethod
    def _check_paths(cls, paths: list[str]) -> list[str]:
        if not paths:
            raise ValueError("list at least one path glob, or leave paths out to allow every path")
        return paths


class Policy(_Model):
    """What keyveil does when a request breaks the bindings (SPEC §4, §6)."""

    plaintext_elsewhere: Literal["block", "seal", "allow"] = "block"
    unbound_reference: Literal["block_auth", "block", "pass"] = "block_auth"
    undecodable_body: Literal["block", "pass"] = "block"
    max_body_bytes: int = Field(default=67108864, gt=0)
    # detect: values nobody registered toward a provider (SPEC §3a): sealed as
    # {{secret:detected/KIND-ID}} (seal), the request refused (block), or not looked for (off)
    detected: Literal["seal", "block", "off"] = "seal"

    @field_validator("detected", mode="before")
    @classmethod
    def _detected_off(cls, value: object) -> object:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false
    # true: `keyveil run` refuses to run CMD without --isolate (for teams that want containment always)
    require_isolation: bool = False
    # Destinations on this host or a private network (loopback, link-local, RFC 1918, the host's own
    # addresses) that a sandbox of `keyveil run --isolate` may reach through keyveil (docs/isolation.md).
    isolated_local_hosts: list[HostPatternField] = []


class Providers(_Model):
    """Model-vendor hosts: every value is sealed on the way there."""

    builtin: bool = True
    hosts: list[HostPatternField] = []


_AGENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def _agent_name(name: str) -> str:
    if _AGENT_NAME.match(name) is None:
        raise ValueError(
            f"{name!r} is not a usable agent name: up to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it is the proxy username)"
        )
    return name


AgentName = Annotated[str, AfterValidator(_agent_name)]


class AgentRule(_Model):
    """One agent (SPEC §4 `agents:`): the secrets its references may be injected for."""

    secrets: list[SecretName] = Field(default=[], validate_default=True)


def _check_version(cls: type, version: Any) -> Any:
    # Literal[1] alone would take `true` and `1.0`, which equal 1 in Python.
    if type(version) is not int:
        raise ValueError(_BAD_VERSION)
    return version


_BAD_VERSION = "unsupported version: this keyveil reads `version: 1`"


class Rules(_Model):
    """A whole rules file, validated."""

    version: Literal[1]
    providers: Providers = Providers()
    secrets: dict[BindableName, SecretRule] = {}
    policy: Policy = Policy()
    passthrough: list[HostPatternField] = []
    #: None: no agents, every client is the same (SPEC §4)
    agents: dict[AgentName, AgentRule] | None = None

    _check_version = field_validator("version", mode="before")(_check_version)


class ProviderList(_Model):
    """The shipped list of model-vendor hosts (config/providers.yaml)."""

    version: Literal[1]
    hosts: list[HostPatternField]

    _check_version = field_validator("version", mode="before")(_check_version)


def compile_path_glob(glob: str) -> re.Pattern[str]:
    """The regex of a path glob: `*` stays within one segment, `**` crosses segments.

    `/repos/**` matches `/repos` itself and everything below it.
    """
    if not glob.startswith("/"):
        raise ValueError(f"path glob {glob!r} must start with '/' (it matches the URL path)")
    if "?" in glob or "#" in glob:
        raise ValueError(f"path glob {glob!r} matches the path only: leave out '?query' and '#fragment'")
    parts = []
    for token in re.split(r"(/\*\*(?=/|\Z)|\*\*|\*)", glob):
        if token == "/**":
            parts.append("(?:/.*)?")
        elif token == "**":
            parts.append(".*")
        elif token == "*":
            parts.append("[^/]*")
        else:
            parts.append(re.escape(token))
    return re.compile("".join(parts), re.DOTALL)


def _has_dot_segment(path: str) -> bool:
    # `/repos/../admin` matches `/repos/**` as text but reaches /admin on the server.
    return any(seg in (".", "..") for seg in unquote(path).replace("\\", "/").split("/"))


# --- compiled rules ----------------------------------------------------------------


def _secure(scheme: str) -> bool:
    return scheme.lower() in ("https", "wss")


def _default_port(scheme: str) -> int:
    return 443 if _secure(scheme) else 80


@dataclass(frozen=True)
class _Binding:
    name: str
    rule: SecretRule
    methods: frozenset[str] | None
    paths: tuple[re.Pattern[str], ...] | None

    @classmethod
    def build(cls, name: str, rule: SecretRule) -> _Binding:
        return cls(
            name=name,
            rule=rule,
            methods=frozenset(rule.methods) if rule.methods is not None else None,
            paths=tuple(compile_path_glob(g) for g in rule.paths) if rule.paths is not None else None,
        )

    def allows(self, method: str, path: str) -> bool:
        if self.methods is not None and method.upper() not in self.methods:
            return False
        if self.paths is None:
            return True
        path = path.split("?", 1)[0].split("#", 1)[0]
        if _has_dot_segment(path):
            return False
        return any(p.fullmatch(path) for p in self.paths)


class CompiledRules:
    """Validated rules plus the lookups the request pipeline asks, built once."""

    def __init__(self, rules: Rules, provider_hosts: Sequence[HostPattern], source: str = "") -> None:
        self.rules = rules
        self.source = source
        self.provider_hosts = tuple(provider_hosts)
        self._providers = HostSet(self.provider_hosts)
        self._is_provider: dict[tuple[str, int, str], bool] = {}
        self._passthrough = HostSet(rules.passthrough)
        self._bindings = {name: _Binding.build(name, rule) for name, rule in rules.secrets.items()}
        self._hosts: HostMap[str] = HostMap(
            (pattern, name) for name, rule in rules.secrets.items() for pattern in rule.hosts
        )
        #: agent name -> the secrets it may use; None without `agents:`
        self.agents: dict[str, frozenset[str]] | None = (
            None if rules.agents is None else {name: frozenset(a.secrets) for name, a in rules.agents.items()}
        )

    def agent_secrets(self, agent: str) -> frozenset[str]:
        """The secrets AGENT may use (none for a name that is not an agent)."""
        return (self.agents or {}).get(agent, frozenset())

    @property
    def policy(self) -> Policy:
        return self.rules.policy

    def is_provider(self, host: str, port: int, scheme: str = "https") -> bool:
        # Asked several times per request, of the same few hosts; the rules never change once compiled.
        key = (host, port, scheme)
        known = self._is_provider.get(key)
        if known is None:
            known = self._providers.matches(host, port, _default_port(scheme))
            if len(self._is_provider) >= 1024:
                self._is_provider.clear()
            self._is_provider[key] = known
        return known

    def is_passthrough(self, host: str, port: int) -> bool:
        # Passthrough is decided at CONNECT time, for TLS: the default port is 443.
        return self._passthrough.matches(host, port, 443)

    def _candidates(self, host: str, port: int, scheme: str, method: str, path: str) -> Iterable[_Binding]:
        for name in dict.fromkeys(self._hosts.lookup(host, port, _default_port(scheme))):
            binding = self._bindings[name]
            if binding.allows(method, path):
                yield binding

    def bindings(self, host: str, port: int, scheme: str, method: str, path: str) -> dict[str, list[Inject]]:
        """Secret name → inject locations, for every secret bound to this request."""
        secure = _secure(scheme)
        return {
            b.name: list(b.rule.inject)
            for b in self._candidates(host, port, scheme, method, path)
            if secure or b.rule.allow_http
        }

    def blocked_by_scheme(self, host: str, port: int, scheme: str, method: str, path: str) -> set[str]:
        """Names that would be bound to this request but for plain http (`insecure_scheme`)."""
        if _secure(scheme):
            return set()
        return {b.name for b in self._candidates(host, port, scheme, method, path) if not b.rule.allow_http}

    def bound_elsewhere_hint(self, name: str) -> str:
        """The hosts NAME is bound to, for block messages."""
        binding = self._bindings.get(name)
        if binding is None:
            return "no host (it is not in the rules file)"
        return ", ".join(str(p) for p in binding.rule.hosts)

    def names(self) -> list[str]:
        return list(self._bindings)

    def table(self) -> list[tuple[str, str, str, str]]:
        """(name, hosts, inject locations, restrictions) per secret, for `keyveil rules check`."""
        rows = []
        for name, binding in self._bindings.items():
            rule = binding.rule
            restrictions = []
            if rule.methods is not None:
                restrictions.append("methods " + ", ".join(rule.methods))
            if rule.paths is not None:
                restrictions.append("paths " + ", ".join(rule.paths))
            if rule.allow_http:
                restrictions.append("allow_http")
            rows.append(
                (
                    name,
                    ", ".join(str(p) for p in rule.hosts),
                    ", ".join(i.location for i in rule.inject),
                    "; ".join(restrictions) or "-",
                )
            )
        return rows


# --- loading -----------------------------------------------------------------------

Loc = tuple[Any, ...]


def shipped_config_dir() -> Path:
    """The directory holding the shipped providers.yaml and rules.example.yaml."""
    shipped = importlib.resources.files("keyveil") / "_shipped_config"
    if shipped.is_dir():  # wheel install: pyproject force-includes config/ here
        return Path(str(shipped))
    return Path(__file__).resolve().parents[2] / "config"


def load_rules(path: Path) -> CompiledRules:
    """Read, validate and compile the rules file at PATH; raise RulesError if invalid."""
    try:
        text = Path(path).read_text("utf-8")
    except UnicodeDecodeError:
        raise RulesError(f"{path}:1: (file): the rules file is not UTF-8 text") from None
    except OSError as e:
        raise RulesError(f"{path}:1: (file): cannot read the rules file: {e.strerror or e}") from None
    return parse_rules(text, str(path))


def parse_rules(text: str, filename: str, providers_file: Path | None = None) -> CompiledRules:
    """Validate and compile rules TEXT; FILENAME is only used in messages.

    PROVIDERS_FILE replaces the shipped provider list (tests, custom installs).
    """
    data, lines = _load_yaml(text, filename, "the rules file")
    rules = _validate(Rules, data, lines, filename)

    provider_hosts = list(rules.providers.hosts)
    if rules.providers.builtin:
        shipped = providers_file or shipped_config_dir() / "providers.yaml"
        provider_hosts = load_provider_list(shipped) + provider_hosts

    problems = _passthrough_conflicts(rules, provider_hosts) + _agent_problems(rules)
    if problems:
        raise RulesError(_format(problems, lines, data, filename))
    return CompiledRules(rules, provider_hosts, filename)


def load_provider_list(path: Path) -> list[HostPattern]:
    """The host patterns of a provider list file such as config/providers.yaml."""
    try:
        text = Path(path).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RulesError(
            f"{path}:1: (file): cannot read the provider list ({getattr(e, 'strerror', None) or e}); "
            "reinstall keyveil, or set providers.builtin: false and list providers.hosts yourself"
        ) from None
    data, lines = _load_yaml(text, str(path), "the provider list")
    return list(_validate(ProviderList, data, lines, str(path)).hosts)


def _agent_problems(rules: Rules) -> list[tuple[Loc, str]]:
    """An agent may list only secrets the file binds."""
    problems = []
    for name, agent in (rules.agents or {}).items():
        for i, secret in enumerate(agent.secrets):
            if secret not in rules.secrets:
                problems.append((
                    ("agents", name, "secrets", i),
                    f"{secret} is not under secrets: in this file; bind it there first (an agent "
                    "may use only bound secrets)",
                ))
    return problems


def _passthrough_conflicts(rules: Rules, provider_hosts: Sequence[HostPattern]) -> list[tuple[Loc, str]]:
    """A passthrough host is never inspected, so it must not be bound nor a provider."""
    problems = []
    for i, through in enumerate(rules.passthrough):
        for name, rule in rules.secrets.items():
            for bound in rule.hosts:
                if _overlap(through, bound, {443, 80} if rule.allow_http else {443}):
                    problems.append(
                        (
                            ("passthrough", i),
                            f"{_overlap_text(through, bound)} a host of secret {name}: "
                            "a bound host must be intercepted; remove it from passthrough",
                        )
                    )
        provider = next((p for p in provider_hosts if _overlap(through, p, {443, 80})), None)
        if provider is not None:
            problems.append(
                (
                    ("passthrough", i),
                    f"{_overlap_text(through, provider)} a model-vendor host: "
                    "its traffic must be sealed; remove it from passthrough",
                )
            )
    return problems


def _overlap(through: HostPattern, other: HostPattern, other_default_ports: set[int]) -> bool:
    # Passthrough is decided for TLS, so a passthrough pattern without a port means 443.
    ports = {other.port} if other.port else other_default_ports
    return patterns_overlap(through, other) and (through.port or 443) in ports


def _overlap_text(a: HostPattern, b: HostPattern) -> str:
    return f"{a} is" if str(a) == str(b) else f"{a} overlaps {b},"


# --- YAML with line numbers ----------------------------------------------------------


def _load_yaml(text: str, filename: str, what: str) -> tuple[Any, dict[Loc, int]]:
    """The data of TEXT and the 1-based line of each node, by path of keys and indices."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise RulesError(f"{filename}:1: (top level): {what} is empty; it needs at least `version: 1`")
        lines: dict[Loc, int] = {(): node.start_mark.line + 1}
        problems: list[tuple[Loc, str]] = []
        # Walk before constructing: construction flattens merge keys in place.
        _record_lines(node, (), lines, problems, set())
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = "; ".join(p for p in (e.context, e.problem) if p) or "invalid YAML"
        raise RulesError(f"{filename}:{line}: (yaml): {problem}") from None
    except yaml.YAMLError as e:
        raise RulesError(f"{filename}:1: (yaml): {e}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise RulesError(
            f"{filename}:{lines[()]}: (top level): expected a mapping starting with `version: 1`, "
            f"got {_describe(data)}"
        )
    if problems:
        raise RulesError(_format(problems, lines, data, filename))
    return data, lines


_KEYS = yaml.SafeLoader("")  # constructs key nodes only
_MAX_NODES = 100_000  # aliases can make a tree exponential; a rules file is small


def _record_lines(
    node: yaml.Node, path: Loc, lines: dict[Loc, int], problems: list[tuple[Loc, str]], parents: set[int]
) -> None:
    if id(node) in parents or len(lines) > _MAX_NODES:
        return  # recursive alias: construction or validation reports it
    parents = parents | {id(node)}
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _record_lines(item, path + (i,), lines, problems, parents)
    elif isinstance(node, yaml.MappingNode):
        own: set[Any] = set()
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for m in merged:
                    _record_lines(m, path, lines, problems, parents)
                continue
            try:
                key = _KEYS.construct_object(key_node, deep=True)
                hash(key)
            except (yaml.YAMLError, TypeError):
                continue  # construction reports it with its line
            line = key_node.start_mark.line + 1
            if key in own:
                problems.append((path + (key,), f"duplicate key (line {lines[path + (key,)]} sets it too)"))
            own.add(key)
            lines[path + (key,)] = line
            _record_lines(value_node, path + (key,), lines, problems, parents)


# --- validation errors as FILE:LINE: FIELD: message ---------------------------------

_FIELDS: dict[str, tuple[str, ...]] = {
    "rules": tuple(Rules.model_fields),
    "providers": tuple(Providers.model_fields),
    "policy": tuple(Policy.model_fields),
    "secret": tuple(SecretRule.model_fields),
    "inject": tuple(Inject.model_fields),
    "agent": tuple(AgentRule.model_fields),
    "provider_list": tuple(ProviderList.model_fields),
}


def _validate(model: type[_Model], data: Any, lines: dict[Loc, int], filename: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = [(_clean_loc(err["loc"]), _message(model, err)) for err in e.errors()]
        raise RulesError(_format(problems, lines, data, filename)) from None


def _clean_loc(loc: Loc) -> Loc:
    return tuple(part for part in loc if part != "[key]")


def _format(problems: list[tuple[Loc, str]], lines: dict[Loc, int], data: Any, filename: str) -> str:
    out = []
    for loc, message in problems:
        line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), 1)
        out.append((line, f"{filename}:{line}: {_field(loc, data)}: {message}"))
    # One line per problem, in file order: the first one is the first to fix.
    return "\n".join(text for _, text in sorted(dict.fromkeys(out), key=lambda t: t[0]))


def _field(loc: Loc, data: Any) -> str:
    """The dotted path of LOC, with `[i]` for list items: `secrets.github/pat.hosts[0]`."""
    text = ""
    for part in loc:
        if isinstance(data, list) and isinstance(part, int):
            text += f"[{part}]"
            data = data[part] if 0 <= part < len(data) else None
        else:
            text += ("." if text else "") + str(part)
            data = data.get(part) if isinstance(data, dict) else None
    return text or "(top level)"


def _message(model: type[_Model], err: Any) -> str:
    kind, loc = err["type"], _clean_loc(err["loc"])
    if kind == "extra_forbidden":
        return _unknown_field(model, loc)
    if kind == "missing":
        if loc == ("version",):
            return "required: start the file with `version: 1`"
        return "required field is missing"
    if kind == "literal_error":
        if loc == ("version",):
            return _BAD_VERSION
        return f"must be one of {err['ctx']['expected']}"
    if kind == "value_error":
        return str(err["ctx"]["error"])
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a mapping, got {_describe(err['input'])}"
    if kind == "list_type":
        return f"expected a list, got {_describe(err['input'])}"
    if kind == "string_type":
        return f"expected text, got {_describe(err['input'])}"
    if kind == "bool_type":
        return f"expected true or false, got {_describe(err['input'])}"
    if kind == "int_type":
        return f"expected a whole number, got {_describe(err['input'])}"
    if kind == "greater_than":
        return f"must be greater than {err['ctx']['gt']}"
    return err["msg"]


def _unknown_field(model: type[_Model], loc: Loc) -> str:
    allowed = _FIELDS.get(_model_at(model, loc[:-1]), ())
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    if close:
        return f"unknown field; did you mean {close[0]!r}?"
    if allowed:
        return "unknown field; expected one of: " + ", ".join(allowed)
    return "unknown field"


def _model_at(model: type[_Model], loc: Loc) -> str:
    if model is ProviderList:
        return "provider_list"
    if not loc:
        return "rules"
    if loc[0] == "secrets":
        return "inject" if len(loc) >= 4 else "secret"
    if loc[0] == "agents":
        return "agent"
    return str(loc[0])


def _describe(value: Any) -> str:
    # Names the kind of input, never the input itself: a misplaced value must not be echoed.
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "text"
    if isinstance(value, int | float):
        return "a number"
    return type(value).__name__
