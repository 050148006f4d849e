"""Real-component test infrastructure: a TLS upstream, a mitmdump subprocess,
and a routing addon that sends every proxied connection to the upstream.

Import it as ``import infra`` (pytest puts tests/ on sys.path, as for
keyring_fake). Factories here are meant to be wrapped by fixtures in
tests/conftest.py, e.g.::

    @pytest.fixture(scope="session")
    def upstream():
        with infra.Upstream(infra.make_ca()) as up:
            yield up

    @pytest.fixture
    def proxy(upstream, tmp_path):
        with infra.routed_proxy(upstream, tmp_path, scripts=[infra.KEYVEIL_ADDON]) as p:
            yield p

Nothing here may talk to the internet: every connection ends on 127.0.0.1.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from .proxy import (
    MITMDUMP,
    NODE_PROXY_CLIENT_JS,
    NodeRequestError,
    ProxyProcess,
    ProxyStartError,
    client_ssl_context,
    node_request,
    write_ca_bundle,
)
from .upstream import (
    GIT_SHA,
    UPSTREAM_NAMES,
    CannedResponse,
    Recorded,
    Upstream,
    WsRecord,
    git_ref_advertisement,
    issue_server_cert,
    make_ca,
)

REPO = Path(__file__).resolve().parents[2]
ROUTE_ADDON = Path(__file__).resolve().with_name("route_addon.py")
KEYVEIL_ADDON = REPO / "addons" / "keyveil.py"


def route_options(upstream: Upstream) -> dict[str, object]:
    """The --set options that make route_addon send everything to UPSTREAM."""
    return {
        "route_tls_port": upstream.tls_port,
        "route_plain_port": upstream.plain_port,
        "ssl_verify_upstream_trusted_ca": upstream.ca_pem,
    }


def routed_proxy(
    upstream: Upstream,
    workdir: str | os.PathLike | None = None,
    *,
    scripts: Sequence[str | os.PathLike] = (),
    options: Mapping[str, object] | Iterable[tuple[str, object]] = (),
    **kwargs,
) -> ProxyProcess:
    """A (not yet started) ProxyProcess running SCRIPTS then route_addon,
    routed to UPSTREAM. Use as a context manager, or call start()/close()."""
    opts = list(options.items()) if isinstance(options, Mapping) else list(options)
    return ProxyProcess(
        [*scripts, ROUTE_ADDON],
        [*route_options(upstream).items(), *opts],
        workdir=workdir,
        **kwargs,
    )


__all__ = [
    "GIT_SHA",
    "KEYVEIL_ADDON",
    "MITMDUMP",
    "NODE_PROXY_CLIENT_JS",
    "NodeRequestError",
    "REPO",
    "ROUTE_ADDON",
    "UPSTREAM_NAMES",
    "CannedResponse",
    "ProxyProcess",
    "ProxyStartError",
    "Recorded",
    "Upstream",
    "WsRecord",
    "client_ssl_context",
    "git_ref_advertisement",
    "issue_server_cert",
    "make_ca",
    "node_request",
    "route_options",
    "routed_proxy",
    "write_ca_bundle",
]
