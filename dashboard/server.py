"""The dashboard's HTTP server (aiohttp): the pages, their live stream, /metrics, and the assets,
all of it GET (and HEAD: the same answer without its body), all of it read-only.

    GET /              the pool: every node, the active jobs
    GET /jobs          the job list, newest first, a page at a time (?before=JOB&n=N: older pages)
    GET /jobs/JOB      one job: its curves, restarts, events and their cost, workers, output, samples
    GET /stream?view=  server-sent events: the sections of a page that changed, as they change
    GET /metrics       Prometheus' text format (dashboard/prometheus.py)
    GET /static/...    the stylesheet and the script, served from the package: nothing from elsewhere

Any other method is 405. With viewer tokens every request needs one: `Authorization: Bearer
TOKEN`, or the `dpool_dashboard` cookie that `?token=TOKEN` sets (HttpOnly, SameSite=Lax) before
it redirects to the same page without the token in its address. Lax, not Strict: every request is
a read, so a cross-site link has nothing to forge, and a link to a job from a chat or a Grafana
panel opens signed in instead of answering 401. A browser is told to load nothing
from anywhere else (Content-Security-Policy: 'self' only), and what it is sent is bounded: the
rows a page shows, STREAMS_MAX streams at once.

The server never asks the coordinator anything itself: the poller's thread does (dashboard/
poller.py), once for every browser, and hands over each page rendered; a stream sends a browser the
sections whose checksum differs from what it was sent last.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlencode

import orjson
from aiohttp import web

from dpool.dashboard import views
from dpool.dashboard.auth import Tokens
from dpool.dashboard.poller import Interest, Poller

COOKIE = "dpool_dashboard"
STREAMS_MAX = 64  # open streams at once; one more is answered 503
PING_S = 15.0  # a comment line on an idle stream, so proxies keep it open
FIRST_WAIT_S = 1.0  # beyond the coordinator's timeout: how long a first load waits for its page
RETRY_MS = 2000  # the stream's `retry:`: how soon a browser reconnects after the stream ends
STATIC = {"dash.css": "text/css", "dash.js": "text/javascript"}
POLLER_JOIN_S = 0.5  # at shutdown, the poller's thread is waited for this long: a request to a live coordinator ends well within it
POLLER = web.AppKey("poller", Poller)
CSP = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
UNAUTHORIZED = (
    "401: this dashboard needs a viewer token. Ask the pool's owner for one (`dpctl keys add-viewer NAME` "
    "writes it to bundles/NAME/viewer.token) and open this address with ?token=TOKEN once, or send "
    "`Authorization: Bearer TOKEN`.\n"
)


class Hub:
    """The newest render of each view, on the server's loop: when the poller last looked at it,
    and who waits for it to change (streams) or to be looked at (first loads)."""

    def __init__(self) -> None:
        self.latest: dict[str, views.Rendered] = {}
        self.checked_at: dict[str, float] = {}  # monotonic time of the poller's newest look at each view
        self.changed: dict[str, asyncio.Event] = {}
        self.checked: dict[str, asyncio.Event] = {}
        self.streams = 0

    def put(self, view: str, rendered: views.Rendered | None) -> None:
        """The poller looked at `view`: here is its new render, or None (unchanged)."""
        self.checked_at[view] = time.monotonic()
        if len(self.checked_at) > 1024:  # views nobody looks at any more
            for old in sorted(self.checked_at, key=self.checked_at.__getitem__)[:512]:
                self.checked_at.pop(old, None)
                self.latest.pop(old, None)
        if rendered is not None:
            self.latest[view] = rendered
            if (ev := self.changed.pop(view, None)) is not None:
                ev.set()  # every stream of this view wakes once
        if (ev := self.checked.pop(view, None)) is not None:
            ev.set()

    def wait_changed(self, view: str) -> asyncio.Event:
        return self.changed.setdefault(view, asyncio.Event())

    def wait_checked(self, view: str) -> asyncio.Event:
        return self.checked.setdefault(view, asyncio.Event())


def metrics_render() -> Callable[..., tuple[bytes, str]]:
    """dashboard/prometheus.py's `render`, imported at the first scrape."""
    from dpool.dashboard import prometheus

    return prometheus.render  # type: ignore[no-any-return]


def app(poller: Poller, tokens: Tokens | None, *, render_metrics: Callable[[], Callable[..., tuple[bytes, str]]] = metrics_render) -> web.Application:
    hub = Hub()
    interest: Interest = poller.interest
    loop_box: dict[str, asyncio.AbstractEventLoop] = {}

    def publish(view: str, rendered: views.Rendered | None) -> None:  # from the poller's thread
        loop = loop_box.get("loop")
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(hub.put, view, rendered)

    poller.publish = publish

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return _plain(405, "405: this dashboard only reads (GET, HEAD); it changes nothing.\n", {"Allow": "GET, HEAD"})
        if tokens is not None:
            given = request.query.get("token")
            if given is not None:
                if tokens.viewer(given) is None:
                    return _plain(401, UNAUTHORIZED, {"WWW-Authenticate": 'Bearer realm="dpool"'})
                # The token goes into an HttpOnly cookie, and out of the address (history, logs).
                query = {k: v for k, v in request.query.items() if k != "token"}
                here = request.path.rsplit("/", 1)[-1] or "./"
                resp = web.Response(status=303, headers={"Location": here + (("?" + urlencode(query)) if query else ""), **HEADERS})
                prefix = request.headers.get("X-Forwarded-Prefix", "").rstrip("/")
                secure = request.headers.get("X-Forwarded-Proto", request.scheme) == "https"
                resp.set_cookie(COOKIE, given, httponly=True, samesite="Lax", path=(prefix or "") + "/", secure=secure)
                return resp
            auth = request.headers.get("Authorization", "")
            token = auth[7:] if auth[:7].lower() == "bearer " else request.cookies.get(COOKIE, "")
            if not token or tokens.viewer(token) is None:
                return _plain(401, UNAUTHORIZED, {"WWW-Authenticate": 'Bearer realm="dpool"'})
            request["token"] = token  # a stream checks it again before each update: revoked, it ends
        answer = await handler(request)
        if not answer.prepared:  # a stream sent its headers already (HEADERS among them)
            answer.headers.update({k: v for k, v in HEADERS.items() if k not in answer.headers})
        return answer

    async def first_load(view: str) -> views.Rendered | None:
        """The view's render, as of a poll at most a poll period old: a view nobody looked at
        lately waits for the poller's next round."""
        interest.ask(view)
        seen = hub.checked_at.get(view)
        if seen is None or time.monotonic() - seen > poller.poll_s * 2 + 0.5:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hub.wait_checked(view).wait(), poller.timeout_s * 2 + poller.poll_s + FIRST_WAIT_S)
        return hub.latest.get(view)

    async def show(view: str) -> web.Response:
        rendered = await first_load(view)
        if rendered is None:
            return _plain(503, "503: the dashboard has not heard from the coordinator yet; try again in a moment.\n")
        return web.Response(text=views.page(view, rendered), content_type="text/html", status=rendered.status)

    async def pool(request: web.Request) -> web.StreamResponse:
        return await show("pool")

    async def jobs(request: web.Request) -> web.StreamResponse:
        n = request.query.get("n", "0")
        view = views.list_view_name(request.query.get("before"), int(n) if n.isdigit() else 0)
        if view is None:
            return _plain(404, "404: ?before= takes a job id\n")
        return await show(view)

    async def job(request: web.Request) -> web.StreamResponse:
        view = views.job_view_name(request.match_info["ref"])
        if view is None:
            return _plain(404, "404: not a job id or name\n")
        return await show(view)

    async def stream(request: web.Request) -> web.StreamResponse:
        view = request.query.get("view", "")
        if not (view in ("pool", "jobs") or (view.startswith("jobs?") and views.list_view_name(views.list_before(view), views.list_offset(view)) == view) or (view.startswith("job:") and views.job_view_name(views.job_ref(view)) == view)):
            return _plain(404, "404: no such view\n")
        if hub.streams >= STREAMS_MAX:
            return _plain(503, f"503: {STREAMS_MAX} live pages are open already; close one or reload later.\n", {"Retry-After": "10"})
        if request.method == "HEAD":  # what a GET would start, without starting it
            return web.Response(headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no", **HEADERS})
        await resp.prepare(request)
        hub.streams += 1
        interest.stream(view, +1)
        sent: dict[str, int] = {}
        try:
            await resp.write(f"retry: {RETRY_MS}\n\n".encode())
            while True:
                if tokens is not None and tokens.viewer(request.get("token", "")) is None:
                    break  # the viewer was revoked while its page was open: the page's next try is refused
                changed = hub.wait_changed(view)
                rendered = hub.latest.get(view)
                if rendered is not None:
                    delta = {k: v for k, v in rendered.fragments.items() if sent.get(k) != rendered.sums[k]}
                    if delta:
                        await resp.write(b"event: update\ndata: " + orjson.dumps({"f": delta, "t": time.time()}) + b"\n\n")
                        sent = dict(rendered.sums)
                try:
                    await asyncio.wait_for(changed.wait(), PING_S)
                except TimeoutError:
                    await resp.write(b": ping\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            hub.streams -= 1
            interest.stream(view, -1)
        return resp

    async def metrics(request: web.Request) -> web.StreamResponse:
        if poller.conn.ok or poller.conn.since is None:
            await first_load("metrics")  # a snapshot at most a poll period old
        else:
            interest.ask("metrics")  # the coordinator does not answer: say so now (dpool_up 0), not after a poll's timeout
        try:
            render = render_metrics()
        except ImportError as e:
            return _plain(501, f"501: /metrics is not available in this version ({e}).\n")
        snapshot, conn = poller.metrics_snapshot, poller.conn
        nodes, jobs_, events = snapshot or ([], [], {})
        body, content_type = render(nodes, jobs_, events, request.headers.get("Accept", ""), up=conn.ok, answered_at=conn.polled, known=snapshot is not None)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def static(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC:
            return _plain(404, "404\n")
        data = importlib.resources.files("dpool.dashboard").joinpath("static", name).read_bytes()
        return web.Response(body=data, headers={"Content-Type": f"{STATIC[name]}; charset=utf-8", "Cache-Control": "max-age=300"})

    async def on_startup(application: web.Application) -> None:
        loop_box["loop"] = asyncio.get_running_loop()
        interest.ask("pool")  # the first look at the pool, as soon as serve() listens: not at the first browser

    async def on_shutdown(application: web.Application) -> None:
        poller.stop()
        if poller.thread.is_alive():
            # its own client closed by its own thread, not by the interpreter's exit under a request in flight
            await asyncio.to_thread(poller.thread.join, POLLER_JOIN_S)

    application = web.Application(middlewares=[guard], client_max_size=1024)
    application.router.add_get("/", pool)
    application.router.add_get("/jobs", jobs)
    application.router.add_get("/jobs/{ref}", job)
    application.router.add_get("/stream", stream)
    application.router.add_get("/metrics", metrics)
    application.router.add_get("/static/{name}", static)
    application.on_startup.append(on_startup)
    application.on_shutdown.append(on_shutdown)
    application["hub"] = hub
    application[POLLER] = poller  # started by serve() once it listens
    return application


def _plain(status: int, text: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=text, content_type="text/plain", headers={**HEADERS, **(headers or {})})


async def serve(application: web.Application, host: str, port: int, *, ready: Callable[[str], None] | None = None, stopping: asyncio.Event | None = None) -> None:
    """Serve until `stopping` is set (or forever); OSError when it cannot listen. The app's poller
    starts once the address is bound: a dashboard that cannot listen asks the coordinator nothing,
    and exits with its one error."""
    runner = web.AppRunner(application, access_log=None, handle_signals=False, shutdown_timeout=1.0, handler_cancellation=True)  # a stream whose browser left ends at once
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        if (poller := application.get(POLLER)) is not None:
            poller.start()
        bound = runner.addresses[0] if runner.addresses else (host, port)
        if ready is not None:
            shown = f"[{bound[0]}]" if ":" in str(bound[0]) else str(bound[0])
            ready(f"http://{shown}:{bound[1]}/")
        await (stopping.wait() if stopping is not None else asyncio.Event().wait())
    finally:
        await runner.cleanup()

