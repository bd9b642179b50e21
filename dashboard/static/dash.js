// dpool dashboard: live updates of the page's sections over server-sent events.
// The server sends the sections that changed ({"f": {id: html}}); each replaces the inner HTML of the
// element with that id. The stream's address is relative (data-stream on <body>), so the page works
// under any sub-path. When the stream ends (the dashboard or a proxy restarts), the browser's own
// reconnection is tried first; a stream that failed for good is opened again with a growing pause.
(function () {
  "use strict";
  var body = document.body;
  var src = body.getAttribute("data-stream");
  if (!src || !window.EventSource) return;
  var es = null, pause = 1000, timer = null;

  function say(state) {
    body.setAttribute("data-live", state);
  }

  function apply(msg) {
    var parts = msg.f || {};
    for (var id in parts) {
      if (!Object.prototype.hasOwnProperty.call(parts, id)) continue;
      var el = document.getElementById(id);
      if (el) el.innerHTML = parts[id];
    }
    if (msg.t) body.setAttribute("data-updated", String(msg.t));
  }

  function connect() {
    timer = null;
    es = new EventSource(src);
    es.addEventListener("open", function () { pause = 1000; say("live"); });
    es.addEventListener("update", function (ev) {
      try { apply(JSON.parse(ev.data)); } catch (err) { /* a malformed update: keep the page as it is */ }
    });
    es.addEventListener("error", function () {
      say("reconnecting");
      if (es.readyState === EventSource.CLOSED && timer === null) {
        es.close();
        timer = setTimeout(connect, pause);
        pause = Math.min(pause * 2, 15000);
      }
    });
  }
  connect();
})();
