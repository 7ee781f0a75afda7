"""Property-based requests generated from the app's own OpenAPI schema: no input may cause a 5xx.

Bounded (a fixed number of examples per operation, a deterministic seed) so it runs in well under a minute.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from test_api import make_env

MAX_EXAMPLES = 25
_TMP = Path(tempfile.mkdtemp(prefix="vgpumgr-schemathesis-"))  # at import: schemathesis reads the schema then
atexit.register(shutil.rmtree, _TMP, True)
ENV, _CLIENT = make_env(_TMP, scale=2)
schema = schemathesis.openapi.from_asgi("/openapi.json", _CLIENT.app)
# Valid and invalid inputs both: an invalid one must come back 4xx, never 5xx.
schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    response = case.call(headers=ENV.as_("admin"))
    assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: " \
                                       f"{response.text[:500]}"
    if response.status_code >= 400:
        content_type = response.headers["content-type"]  # schemathesis gives header values as lists
        assert str(content_type[0] if isinstance(content_type, list) else content_type).startswith(
            "application/problem+json")
        body = response.json()
        assert body["status"] == response.status_code and body["detail"]
