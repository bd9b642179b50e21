"""`dpctl cache`: what each node's staging cache holds, and pruning it.

    dpctl cache [NODE] [--json]        one row per node and tree: digest, size (held of total), files, last use,
                                       whether a live job uses it, and where it is served from
    dpctl cache prune [NODE] [--json]  every node (or NODE) deletes the trees no live job uses

The rows are what each node said last (after registering, every few seconds of a fetch and at its
end, after a prune).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import orjson

from dpool.client.rpc import Client
from dpool.client.tables import age, held, table
from dpool.protocol.stage_messages import Cache, CachePrune, CachePruneReply, CacheReply


def add_parser(sub: Any) -> None:
    s = sub.add_parser("cache", help="what each node's staging cache holds; `cache prune [NODE]` deletes the trees no live job uses")
    s.add_argument("action", nargs="?", default=None, help="`prune`, or a node name to list that node's cache only")
    s.add_argument("node", nargs="?", default=None, help="prune: this node only (default: every live node)")
    s.add_argument("--json", action="store_true", help="list: a JSON array of {node, digest, bytes, held, files, last_used, complete, pinned, adopted}; prune: {\"nodes\": [...]}")
    s.set_defaults(fn=cmd_cache)


def cmd_cache(c: Client, a: Any) -> int:
    json = getattr(a, "json", False)
    if a.action == "prune":
        reply = c.call(CachePrune(node=a.node), CachePruneReply)
        if json:
            sys.stdout.write(orjson.dumps({"nodes": reply.nodes}).decode() + "\n")
        else:
            print(f"asked {len(reply.nodes)} node(s) to prune: {', '.join(reply.nodes) or '-'}; `dpctl cache` shows what they hold now")
        return 0
    node = a.action if a.node is None else a.node
    rows = c.call(Cache(node=node), CacheReply).rows
    if json:
        sys.stdout.write(orjson.dumps([r.to_wire() for r in rows]).decode() + "\n")
        return 0
    if not rows:
        print("no node holds anything in its staging cache" if node is None else f"node {node} holds nothing in its staging cache")
        return 0
    now = time.time()
    print(table(
        ["NODE", "DIGEST", "SIZE", "FILES", "USED", "IN USE", "FROM"],
        [[r.node, r.digest[:12], held(r.held, r.bytes, r.complete), r.files, age(now - r.last_used) if r.last_used else "never", "yes" if r.pinned else "", r.adopted or ("cache" if r.complete else "partial")] for r in rows],
    ))
    return 0

