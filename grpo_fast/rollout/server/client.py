"""The HTTP client of a vLLM server: `Server` (one server's URL, what it runs, whether it still answers; JSON
calls under a time-out, the worker extension's methods through `/collective_rpc`), `ServerError` (every
failure, naming the server), and the time-outs of the calls that are not generation's. Requests to this host
never go through a proxy."""

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request

MIN_VLLM = (0, 32)  # the oldest build whose endpoints this client was tested against
PROBE_LEN = 48  # the verification probe's tokens: a server must hold at least this context
CHECK_TIMEOUT_S = 30.0  # the questions asked of a server when connecting (not generation's time-out)
LEAVING_TIMEOUT_S = 2.0  # best-effort calls on the way out (a release, a resume after a stop signal)
TOKEN_ENV = "GRPO_FAST_SERVER_TOKEN"  # set by `grpo-fast serve --train`: the servers must carry this token
# requests to this host never go through a proxy (urllib would send them to $http_proxy without no_proxy)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(RuntimeError):
    """A vLLM server failed, timed out, or is not the server this trainer can use. `status`: the HTTP status
    when the server answered with an error (a 4xx other than 408 / 429 is the request's fault, not the
    server's: not retried elsewhere)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def bad_request(self) -> bool:
        return self.status is not None and 400 <= self.status < 500 and self.status not in (408, 429)


def _version_tuple(text: str) -> tuple:
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


class Server:
    """One vLLM server: its base URL, what it runs, whether it still answers."""

    def __init__(self, url: str, timeout: float):
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_base_url: expected http(s)://host:port, got {url!r}")
        self.timeout = timeout
        self.alive = True
        self.info: dict = {}
        self.model_name = ""
        self.max_model_len = PROBE_LEN + 1

    @property
    def local(self) -> bool:
        return urllib.parse.urlparse(self.url).hostname in ("localhost", "127.0.0.1", "::1")

    def call(self, path: str, payload=None, *, timeout=None, what: str = "", text: bool = False) -> dict:
        """POST `payload` as JSON (GET without one); the decoded answer, or ServerError naming this server.
        `text`: an endpoint that answers in plain text (vLLM's LoRA endpoints): {"text": the answer}."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method="GET" if data is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        limit = self.timeout if timeout is None else timeout
        opener = _DIRECT if self.local else urllib.request.build_opener()
        try:
            with opener.open(req, timeout=limit) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise ServerError(
                f"vLLM server {self.url}: {what or path} failed: HTTP {exc.code}: {detail}", status=exc.code
            ) from exc
        except http.client.HTTPException as exc:  # a connection cut mid-answer
            raise ServerError(f"vLLM server {self.url}: {what or path} failed: {exc!r}") from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            kind = "timed out" if "timed out" in str(reason) else "failed"
            raise ServerError(
                f"vLLM server {self.url}: {what or path} {kind} (time-out {limit:.0f}s): {reason}"
            ) from exc
        if text:
            return {"text": body.decode(errors="replace")}
        try:
            return json.loads(body) if body else {}
        except ValueError as exc:
            raise ServerError(
                f"vLLM server {self.url}: {what or path} answered with no JSON: {body[:200]!r}"
            ) from exc

    def rpc(self, method: str, *args: str, what: str = "", timeout=None) -> list:
        """A method of the worker extension on every worker of this server (string arguments only)."""
        limit = self.timeout if timeout is None else timeout
        out = self.call(
            "/collective_rpc",
            {"method": method, "args": list(args), "timeout": limit},
            timeout=limit,
            what=what or method,
        )
        return out.get("results", [])

    def wait_up(self, wait_s: float) -> float:
        """Seconds until `/health` answered; ServerError after `wait_s`."""
        t0 = time.monotonic()
        while True:
            try:
                self.call("/health", timeout=5, what="health check")
                return time.monotonic() - t0
            except ServerError as exc:
                if time.monotonic() - t0 > wait_s:
                    raise ServerError(
                        f"vLLM server {self.url} did not answer /health within "
                        f"vllm_server_timeout={wait_s:.0f}s "
                        f"(never started, or unreachable): {exc}"
                    ) from exc
                time.sleep(1.0)
