"""Token-shaped fake values of every detector kind, built at run time from random pieces.

Nothing here is a real credential, and no literal in this file looks like one:
every value is a documented prefix plus random characters drawn per call.
"""

from __future__ import annotations

import base64
import json
import os
import random
import secrets
import string

import pytest

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

UPPER = string.ascii_uppercase
LOWER = string.ascii_lowercase
DIGITS = string.digits
LETTERS = string.ascii_letters
ALNUM = LETTERS + DIGITS
HEX = "0123456789abcdef"
B64URL = ALNUM + "-_"


# Seeded, so that a test sees the same fake tokens on every run whatever ran
# before it in its worker (pytest-xdist orders tests differently from run to
# run): `reseed(nodeid)` at the start of each test (the `seeded_tokens` fixture)
# makes the draws a function of the test alone. KEYVEIL_TOKENS_SEED=random draws
# new ones every time (make soak); another value changes the seed.
_SEED = os.environ.get("KEYVEIL_TOKENS_SEED", "keyveil-tokens")
_RNG = random.SystemRandom() if _SEED == "random" else random.Random(_SEED)


def reseed(label: str) -> None:
    """Restart the draws from a seed derived from LABEL (a test's node id)."""
    if _SEED != "random":
        _RNG.seed(f"{_SEED}:{label}")


def rnd(n: int, alphabet: str = ALNUM) -> str:
    return "".join(_RNG.choice(alphabet) for _ in range(n))


def b64(nbytes: int) -> str:
    return base64.b64encode(_RNG.randbytes(nbytes)).decode()


def _b64url_json(doc: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()


def _pem(kind: str) -> str:
    if kind == "pkcs8":
        key = ec.generate_private_key(ec.SECP256R1())
        fmt = serialization.PrivateFormat.PKCS8
    elif kind == "sec1":
        key = ec.generate_private_key(ec.SECP256R1())
        fmt = serialization.PrivateFormat.TraditionalOpenSSL
    else:
        key = ed25519.Ed25519PrivateKey.generate()
        fmt = serialization.PrivateFormat.OpenSSH
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()).decode().strip()


def _dot_free_end(text: str) -> str:
    return text[:-1] + "x" if text.endswith(".") else text


# kind -> list of makers; each maker returns (text, value): TEXT holds VALUE once.
# Most makers return the token itself (text == value); kinds that count only in a
# context return the context around it.
def _same(make):
    return lambda: (lambda v: (v, v))(make())


def _aws_secret_named():
    v = rnd(40, ALNUM + "/+")
    return f"aws_secret_access_key = {v}", v


def _aws_secret_after_id():
    v = rnd(40, ALNUM + "/+")
    return f"AKIA{rnd(16, UPPER + DIGITS)},{v}", v


def _twilio_secret_after_sid():
    v = rnd(32)
    return f"SK{rnd(32, HEX)}:{v}", v


def _twilio_auth_token():
    v = rnd(32, HEX)
    return f"TWILIO_AUTH_TOKEN={v}", v


def _slack_webhook():
    v = f"T{rnd(8, UPPER + DIGITS)}/B{rnd(10, UPPER + DIGITS)}/{rnd(24)}"
    return f"https://hooks.slack.com/services/{v}", v


def _azure_storage():
    v = b64(64)
    return f"DefaultEndpointsProtocol=https;AccountName={rnd(10, LOWER)};AccountKey={v};EndpointSuffix=core.windows.net", v


def _azure_shared():
    v = b64(32)
    return (
        f"Endpoint=sb://{rnd(8, LOWER)}.servicebus.windows.net/;SharedAccessKeyName=RootManageSharedAccessKey;"
        f"SharedAccessKey={v}"
    ), v


def _jwt():
    header = _b64url_json({"alg": "HS256", "typ": "JWT"})
    payload = _b64url_json({"sub": rnd(12), "iat": secrets.randbelow(2**31)})
    sig = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
    return f"{header}.{payload}.{sig}"


def _assignment():
    v = rnd(40)
    return f"MY_SERVICE_API_KEY={v}", v


MAKERS = {
    "github-pat": [_same(lambda: "ghp_" + rnd(36))],
    "github-oauth-token": [_same(lambda: "gho_" + rnd(36))],
    "github-user-token": [_same(lambda: "ghu_" + rnd(36))],
    "github-app-token": [
        _same(lambda: "ghs_" + rnd(36)),
        _same(lambda: _dot_free_end("ghs_" + rnd(40, B64URL) + "." + rnd(60, B64URL) + "." + rnd(43, B64URL))),
    ],
    "github-refresh-token": [_same(lambda: "ghr_" + rnd(76))],
    "github-fine-grained-pat": [_same(lambda: "github_pat_" + rnd(22) + "_" + rnd(59))],
    "gitlab-pat": [
        _same(lambda: "glpat-" + rnd(19, B64URL) + rnd(1)),
        _same(lambda: "glpat-" + rnd(27, B64URL) + ".01." + rnd(9, LOWER + DIGITS)),
    ],
    "gitlab-deploy-token": [_same(lambda: "gldt-" + rnd(20))],
    "gitlab-runner-token": [_same(lambda: "glrt-" + rnd(20)), _same(lambda: "glrt-t1_" + rnd(20))],
    "gitlab-trigger-token": [_same(lambda: "glptt-" + rnd(40, HEX))],
    "anthropic-api-key": [_same(lambda: "sk-ant-api03-" + rnd(93, B64URL) + "AA")],
    "anthropic-admin-key": [_same(lambda: "sk-ant-admin01-" + rnd(93, B64URL) + "AA")],
    "anthropic-oauth-token": [_same(lambda: "sk-ant-oat01-" + rnd(93, B64URL) + "AA")],
    "anthropic-refresh-token": [_same(lambda: "sk-ant-ort01-" + rnd(93, B64URL) + "AA")],
    "anthropic-key": [_same(lambda: "sk-ant-sid07-" + rnd(80, B64URL))],
    "openai-project-key": [_same(lambda: "sk-proj-" + rnd(74, B64URL) + "T3Blbk" + "FJ" + rnd(74, B64URL))],
    "openai-service-account-key": [_same(lambda: "sk-svcacct-" + rnd(74, B64URL) + "T3Blbk" + "FJ" + rnd(74, B64URL))],
    "openai-admin-key": [_same(lambda: "sk-admin-" + rnd(74, B64URL) + "T3Blbk" + "FJ" + rnd(74, B64URL))],
    "openrouter-key": [_same(lambda: "sk-or-v1-" + rnd(64, HEX))],
    "openai-legacy-key": [
        _same(lambda: "sk-" + rnd(20) + "T3Blbk" + "FJ" + rnd(20)),
        _same(lambda: "sk-None-" + rnd(74, B64URL)),
    ],
    "deepseek-key": [_same(lambda: "sk-" + rnd(32, HEX))],
    "groq-key": [_same(lambda: "gsk_" + rnd(52))],
    "xai-key": [_same(lambda: "xai-" + rnd(80))],
    "perplexity-key": [_same(lambda: "pplx-" + rnd(48))],
    "google-api-key": [_same(lambda: "AIza" + rnd(34, B64URL) + rnd(1))],
    "google-oauth-token": [_same(lambda: "ya29." + rnd(150, B64URL) + rnd(1))],
    "google-oauth-client-secret": [_same(lambda: "GOCSPX-" + rnd(27, B64URL) + rnd(1))],
    "aws-access-key": [_same(lambda: "AKIA" + rnd(16, UPPER + DIGITS)), _same(lambda: "ASIA" + rnd(16, UPPER + DIGITS))],
    "aws-secret-key": [_aws_secret_named, _aws_secret_after_id],
    "slack-bot-token": [_same(lambda: f"xoxb-{rnd(12, DIGITS)}-{rnd(13, DIGITS)}-{rnd(24)}")],
    "slack-user-token": [_same(lambda: f"xoxp-{rnd(12, DIGITS)}-{rnd(12, DIGITS)}-{rnd(13, DIGITS)}-{rnd(32, HEX)}")],
    "slack-config-token": [_same(lambda: f"xoxe.xoxp-1-{rnd(160)}"), _same(lambda: f"xoxe-1-{rnd(140)}")],
    "slack-token": [_same(lambda: f"xoxa-2-{rnd(12, DIGITS)}-{rnd(32)}"), _same(lambda: f"xoxc-{rnd(12, DIGITS)}-{rnd(64, HEX)}")],
    "slack-app-token": [_same(lambda: f"xapp-1-A{rnd(10, UPPER + DIGITS)}-{rnd(13, DIGITS)}-{rnd(64, HEX)}")],
    "slack-webhook": [_slack_webhook],
    "stripe-secret-key": [_same(lambda: "sk_live_" + rnd(99))],
    "stripe-test-secret-key": [_same(lambda: "sk_test_" + rnd(24))],
    "stripe-restricted-key": [_same(lambda: "rk_live_" + rnd(99))],
    "stripe-test-restricted-key": [_same(lambda: "rk_test_" + rnd(99))],
    "stripe-webhook-secret": [_same(lambda: "whsec_" + rnd(32))],
    "npm-token": [_same(lambda: "npm_" + rnd(36))],
    "pypi-token": [_same(lambda: "pypi-AgEIcHlwaS5vcmc" + rnd(150, B64URL) + rnd(1))],
    "huggingface-token": [_same(lambda: "hf_" + rnd(34, LETTERS))],
    "huggingface-org-token": [_same(lambda: "api_org_" + rnd(34, LETTERS))],
    "twilio-api-key": [_same(lambda: "SK" + rnd(32, HEX))],
    "twilio-api-secret": [_twilio_secret_after_sid],
    "twilio-auth-token": [_twilio_auth_token],
    "sendgrid-api-key": [_same(lambda: "SG." + rnd(22, B64URL) + "." + rnd(42, B64URL) + rnd(1))],
    "digitalocean-token": [_same(lambda: "dop_v1_" + rnd(64, HEX)), _same(lambda: "doo_v1_" + rnd(64, HEX))],
    "digitalocean-refresh-token": [_same(lambda: "dor_v1_" + rnd(64, HEX))],
    "shopify-access-token": [_same(lambda: "shpat_" + rnd(32, HEX))],
    "shopify-shared-secret": [_same(lambda: "shpss_" + rnd(32, HEX))],
    "azure-storage-key": [_azure_storage],
    "azure-shared-access-key": [_azure_shared],
    "private-key": [_same(lambda: _pem("pkcs8")), _same(lambda: _pem("sec1")), _same(lambda: _pem("openssh"))],
    "jwt": [_same(_jwt)],
    "assignment": [_assignment],
}


@pytest.fixture(autouse=True)
def seeded_tokens(request):
    """Import into a test module: its tests draw their tokens from a seed of their own."""
    reseed(request.node.nodeid)


def samples(kind: str) -> list[tuple[str, str]]:
    """One (text, value) per maker of KIND, fresh random pieces each call."""
    return [make() for make in MAKERS[kind]]
