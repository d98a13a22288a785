"""`pagedserve serve MODEL` launched as `vllm serve` would be: the positional model, several served
names, HTTPS (--ssl-keyfile/--ssl-certfile, a self-signed certificate from openssl), CORS
(--allowed-origins), --chat-template FILE and --generation-config PATH, on a real server process."""
from __future__ import annotations

import json
import shutil
import ssl
import subprocess

import httpx
import openai
import pytest

from pagedserve.loadtest.local_server import LocalServer, tiny_args

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for a certificate")
TEMPLATE = "{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}{% if add_generation_prompt %}<<assistant|{% endif %}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch")
    key, cert = str(d / "key.pem"), str(d / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    (d / "template.jinja").write_text(TEMPLATE)
    (d / "gen").mkdir()
    (d / "gen" / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    args = tiny_args(1024)
    model = args[args.index("--model") + 1]
    del args[args.index("--model"):args.index("--model") + 2]
    s = LocalServer([model, *args, "--served-model-name", "tiny", "tiny-alias",
                     "--ssl-keyfile", key, "--ssl-certfile", cert, "--allowed-origins", '["http://ok.test"]',
                     "--chat-template", str(d / "template.jinja"), "--generation-config", str(d / "gen")],
                    log_prefix="pagedserve-e2e-", https_verify=ssl.create_default_context(cafile=cert))
    yield s
    assert s.stop() == 0, s.output()


def test_https_names_template_and_defaults(server):
    http = httpx.Client(base_url=server.url, verify=server.verify, timeout=60)
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "tiny-alias"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(verify=server.verify, timeout=60))
    r = client.chat.completions.create(model="tiny-alias", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0)
    assert r.model == "tiny" and r.usage.completion_tokens >= 1
    strs = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                        "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs).replace("Ġ", " ").startswith("<<user|hi>>")  # the --chat-template file's rendering
    out = server.output()
    assert "on https://127.0.0.1" in out
    assert "default sampling settings from the model" in out and "temperature=0.6" in out and "top_k=20" in out


def test_cors_preflight(server):
    http = httpx.Client(base_url=server.url, verify=server.verify, timeout=60)
    r = http.options("/v1/chat/completions", headers={"Origin": "http://ok.test",
                                                      "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.test"
