"""Helpers for the dashboard's tests and bench: a dashboard process started like a user starts it,
HTTP reads of it, a server-sent-events reader, and a tiny reverse proxy that serves it under a
sub-path (what nginx or Caddy would do)."""

from __future__ import annotations

import http.client
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpool.client.localpool import Processes, free_port, wait_for


@dataclass
class Dashboard:
    url: str  # http://127.0.0.1:PORT/
    port: int
    proc: Any
    log: Path


def start_dashboard(procs: Processes, root: Path, coordinator: str, *args: str, listen: str | None = None, poll: float = 0.5, name: str = "dashboard") -> Dashboard:
    """`dpctl dashboard` as a user runs it, on a free port; returns once it answers."""
    port = free_port()
    log = root / f"{name}.log"
    proc = procs.start(
        [sys.executable, "-m", "dpool.client.cli", "--coordinator", coordinator, "dashboard", "--listen", listen or f"127.0.0.1:{port}", "--poll", str(poll), *args],
        log, label=name,
    )
    if listen is not None:
        port = int(listen.rpartition(":")[2])
    d = Dashboard(f"http://127.0.0.1:{port}/", port, proc, log)
    wait_for(f"the dashboard on port {port} ({log})", lambda: (proc.poll() is None and _answers(port)) or _exited(proc, log), 30)
    return d


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _exited(proc: Any, log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"the dashboard exited with {proc.returncode}: {log.read_text()[-2000:]}")
    return False


def get(url: str, *, headers: dict[str, str] | None = None, method: str = "GET", timeout: float = 15) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of one request; redirects are not followed."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a: Any, **kw: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode(errors="replace")


def sse_events(host: str, port: int, path: str, *, headers: dict[str, str] | None = None, timeout: float = 30) -> Iterator[tuple[str, str]]:
    """(event, data) of a server-sent-events stream, as they come."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    if resp.status != 200:
        raise AssertionError(f"{path}: {resp.status} {resp.read()[:300]!r}")
    event, data = "message", []
    try:
        while True:
            raw = resp.readline()
            if not raw:
                return
            line = raw.decode().rstrip("\n")
            if line == "":
                if data:
                    yield event, "\n".join(data)
                event, data = "message", []
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
    finally:
        conn.close()


class SubPathProxy:
    """A reverse proxy serving `upstream` under `/PREFIX/`, as a front server does: the prefix
    stripped on the way in, X-Forwarded-Prefix set, the body streamed through (server-sent events
    included), nothing rewritten on the way out. aiohttp, in a process of its own (`python
    dashboard_harness.py proxy UPSTREAM PORT PREFIX`)."""

    def __init__(self, procs: Processes, root: Path, upstream: str, prefix: str = "/pool") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{prefix}/"
        self.proc = procs.start([sys.executable, __file__, "proxy", upstream.rstrip("/"), str(self.port), prefix], root / f"proxy-{self.port}.log", label="proxy")
        wait_for(f"the proxy on port {self.port}", lambda: _answers(self.port) or _exited(self.proc, root / f"proxy-{self.port}.log"), 30)


def proxy_main(upstream: str, port: int, prefix: str) -> None:
    from aiohttp import ClientSession, ClientTimeout, web

    async def handle(request: web.Request) -> web.StreamResponse:
        path = request.path_qs
        if not path.startswith(prefix + "/"):
            return web.Response(status=404, text="not under the prefix")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        headers["X-Forwarded-Prefix"] = prefix
        async with ClientSession(timeout=ClientTimeout(total=None, sock_read=None)) as session, session.request(
            request.method, upstream + path[len(prefix) :], headers=headers, allow_redirects=False,
        ) as up:
            out = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() not in ("transfer-encoding", "content-length", "content-encoding", "connection")})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def hrefs(html: str) -> list[str]:
    """Every href= and src= of a page that the browser asks the server for (not a data: URL)."""
    import re

    return [h for h in re.findall(r'(?:href|src|data-stream)="([^"]*)"', html) if not h.startswith("data:")]


def wait_page(url: str, check: Sequence[str], timeout: float = 60, headers: dict[str, str] | None = None) -> str:
    """The page at `url` once it contains every string of `check`."""
    deadline = time.monotonic() + timeout
    body = ""
    while time.monotonic() < deadline:
        try:
            status, _, body = get(url, headers=headers)
        except urllib.error.URLError:  # not listening yet
            status = 0
        if status == 200 and all(c in body for c in check):
            return body
        time.sleep(0.3)
    raise AssertionError(f"{url} never showed {check}: {body[:1000]}")


def cost_main(coordinator: str, job: str) -> None:
    """Prints {"one": R1, "eight": R8}: the requests the poller sends the coordinator a round with
    one stream of each page open (pool, jobs, the job's), then with eight of each. The poller and
    its server run here, the server on a thread (so this is a process of its own)."""
    import asyncio
    import json
    import threading

    from dpool.dashboard import server
    from dpool.dashboard.poller import Poller

    poller = Poller(coordinator, None, lambda v, r: None, poll_s=0.2, timeout_s=5)
    app = server.app(poller, None)
    port = free_port()
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(server.serve(app, "127.0.0.1", port, stopping=stop)), daemon=True)
    thread.start()
    wait_for("the server", lambda: _answers(port), 30)
    pages = ["pool", "jobs", f"job:{job}"]

    def per_round(streams: int) -> float:
        readers = []
        for view in pages:
            for _ in range(streams):
                gen = sse_events("127.0.0.1", port, f"/stream?view={view}")
                next(gen)  # connected, its first update in hand
                readers.append(gen)
        wait_for("the streams counted", lambda: poller.interest.streams() == streams * len(pages), 10)
        polls, requests = poller.polls, poller.requests
        time.sleep(2.0)
        count = (poller.requests - requests) / max(1, poller.polls - polls)
        for gen in readers:
            gen.close()
        return count

    print(json.dumps({"one": per_round(1), "eight": per_round(8)}))


if __name__ == "__main__":
    if sys.argv[1] == "proxy":
        proxy_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "cost":
        cost_main(sys.argv[2], sys.argv[3])
